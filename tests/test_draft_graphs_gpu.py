"""The DFlash draft forward captured per batch bucket (engine/draft_graphs.py), on a GPU: a replay
equals the eager `propose_from_kv`, reads each round's new contexts and tokens, neither syncs nor
allocates; the tiny-code engine drafts through it with the same greedy tokens as without graphs.

Real CUDA graphs, the shipped tiny-code target and its trained drafter; skipped without a GPU.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from treeverify.engine.draft_graphs import DraftGraphs  # noqa: E402
from treeverify.engine.drafters import make_source  # noqa: E402
from treeverify.engine.llm import LLM  # noqa: E402
from treeverify.engine.sampling_params import SamplingParams  # noqa: E402
from treeverify.models import load_model  # noqa: E402
from treeverify.models.shipped import shipped_dir  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

WIDTH = 256  # W of the graphs built here (the engine's is the window capped at the max context)
DEPTHS = (15, 7)  # tiny-code-dflash's whole block (DDTREE's default) and a shorter chain
BUCKETS = (1, 2, 4, 8)


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def setup(request):
    """(drafter, graphs) on the GPU in the engine's dtype (bf16) and in fp32."""
    dtype = request.param
    cfg, model, _ = load_model("tiny-code", dtype=dtype, device="cuda")
    drafter = make_source("tiny-code-dflash", model, cfg, dtype, "cuda").drafter
    graphs = DraftGraphs(drafter, BUCKETS, DEPTHS, WIDTH, torch.device("cuda"))
    return drafter, graphs


def _random_round(drafter, b: int, rng: random.Random, lens: list[int] | None = None):
    """Fresh random context keys/values per request (C_i, nl, 2, Hkv, D) on the GPU, last
    tokens, block starts (the context starts at a random position >= 0)."""
    c = drafter.config
    lens = lens or [rng.randint(1, WIDTH) for _ in range(b)]
    gen = torch.Generator(device="cuda").manual_seed(rng.randrange(2**31))
    shape = (c.num_hidden_layers, 2, c.num_key_value_heads, c.head_dim)
    dtype = drafter.fc.weight.dtype
    kvs = [torch.randn(n, *shape, generator=gen, device="cuda").to(dtype) for n in lens]
    tokens = [rng.randrange(c.vocab_size) for _ in range(b)]
    starts = [n + rng.randrange(0, 3000) for n in lens]
    return kvs, tokens, starts


@torch.inference_mode()
def _eager_bucket_shapes(drafter, graphs: DraftGraphs, kvs, tokens, starts, depth):
    """Eager propose_from_kv over the shapes the graph replays (the bucket's rows, W context
    rows), built independently: zeros past each length, padding requests as DraftGraphs pads."""
    b = len(kvs)
    bucket = graphs.bucket_for(b)
    ctx = torch.zeros(bucket, WIDTH, *kvs[0].shape[1:], dtype=kvs[0].dtype, device="cuda")
    for i, kv in enumerate(kvs):
        ctx[i, : kv.shape[0]] = kv
    pad = bucket - b
    lens = torch.tensor([kv.shape[0] for kv in kvs] + [0] * pad, device="cuda")
    toks = torch.tensor(tokens + [graphs.pad_token] * pad, device="cuda")
    pos = torch.tensor(starts + [0] * pad, device="cuda")
    return drafter.propose_from_kv(ctx, lens, toks, pos, depth)[:b]


@torch.inference_mode()
def _eager_today(drafter, kvs, tokens, starts, depth):
    """What DFlashSource does without graphs: contexts padded to the longest, B rows."""
    padded = torch.nn.utils.rnn.pad_sequence(list(kvs), batch_first=True)
    lens = torch.tensor([kv.shape[0] for kv in kvs], device="cuda")
    t, s = torch.tensor(tokens, device="cuda"), torch.tensor(starts, device="cuda")
    return drafter.propose_from_kv(padded, lens, t, s, depth)


@torch.inference_mode()
def _replay(graphs: DraftGraphs, kvs, tokens, starts, depth) -> torch.Tensor:
    """graphs.propose with every graph output poisoned first, under sync debug mode "error" (any
    host<->device sync raises); asserts it allocated no GPU memory."""
    for _, out in graphs.graphs.values():
        out.fill_(float("nan"))
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    replays = graphs.replays
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = graphs.propose(kvs, tokens, starts, depth)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got is not None and graphs.replays == replays + 1
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
    return got.clone()


