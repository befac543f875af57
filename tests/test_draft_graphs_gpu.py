"""The DFlash draft forward captured per batch bucket (engine/draft_graphs.py), on a GPU: a replay
equals the eager draft over the same rings (engine/draft_context.py), reads each round's new
rings, lengths and tokens, neither syncs nor allocates; the tiny-code engine drafts through it
with the same greedy tokens as without graphs.

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

from treeverify.engine.draft_context import DraftContextCache, _Context  # noqa: E402
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

WINDOW = 192  # rows a draft reads at most; the rings are WINDOW + SLACK = 256 rows
DEPTHS = (15, 7)  # tiny-code-dflash's whole block (DDTREE's default) and a shorter chain
BUCKETS = (1, 2, 4, 8)


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def setup(request):
    """(drafter, context store of 8 rings, graphs) on the GPU in the engine's dtype (bf16) and
    in fp32."""
    dtype = request.param
    cfg, model, _ = load_model("tiny-code", dtype=dtype, device="cuda")
    drafter = make_source("tiny-code-dflash", model, cfg, dtype, "cuda").drafter
    context = DraftContextCache(drafter, WINDOW)
    context.fix(8, torch.device("cuda"))
    graphs = DraftGraphs(context, BUCKETS, DEPTHS, torch.device("cuda"))
    return drafter, context, graphs


def _random_round(context, b: int, rng: random.Random, counts: list[int] | None = None):
    """Fresh random ring contents (every ring, the scratch one too) and b requests on rings in
    a random order, each holding `counts` rows (random: up to the ring) ending at a random
    position (rings wrapped or not); returns their ids and last tokens."""
    gen = torch.Generator(device="cuda").manual_seed(rng.randrange(2**31))
    context.kv.copy_(torch.randn(context.kv.shape, generator=gen, device="cuda"))
    context._ctx.clear()
    w = context.width
    slots = rng.sample(range(context.slots), b)
    counts = counts or [rng.randint(1, w) for _ in range(b)]
    rids = []
    for i, (slot, count) in enumerate(zip(slots, counts, strict=True)):
        rid = f"r{i}"
        end = count + rng.choice([0, rng.randrange(0, 3000)])
        context._ctx[rid] = _Context(slot=slot, end=end, count=count)
        rids.append(rid)
    tokens = [rng.randrange(context.drafter.config.vocab_size) for _ in range(b)]
    return rids, tokens


@torch.inference_mode()
def _eager(context, rids, tokens, depth, bucket: int | None = None, rows: int | None = None):
    """The eager draft over the rings: the bucket's rows (padding as the graphs pad) and all W
    ring rows, or B rows and `rows` ring rows."""
    meta = context.draft_meta(rids, tokens, bucket)
    b = len(rids)
    return context.draft(torch.tensor(meta, device="cuda"), depth, rows)[:b]


@torch.inference_mode()
def _replay(graphs: DraftGraphs, rids, tokens, depth) -> torch.Tensor:
    """graphs.propose with every graph output poisoned first, under sync debug mode "error" (any
    host<->device sync raises); asserts it allocated no GPU memory."""
    for _, out in graphs.graphs.values():
        out.fill_(float("nan"))
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    replays = graphs.replays
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = graphs.propose(rids, tokens, depth)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got is not None and graphs.replays == replays + 1
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
    return got.clone()


def _check(context, graphs, rids, tokens, depth, got, msg):
    b = len(rids)
    drafter = context.drafter
    # the drafter's own rule: bf16 engines draft in the lm_head's bf16, fp32 ones in fp32
    assert got.shape == (b, depth, drafter.config.vocab_size)
    assert got.dtype == drafter.logits_dtype(), (got.dtype, msg)
    assert got.dtype == (torch.bfloat16 if drafter.fc.weight.dtype == torch.bfloat16
                         else torch.float32), (got.dtype, msg)  # fmt: skip
    assert torch.isfinite(got).all(), msg  # every row written (the outputs were NaN)
    # Same kernels over the same shapes: bit-identical (rows masked out add exact 0s).
    want = _eager(context, rids, tokens, depth, bucket=graphs.bucket_for(b))
    assert torch.equal(got, want), f"{msg}: max |diff| {(got - want).abs().max().item()}"
    if drafter.fc.weight.dtype == torch.float32:
        # The eager engine's shapes (B rows, only the ring rows in use): other GEMM shapes, so
        # float rounding only (fp32, TF32 off: ~1e-6 relative).
        ends = [context.ring(r)[2] for r in rids]
        today = _eager(context, rids, tokens, depth, rows=context.eager_rows(ends))
        torch.testing.assert_close(got, today, rtol=1e-4, atol=1e-3, msg=msg)


@pytest.mark.parametrize("b", [1, 3, 8])
def test_replay_equals_eager_and_reads_each_round(setup, b):
    _, context, graphs = setup
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    w = context.width
    for depth in DEPTHS:
        # (a) one ring full, one nearly empty (batch 1: full now, short in the second round)
        counts = [rng.randint(1, w) for _ in range(b)]
        counts[0] = w
        counts[-1] = counts[-1] if b == 1 else rng.randint(1, 4)
        rids, tokens = _random_round(context, b, rng, counts)
        first = _replay(graphs, rids, tokens, depth)
        _check(context, graphs, rids, tokens, depth, first, f"seed {seed} depth {depth}")
        # (b) new rings, counts, ends and tokens: the replay reads them
        counts2 = [rng.randint(1, 5) if b == 1 else rng.randint(1, w) for _ in range(b)]
        rids2, tokens2 = _random_round(context, b, rng, counts2)
        second = _replay(graphs, rids2, tokens2, depth)
        _check(context, graphs, rids2, tokens2, depth, second, f"seed {seed} round 2")
        assert not torch.equal(first, second)
        # only request 0's last token changes: its row changes, the others' rows do not
        tokens3 = [(tokens2[0] + 1) % context.drafter.config.vocab_size, *tokens2[1:]]
        third = _replay(graphs, rids2, tokens3, depth)
        _check(context, graphs, rids2, tokens3, depth, third, f"seed {seed} round 3")
        assert not torch.equal(third[0], second[0])
        assert torch.equal(third[1:], second[1:])


def test_meta_staging_never_reuses_a_buffer_still_being_copied(setup, monkeypatch):
    """While the last meta copy is (said to be) still queued, the reused pinned buffer is left
    alone and a fresh one is staged: same results, still no sync."""
    _, context, graphs = setup
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))

    class StillQueued:
        def query(self) -> bool:
            return False

        def record(self) -> None:
            pass

    rids, tokens = _random_round(context, 3, rng)
    _replay(graphs, rids, tokens, 15)  # the reused buffer now holds this round's meta
    held = graphs.meta.host.clone()
    monkeypatch.setattr(graphs.meta, "_staged", StillQueued())
    rids2, tokens2 = _random_round(context, 3, rng)
    got = _replay(graphs, rids2, tokens2, 15)
    assert torch.equal(graphs.meta.host, held)  # untouched
    _check(context, graphs, rids2, tokens2, 15, got, "fresh staging buffer")


def test_uncaptured_cases_fall_back(setup):
    """None (the caller drafts eagerly) for a batch past every bucket, a depth not captured."""
    _, context, graphs = setup
    rng = random.Random(0)
    rids, tokens = _random_round(context, 8, rng, [3] * 8)
    replays = graphs.replays
    assert graphs.propose(rids + ["r0"], tokens + [1], 15) is None
    assert graphs.propose(rids[:2], tokens[:2], 3) is None
    assert graphs.replays == replays


@pytest.mark.parametrize("algorithm,budget,depth", [("DDTREE", 16, 15), ("CHAIN", 8, 8)])
def test_tiny_code_engine_drafts_through_the_graphs_same_tokens(
    algorithm, budget, depth, same_kernels_at_any_padding
):
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
                  speculative_adaptive=False, disable_cuda_graph=not graphs,
                  disable_round_graphs=True)  # fmt: skip
        outs[graphs] = [o.token_ids for o in llm.generate(prompts, sp)]  # batch 3 (bucket 4)
        outs[graphs].append(llm.generate(prompts[:1], sp)[0].token_ids)  # batch 1
        assert llm.spec_stats["drafter"] == "dflash" and llm.spec_stats["rounds"] > 0
        info = llm.cuda_graph_info
        if graphs:
            # W: the window (2048) capped at tiny-code's 1024 positions, + the rings' slack
            assert info["draft"]["context_width"] == 1024 + DraftContextCache.SLACK
            assert info["draft"]["depths"] == [depth]
            assert info["draft"]["replays"] > 0, info
            assert llm.spec.source.graphs.replays == info["draft"]["replays"]
        else:
            assert "draft" not in info and llm.spec.source.graphs is None
        del llm
    assert outs[True] == outs[False], f"seed {seed}"


@pytest.mark.parametrize(
    "whole,ahead,sampled",
    [(True, True, False), (True, False, False), (False, False, False), (True, True, True)],
    ids=["lookahead", "whole-round", "general", "lookahead-sampled"],
)
def test_steady_state_round_reads_the_device_once_and_never_else_syncs(
    monkeypatch, whole, ahead, sampled
):
    """Issue 14's round contract, end to end on the engine (tiny-code + its DFlash drafter,
    DDTREE at a fixed budget, CUDA graphs, two requests): a steady-state step, from scheduling
    through draft, tree build, verify, accept, K/V moves, commit and the drafter's context
    upkeep, runs under torch.cuda.set_sync_debug_mode("error") (any host<->device sync raises)
    except for the round's one intended read, which is counted: exactly one per step (the
    general path: the packed results' `tolist()`; whole rounds: the wait for the event after
    their copy into pinned memory, with lookahead the next round already queued behind it).
    (Sync debug mode sees the syncs PyTorch itself issues, not every driver call;
    torch.profiler's syncs per step in scripts/profile_round_gpu.py is the check from the
    other side.) `sampled`: T=1 with the fused pick (TREEVERIFY_FUSED_DECODE_STEP=1), whose
    whole rounds draw each node's token in the graph from the staged temperature and key."""
    if sampled:
        monkeypatch.setenv("TREEVERIFY_FUSED_DECODE_STEP", "1")
    heldout = json.loads((shipped_dir("tiny-code") / "heldout.json").read_text())["prompts"]
    llm = LLM("tiny-code", device="cuda", num_pages=256, cuda_graph_max_bs=2,
              speculative_algorithm="DDTREE", speculative_ddtree_budget=16,
              speculative_adaptive=False, disable_round_graphs=not whole,
              round_lookahead=ahead)  # fmt: skip
    sp = SamplingParams(temperature=1.0 if sampled else 0, seed=3, max_tokens=200,
                        ignore_eos=True)  # fmt: skip
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
    wait = torch.cuda.Event.synchronize

    def wait_once(event):  # the lookahead's read: a wait for the copy of this round's results
        torch.cuda.set_sync_debug_mode("default")
        try:
            reads.append("event")
            return wait(event)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(torch.cuda.Event, "synchronize", wait_once)
    rounds = llm.spec_stats["rounds"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(6):
            assert not any(s.is_finished for s in seqs)
            llm.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(reads) == 6, reads  # one read per step, each the (B, 2 + 2K) packed results
    if whole:  # the packed results copied into pinned memory: the read waits for that copy
        assert set(reads) == {"event"}, reads
        assert (llm.rounds.info["ahead_used"] >= 6) == ahead, llm.rounds.info
    else:
        assert all(shape[0] == 2 for shape in reads), reads
    assert llm.spec_stats["rounds"] == rounds + 12  # two requests' rounds per step
    assert (llm.rounds is not None and llm.rounds.replays >= 6) == whole
