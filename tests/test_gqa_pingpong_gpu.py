"""The sm_90a GQA kernels for 128-row CTAs against the reference: the ping-pong kernel (a
producer warpgroup, mbarrier-guarded slots, two consumer warpgroups taking turns on the MMAs)
with each of its producers: the default's (TREEVERIFY_CUDA_GQA_SCHEDULE=pingpong-auto: one of the
next two per launch, by the batch's key count), row pointers shared through shared memory
(=pingpong), producer threads looking their own rows up (=pingpong-direct), warp shuffles
(=pingpong-shfl), whole paged tiles by TMA (=pingpong-tma), TMA tiles multicast to a 2-CTA
cluster (=pingpong-tma2); the default's 256-row CTAs (`:256`, TREEVERIFY_CUDA_GQA_256=1); Q in
registers (`:q`, TREEVERIFY_CUDA_GQA_Q_REGS=1); and the tile kernel it replaced (=tile, kept
for A/B runs), on the same edge cases. The TMA producers also at every page size they take and
through the SGLang drop-in; every producer captured and replayed with new metadata; the auto
producer switching inside one graph.

A barrier bug hangs rather than fails: scripts/gpu-check runs the GPU tests under a timeout.
Skipped without a CUDA GPU; both kernels exist on sm_90a only (elsewhere the schedule falls back
to the portable kernel, which these tests then check too). Outputs are poisoned with NaN before
the kernel runs.
"""

from __future__ import annotations

import pytest
import torch

from test_cuda_gpu import TOL, _cuda, _load_step, _plan, _poisoned, _reference, _rel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# (Hq, Hkv, D, page, prefixes, trees): >= 128 packed rows a KV head (the ping-pong CTA), tile
# counts 0 (an m-tile past a split's keys), 1, 2, 4+ a split, empty prefixes, trees crossing a
# tile edge, rows not filling the last m-tile, group sizes 4 and 8.
EDGES = [
    (32, 8, 128, 16, [0, 1, 63, 64, 65, 700], [64, 40, 33, 64, 64, 17]),
    (32, 8, 64, 1, [5000, 130], [64, 64]),
    (64, 8, 128, 16, [9000], [33]),
    (32, 4, 128, 16, [300, 2000, 4100], [64, 20, 48]),
]


