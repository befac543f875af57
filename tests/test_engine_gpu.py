"""The engine on a GPU: CUDA graphs per bucket against eager, KV sizing, capture failures.

Real CUDA graphs, the real CUDA tree-attention kernels; skipped without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from treeverify.engine.cuda_graphs import GraphCaptureError
from treeverify.engine.llm import LLM
from treeverify.engine.paged_attention import PagedAttention
from treeverify.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def prompts(n: int, length: int = 40, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length,), generator=g).tolist() for _ in range(n)]


def greedy(n: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-kimi"])
def test_graphs_match_eager_at_bucket_sizes(model):
    """Batch sizes that are buckets (no padding) give the same greedy tokens, graphs on or off;
    a padded batch (3 in bucket 4) as well."""
    got = {}
    for graphs in (True, False):
        llm = LLM(model, device="cuda", num_pages=256, disable_cuda_graph=not graphs,
                  cuda_graph_max_bs=8)  # fmt: skip
        for b in (1, 3, 4):
            got[(graphs, b)] = [o.token_ids for o in llm.generate(prompts(b, seed=b), greedy())]
        if graphs:
            assert llm.runner.graphs is not None and llm.runner.graphs.replays > 0
            assert (4, 1) in llm.runner.graphs.steps
        else:
            assert llm.runner.graphs is None
        del llm
    for b in (1, 3, 4):
        assert got[(True, b)] == got[(False, b)], b


def test_replay_allocates_nothing_and_reads_new_metadata():
    llm = LLM("tiny-llama", device="cuda", num_pages=128, cuda_graph_max_bs=4)
    llm.generate(prompts(2), greedy(4))  # steady state
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    outs = llm.generate(prompts(2, seed=5), greedy(8))
    # the sampler and host->device copies allocate small tensors; the forward itself does not:
    # the graph replays' allocations would scale with layers x steps
    after = torch.cuda.memory_stats()["allocation.all.allocated"]
    assert after - before < 8 * 40, after - before
    assert all(len(o.token_ids) == 8 for o in outs)
    # different prompts -> different outputs: replays really read the new metadata and inputs
    again = llm.generate(prompts(2, seed=6), greedy(8))
    assert [o.token_ids for o in again] != [o.token_ids for o in outs]


def test_kv_pool_sized_from_mem_fraction():
    free, total = torch.cuda.mem_get_info()
    used = total - free
    frac = min(0.95, (used + 2 * 1024**3) / total)  # about 2 GiB for weights + KV
    llm = LLM("tiny-llama", device="cuda", mem_fraction_static=frac, cuda_graph_max_bs=2)
    assert llm.startup["kv"].startswith("KV cache: ")
    assert llm.block_manager.num_pages > 1000
    # the pool takes what the fraction leaves: within a few pages of the budget
    assert llm.cache.bytes <= frac * total - used + 64 * 1024**2
    out = llm.generate(prompts(1), greedy(4))
    assert len(out[0].token_ids) == 4
    del llm
    with pytest.raises(ValueError, match="mem_fraction_static"):
        LLM("tiny-llama", device="cuda", mem_fraction_static=max(used / total / 2, 1e-4))


def test_capture_failure_names_the_bucket(monkeypatch):
    real = PagedAttention._run  # where every attention path ends (the fused GQA one too)

    def syncing(self, *a, **k):  # a host sync inside a captured step must fail the capture
        out = real(self, *a, **k)
        if torch.cuda.is_current_stream_capturing():
            float(out.sum())
        return out

    monkeypatch.setattr(PagedAttention, "_run", syncing)
    with pytest.raises(GraphCaptureError, match=r"bucket batch=\d+ tokens_per_request=\d+"):
        LLM("tiny-llama", device="cuda", num_pages=64, cuda_graph_max_bs=2)


def test_speculative_rounds_replay_tree_buckets():
    """DDTREE verify steps replay their (batch, budget+1) graphs; greedy output equals the
    eager speculative engine's and the plain engine's (tiny-llama, bf16)."""
    kw = dict(device="cuda", num_pages=256, cuda_graph_max_bs=4)
    outs = {}
    for name, extra in (
        ("graph", dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=8)),
        ("eager", dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=8,
                       disable_cuda_graph=True)),
    ):  # fmt: skip
        llm = LLM("tiny-llama", **kw, **extra)
        rep = [list(range(65, 80)) * 3 for _ in range(2)]  # repetitive: the drafter hits
        outs[name] = [o.token_ids for o in llm.generate(rep, greedy(20))]
        if name == "graph":
            assert llm.config.tree_sizes == (5, 9)  # the adaptive budgets 4 and 8
            assert (2, llm.config.tree_size) in llm.runner.graphs.steps
            assert llm.spec_stats["rounds"] > 0
        del llm
    assert outs["graph"] == outs["eager"]


def test_dflash_rounds_under_graphs_match_eager():
    """The DFlash drafter's conditioning (the target's layer outputs) comes out of the captured
    graphs as it does eagerly: same greedy tokens, graphs on or off."""
    outs = {}
    for graphs in (True, False):
        spec = dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=8,
                    speculative_draft_model_path="tiny-dflash")  # fmt: skip
        llm = LLM("tiny-llama", device="cuda", num_pages=256, cuda_graph_max_bs=4,
                  disable_cuda_graph=not graphs, **spec)  # fmt: skip
        outs[graphs] = [o.token_ids for o in llm.generate(prompts(3, seed=9), greedy(16))]
        assert llm.spec_stats["rounds"] > 0
        del llm
    assert outs[True] == outs[False]


def test_planted_fault_runs_under_graphs(monkeypatch):
    """Planted faults (TEST ONLY) are wrappers installed at startup: with one set, CUDA graphs
    stay on and the fault shows through the captured path, only where it should."""
    long, short = prompts(1, length=120, seed=11), prompts(1, length=12, seed=12)
    mid = prompts(1, length=56, seed=13)
    kw = dict(device="cuda", num_pages=128, cuda_graph_max_bs=2)
    healthy = LLM("tiny-llama", **kw)
    want = [healthy.generate(p, greedy(8))[0].token_ids for p in (long, short)]
    want_mid = healthy.generate(mid, greedy(16))[0].token_ids
    del healthy
    monkeypatch.setenv("TREEVERIFY_FAULT", "attn_past:64")
    llm = LLM("tiny-llama", **kw)
    assert llm.planted_fault == "attn_past" and llm.runner.graphs is not None
    got = [llm.generate(p, greedy(8))[0].token_ids for p in (long, short)]
    assert llm.runner.graphs.replays > 0
    assert got[0] != want[0]  # context > 64: corrupted inside the replayed graphs
    assert got[1] == want[1]  # context <= 64 (12 + 8 tokens): untouched
    # Crossing 64 during decoding, in staged replays (no plan() call): token j comes from a row
    # whose context is 56 + j, so tokens 0..8 are right and the fault starts at token 9.
    got_mid = llm.generate(mid, greedy(16))[0].token_ids
    assert got_mid[:9] == want_mid[:9] and got_mid != want_mid


def test_decode_step_forward_never_waits_for_the_gpu():
    """A steady-state decode step's plan + graph replay only enqueue work: under
    torch.cuda.set_sync_debug_mode("error") any host<->device synchronisation raises. (The
    sampler's one read of the step's tokens comes after and is the step's intended sync.)"""
    llm = LLM("tiny-llama", device="cuda", num_pages=128, cuda_graph_max_bs=2)
    llm.generate(prompts(2), greedy(4))  # steady state: kernels, plans, pinned blocks cached
    seqs = [llm.add_request(p, greedy(16)) for p in prompts(2, seed=3)]
    while any(s.num_output_tokens < 2 for s in seqs):
        llm.step()
    batch = llm.scheduler.schedule()
    assert len(batch.chunks) == 2 and all(c.num_tokens == 1 for c in batch.chunks)
    torch.cuda.set_sync_debug_mode("error")
    try:
        rows = llm.runner.run(batch).per_sequence()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert llm.runner.graphs.replays > 0 and len(rows) == 2
    assert torch.isfinite(torch.cat(rows)).all()