def _check(drafter, graphs, kvs, tokens, starts, depth, got, msg):
    b = len(kvs)
    assert got.shape == (b, depth, drafter.config.vocab_size) and got.dtype == torch.float32
    assert torch.isfinite(got).all(), msg  # every row written (the outputs were NaN)
    # Same kernels over the same shapes: bit-identical (stale rows past a length add exact 0s).
    want = _eager_bucket_shapes(drafter, graphs, kvs, tokens, starts, depth)
    assert torch.equal(got, want), f"{msg}: max |diff| {(got - want).abs().max().item()}"
    if drafter.fc.weight.dtype == torch.float32:
        # Today's eager shapes (B rows, padded to the longest): other GEMM shapes, so float
        # rounding only (fp32, TF32 off: ~1e-6 relative).
        today = _eager_today(drafter, kvs, tokens, starts, depth)
        torch.testing.assert_close(got, today, rtol=1e-4, atol=1e-3, msg=msg)


@pytest.mark.parametrize("b", [1, 3, 8])
def test_replay_equals_eager_and_reads_each_round(setup, b):
    drafter, graphs = setup
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    for depth in DEPTHS:
        # (a) one context of the full width W, one short (batch 1: the full one now, a short
        # one in the second round)
        lens = [rng.randint(1, WIDTH) for _ in range(b)]
        lens[0] = WIDTH
        lens[-1] = lens[-1] if b == 1 else rng.randint(1, 4)
        kvs, tokens, starts = _random_round(drafter, b, rng, lens)
        first = _replay(graphs, kvs, tokens, starts, depth)
        _check(drafter, graphs, kvs, tokens, starts, depth, first, f"seed {seed} depth {depth}")
        # (b) again with other lengths (shorter: stale rows of round 1 stay behind, masked),
        # other tokens and positions: the replay reads them
        lens2 = [rng.randint(1, 5) if b == 1 else rng.randint(1, WIDTH) for _ in range(b)]
        kvs2, tokens2, starts2 = _random_round(drafter, b, rng, lens2)
        second = _replay(graphs, kvs2, tokens2, starts2, depth)
        _check(drafter, graphs, kvs2, tokens2, starts2, depth, second, f"seed {seed} round 2")
        assert not torch.equal(first, second)
        # only request 0's last token changes: its row changes, the others' rows do not
        tokens3 = [(tokens2[0] + 1) % drafter.config.vocab_size, *tokens2[1:]]
        third = _replay(graphs, kvs2, tokens3, starts2, depth)
        _check(drafter, graphs, kvs2, tokens3, starts2, depth, third, f"seed {seed} round 3")
        assert not torch.equal(third[0], second[0])
        assert torch.equal(third[1:], second[1:])


def test_meta_staging_never_reuses_a_buffer_still_being_copied(setup, monkeypatch):
    """While the last meta copy is (said to be) still queued, the reused pinned buffer is left
    alone and a fresh one is staged: same results, still no sync."""
    drafter, graphs = setup
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))

    class StillQueued:
        def query(self) -> bool:
            return False

        def record(self) -> None:
            pass

    kvs, tokens, starts = _random_round(drafter, 3, rng)
    _replay(graphs, kvs, tokens, starts, 15)  # the reused buffer now holds this round's meta
    held = graphs.meta_host.clone()
    monkeypatch.setattr(graphs, "_staged", StillQueued())
    kvs2, tokens2, starts2 = _random_round(drafter, 3, rng)
    got = _replay(graphs, kvs2, tokens2, starts2, 15)
    assert torch.equal(graphs.meta_host, held)  # untouched
    _check(drafter, graphs, kvs2, tokens2, starts2, 15, got, "fresh staging buffer")


def test_uncaptured_cases_fall_back(setup):
    """None (the caller drafts eagerly) for a batch past every bucket, a context longer than W,
    a depth not captured."""
    drafter, graphs = setup
    rng = random.Random(0)
    kvs, tokens, starts = _random_round(drafter, 9, rng, [3] * 9)
    replays = graphs.replays
    assert graphs.propose(kvs, tokens, starts, 15) is None
    long, t1, s1 = _random_round(drafter, 1, rng, [WIDTH + 1])
    assert graphs.propose(long, t1, s1, 15) is None
    assert graphs.propose(kvs[:2], tokens[:2], starts[:2], 3) is None
    assert graphs.replays == replays