@pytest.mark.parametrize("splits", [None, "4"], ids=["policy", "4splits"])
@pytest.mark.parametrize("edge", EDGES, ids=["tiles", "d64-page1", "group8", "mixed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "schedule",
    ["pingpong", "tile", "pingpong-direct", "pingpong-shfl", "pingpong-tma", "pingpong:q",
     "pingpong-tma:q", "pingpong-tma2", "pingpong-auto", "pingpong-auto:256", "pingpong-persist"],
)  # fmt: skip
def test_gqa_128_row_kernels_match_reference(schedule, edge, dtype, splits, monkeypatch):
    """`:q`: with TREEVERIFY_CUDA_GQA_Q_REGS=1 (Q's fragments in registers); `:256`: with
    TREEVERIFY_CUDA_GQA_256=1 (the default schedule's 256-row CTAs wherever the rows reach 256;
    0 otherwise, so the plain entries keep 128-row CTAs)."""
    from treeverify.bench.cases import Case, make_inputs

    schedule, *opts = schedule.split(":")
    monkeypatch.setenv("TREEVERIFY_CUDA_GQA_SCHEDULE", schedule)
    monkeypatch.setenv("TREEVERIFY_CUDA_GQA_Q_REGS", "1" if "q" in opts else "0")
    monkeypatch.setenv("TREEVERIFY_CUDA_GQA_256", "1" if "256" in opts else "0")
    if splits:  # many splits: m-tiles whose later splits have no key (n_tiles == 0)
        monkeypatch.setenv("TREEVERIFY_CUDA_MAX_SPLITS", splits)
    hq, hkv, d, page, prefixes, trees = edge
    case = Case("gqa", len(prefixes), max(prefixes), max(trees), hq, hkv, d, d, False)
    inp = make_inputs(case, page_size=page, device="cuda", dtype=dtype, seed=len(prefixes),
                      prefix_lens=prefixes, tree_sizes=trees)  # fmt: skip
    out = _cuda(inp, out=_poisoned(inp, d))
    assert _rel(out, _reference(inp)) <= TOL


@pytest.mark.parametrize(
    "schedule",
    [
        None,
        "pingpong-direct",
        "pingpong-shfl",
        "pingpong-tma",
        "pingpong:q",
        "pingpong-tma2",
        "pingpong-auto",
        "pingpong-auto:256",
        "pingpong-persist",
    ],
    ids=["default", "direct", "shfl", "tma", "q-regs", "tma2", "auto", "256", "persist"],
)
def test_pingpong_captured_and_replayed_with_new_metadata(schedule, monkeypatch):
    """One captured plan on the ping-pong kernel, replayed over new lengths, trees and split
    counts (twice a replay, as two layers): equal to the reference every time."""
    from treeverify.bench.cases import Case, make_inputs

    schedule, *opts = (schedule or "").split(":")
    monkeypatch.setenv("TREEVERIFY_CUDA_GQA_Q_REGS", "1" if "q" in opts else "0")
    monkeypatch.setenv("TREEVERIFY_CUDA_GQA_256", "1" if "256" in opts else "0")
    if schedule:
        monkeypatch.setenv("TREEVERIFY_CUDA_GQA_SCHEDULE", schedule)
    else:
        monkeypatch.delenv("TREEVERIFY_CUDA_GQA_SCHEDULE", raising=False)
    case = Case("pp", 4, 6000, 64, 32, 8, 128, 128, False)
    first = make_inputs(case, page_size=16, device="cuda", seed=7)
    plan = _plan(first, case, 16, 4, 64, first["block_table"].shape[1], 6064)
    if torch.cuda.get_device_capability()[0] == 9:
        wide = "pingpong-256" if "256" in opts else None
        assert plan._launcher.fwd.schedule == (wide or schedule or "pingpong-auto")
        assert plan._launcher.fwd.q_regs == ("q" in opts)
        assert plan._launcher.fwd.threads == 384
    kc, vc = first["k_cache"], first["v_cache"]
    q = torch.randn(4 * 64, 32, 128, device="cuda", dtype=torch.bfloat16)
    outs = [torch.empty(4 * 64, 32, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    plan.plan(first["block_table"], first["prefix_lens"], first["qo_indptr"], first["tree_mask"])
    plan.run(q, kc, vc, outs[0])
    torch.cuda.synchronize()
    if schedule.startswith("pingpong-tma") and torch.cuda.get_device_capability()[0] == 9:
        assert plan._params.tma_rows == 16  # page 16: whole tiles by TMA, 16-row boxes
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for o in outs:
            plan.run(q, kc, vc, o)
    for step, (prefixes, trees) in enumerate([([6000, 0, 1, 3000], [64, 64, 9, 33]),
                                              ([77], [64]), ([5000, 4000], [1, 64])]):  # fmt: skip
        nxt = make_inputs(case, page_size=16, device="cuda", seed=30 + step,
                          prefix_lens=prefixes, tree_sizes=trees)  # fmt: skip
        total, ref = _load_step(nxt, kc, vc, q)
        plan.plan(nxt["block_table"], nxt["prefix_lens"], nxt["qo_indptr"], nxt["tree_mask"])
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for o in outs:
            assert _rel(o[:total], ref) <= TOL, step
            assert (o[total:] == 0).all(), f"padding rows not zeroed (step {step})"


def _is_sm90() -> bool:
    return torch.cuda.get_device_capability()[0] == 9


@pytest.mark.parametrize("splits", [None, "3"], ids=["policy", "3splits"])
@pytest.mark.parametrize("page", [1, 2, 4, 8, 32, 64, 128, 48])
@pytest.mark.parametrize("schedule", ["pingpong-tma", "pingpong-tma2"], ids=["tma", "tma2"])
def test_tma_producer_at_every_page_size(schedule, page, splits, monkeypatch):
    """Schedule pingpong-tma with TREEVERIFY_CUDA_TMA_MIN_PAGE=1: boxes of 1-64 rows (a page,
    or 64 rows of a larger one), prefixes ending inside a page, at a page edge and a tile edge,
    the tree's rows by TMA too (our layout keeps them in the pool); page 48 (neither divides
    nor is a multiple of the 64-row tile) takes the cp.async path. Checks the plan set the box
    rows it should, so a silent fallback cannot pass for TMA. tma2: the pairs of 128-row CTAs
    in clusters sharing the tiles below the tree (trees of 17-64 nodes: pairs with and without
    a second CTA's rows)."""
    from treeverify.bench.cases import Case, make_inputs

    monkeypatch.setenv("TREEVERIFY_CUDA_GQA_SCHEDULE", schedule)
    monkeypatch.setenv("TREEVERIFY_CUDA_TMA_MIN_PAGE", "1")
    if splits:
        monkeypatch.setenv("TREEVERIFY_CUDA_MAX_SPLITS", splits)
    prefixes, trees = [0, 1, 63, 64, 65, 700, 3000], [64, 64, 33, 64, 17, 64, 64]
    case = Case("tma", len(prefixes), max(prefixes), 64, 32, 8, 128, 128, False)
    inp = make_inputs(case, page_size=page, device="cuda", dtype=torch.bfloat16, seed=page,
                      prefix_lens=prefixes, tree_sizes=trees)  # fmt: skip
    pages = inp["block_table"].shape[1]
    plan = _plan(inp, case, page, len(prefixes), 64, pages, pages * page)
    plan.plan(inp["block_table"], inp["prefix_lens"], inp["qo_indptr"], inp["tree_mask"])
    out = _poisoned(inp, 128)
    plan.run(inp["q"], inp["k_cache"], inp["v_cache"], out)
    torch.cuda.synchronize()
    if _is_sm90():
        assert plan._params.tma_rows == (0 if page == 48 else min(page, 64))
    total = inp["q"].shape[0]
    assert _rel(out[:total], _reference(inp)) <= TOL


@pytest.mark.parametrize("schedule", ["pingpong-tma", "pingpong-tma2"], ids=["tma", "tma2"])
def test_tma_producer_through_the_sglang_drop_in(schedule, monkeypatch):
    """SGLang's layout (a (slots, H, D) pool, tree K/V in the extend buffers): prefix tiles by
    1-row TMA boxes, the tiles that reach the tree by cp.async; eager and captured."""
    from test_cuda_gpu import _check_drop_in_eager_and_captured, _sglang_inputs

    monkeypatch.setenv("TREEVERIFY_CUDA_GQA_SCHEDULE", schedule)
    monkeypatch.setenv("TREEVERIFY_CUDA_TMA_MIN_PAGE", "1")
    _check_drop_in_eager_and_captured(*_sglang_inputs(False, 3, 64, [900, 0, 4100], seed=5))


@pytest.mark.parametrize(
    "schedule,wide",
    [("pingpong-auto", "0"), ("pingpong-auto", "1"), ("pingpong-persist", "0")],
    ids=["128rows", "256rows", "persist"],
)
def test_auto_producer_switches_with_the_batch_inside_one_graph(schedule, wide, monkeypatch):
    """pingpong-auto picks the direct producer for batches of <= 32k keys and the shared one
    above, on the device per launch: one captured graph replayed on a small batch (direct) and
    a large one (> 32k keys: shared), each equal to the reference; the same batches through the
    256-row CTAs (TREEVERIFY_CUDA_GQA_256=1, the direct producer throughout) and through the
    persistent kernel (its producer makes the same choice; the small batch leaves most of its
    groups one tile and cuts every unit, the large one cuts units across group edges)."""
    from treeverify.bench.cases import Case, make_inputs

    monkeypatch.setenv("TREEVERIFY_CUDA_GQA_SCHEDULE", schedule)
    monkeypatch.setenv("TREEVERIFY_CUDA_GQA_256", wide)
    case = Case("auto", 8, 8000, 64, 32, 8, 128, 128, False)
    first = make_inputs(case, page_size=16, device="cuda", seed=3)
    plan = _plan(first, case, 16, 8, 64, first["block_table"].shape[1], 8064)
    if _is_sm90():
        assert plan._launcher.fwd.bm == (256 if wide == "1" else 128)
        assert plan._launcher.fwd.schedule == (schedule if wide == "0" else "pingpong-256")
    kc, vc = first["k_cache"], first["v_cache"]
    q = torch.randn(8 * 64, 32, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(8 * 64, 32, 128, device="cuda", dtype=torch.bfloat16)
    plan.plan(first["block_table"], first["prefix_lens"], first["qo_indptr"], first["tree_mask"])
    plan.run(q, kc, vc, out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(q, kc, vc, out)
    small = ([3000, 17, 900], [64, 40, 64])  # ~4k keys: the direct producer
    large = ([8000, 7000, 7999, 5000, 6000, 7500, 8000, 64], [64] * 8)  # ~49k keys: shared
    for step, (prefixes, trees) in enumerate([small, large, small]):
        nxt = make_inputs(case, page_size=16, device="cuda", seed=40 + step,
                          prefix_lens=prefixes, tree_sizes=trees)  # fmt: skip
        total, ref = _load_step(nxt, kc, vc, q)
        plan.plan(nxt["block_table"], nxt["prefix_lens"], nxt["qo_indptr"], nxt["tree_mask"])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(out[:total], ref) <= TOL, step


def test_persistent_kernel_through_the_sglang_drop_in(monkeypatch):
    """Schedule pingpong-persist on SGLang's layout (a (slots, H, D) pool at page size 1,
    kv_indptr instead of prefix lengths, the tree's K/V in the extend buffers): eager and
    captured, against the reference."""
    from test_cuda_gpu import _check_drop_in_eager_and_captured, _sglang_inputs

    monkeypatch.setenv("TREEVERIFY_CUDA_GQA_SCHEDULE", "pingpong-persist")
    _check_drop_in_eager_and_captured(*_sglang_inputs(False, 3, 64, [900, 0, 4100], seed=5))