@pytest.mark.parametrize("algorithm,budget,depth", [("DDTREE", 16, 15), ("CHAIN", 8, 8)])
def test_tiny_code_engine_drafts_through_the_graphs_same_tokens(algorithm, budget, depth):
    """tiny-code + its DFlash drafter at a fixed budget: greedy tokens with CUDA graphs (the
    draft replayed) equal those without (`disable_cuda_graph`), batched and alone. DDTREE drafts
    the whole block's 15 positions; CHAIN of budget 8 drafts 8 (its chain's length)."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    heldout = json.loads((shipped_dir("tiny-code") / "heldout.json").read_text())["prompts"]
    prompts = [text[: rng.randrange(100, 600)] for text in rng.sample(heldout, 3)]
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    outs = {}
    for graphs in (True, False):
        llm = LLM("tiny-code", device="cuda", num_pages=256, cuda_graph_max_bs=4,
                  speculative_algorithm=algorithm, speculative_ddtree_budget=budget,
                  speculative_adaptive=False, disable_cuda_graph=not graphs)  # fmt: skip
        outs[graphs] = [o.token_ids for o in llm.generate(prompts, sp)]  # batch 3 (bucket 4)
        outs[graphs].append(llm.generate(prompts[:1], sp)[0].token_ids)  # batch 1
        assert llm.spec_stats["drafter"] == "dflash" and llm.spec_stats["rounds"] > 0
        info = llm.cuda_graph_info
        if graphs:
            # W: the window (2048) capped at tiny-code's 1024 positions
            assert info["draft"]["context_width"] == 1024 and info["draft"]["depths"] == [depth]
            assert info["draft"]["replays"] > 0, info
            assert llm.spec.source.graphs.replays == info["draft"]["replays"]
        else:
            assert "draft" not in info and llm.spec.source.graphs is None
        del llm
    assert outs[True] == outs[False], f"seed {seed}"


def test_steady_state_round_reads_the_device_once_and_never_else_syncs(monkeypatch):
    """Issue 14's round contract, end to end on the engine (tiny-code + its DFlash drafter,
    DDTREE at a fixed budget, CUDA graphs, two requests): a steady-state step, from scheduling
    through draft, tree build, verify, accept, K/V moves, commit and the drafter's context
    upkeep, runs under torch.cuda.set_sync_debug_mode("error") (any host<->device sync raises)
    except for the round's one intended read, the packed results' `tolist()`, which is counted:
    exactly one per step. (Sync debug mode sees the syncs PyTorch itself issues, not every
    driver call; torch.profiler's syncs per step in scripts/profile_round_gpu.py is the check
    from the other side.)"""
    heldout = json.loads((shipped_dir("tiny-code") / "heldout.json").read_text())["prompts"]
    llm = LLM("tiny-code", device="cuda", num_pages=256, cuda_graph_max_bs=2,
              speculative_algorithm="DDTREE", speculative_ddtree_budget=16,
              speculative_adaptive=False)  # fmt: skip
    sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    llm.generate([heldout[0][:300]], SamplingParams(temperature=0, max_tokens=32))  # warm
    seqs = [llm.add_request(p[:300], sp) for p in heldout[1:3]]
    while any(s.num_output_tokens < 8 for s in seqs):  # prefills done, rounds running
        llm.step()
    reads = []
    tolist = torch.Tensor.tolist

    def read_once(t):  # a device read is the intended one: allowed, counted
        if not t.is_cuda:
            return tolist(t)
        torch.cuda.set_sync_debug_mode("default")
        try:
            reads.append(tuple(t.shape))
            return tolist(t)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(torch.Tensor, "tolist", read_once)
    rounds = llm.spec_stats["rounds"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(6):
            assert not any(s.is_finished for s in seqs)
            llm.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(reads) == 6, reads  # one read per step, each the (B, 2 + 2K) packed results
    assert all(shape[0] == 2 for shape in reads), reads
    assert llm.spec_stats["rounds"] == rounds + 12  # two requests' rounds per step
