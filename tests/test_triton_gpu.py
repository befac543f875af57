"""The Triton backend on a GPU: the 54 grid cases and random ragged cases against the reference,
forced multi-split, capture/replay with metadata rewritten in place, no sync / no allocation in
launch(), and agreement with the CUDA backend when it imports.

Skipped without a CUDA GPU, without triton, or when TRITON_INTERPRET=1 (the CPU tests in
tests/test_triton_interpret.py cover the interpreter). Every output is poisoned with NaN before
the kernel runs; inputs are fresh random data.
"""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1: CPU interpreter"
    ),
]

TOL = {torch.bfloat16: 5e-3, torch.float16: 5e-3, torch.float32: 1e-4}  # fp32: 3xTF32 dots


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "output has NaN/inf: some element was not written"
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _reference(inp: dict) -> torch.Tensor:
    from treeverify.kernels.reference import tree_attention_reference

    hi = torch.float64 if inp["q"].dtype == torch.float32 else torch.float32
    return tree_attention_reference(
        inp["q"].to(hi), inp["k_cache"].to(hi),
        None if inp["v_cache"] is None else inp["v_cache"].to(hi),
        inp["block_table"], inp["prefix_lens"], inp["qo_indptr"], inp["tree_mask"],
        inp["sm_scale"], v_head_dim=inp["v_head_dim"],
    )  # fmt: skip


def _dv(inp: dict) -> int:
    return inp["v_head_dim"] if inp["v_cache"] is None else inp["v_cache"].shape[-1]


def _poisoned(inp: dict) -> torch.Tensor:
    q = inp["q"]
    return torch.full((q.shape[0], q.shape[1], _dv(inp)), float("nan"), dtype=q.dtype,
                      device=q.device)  # fmt: skip


def _triton(inp: dict, out: torch.Tensor | None = None) -> torch.Tensor:
    from treeverify.kernels.triton import tree_attention_triton

    return tree_attention_triton(
        inp["q"], inp["k_cache"], inp["v_cache"], inp["block_table"], inp["prefix_lens"],
        inp["qo_indptr"], inp["tree_mask"], inp["sm_scale"], v_head_dim=inp["v_head_dim"],
        out=out if out is not None else _poisoned(inp),
    )  # fmt: skip


def _grid():
    from treeverify.bench.cases import load_grid

    return load_grid()[0]


@pytest.mark.parametrize("idx", range(54))
def test_grid_case_matches_reference(idx):
    from treeverify.bench.cases import make_inputs

    case = _grid()[idx]
    inp = make_inputs(case, page_size=16, device="cuda", seed=7 + idx)
    assert _rel(_triton(inp), _reference(inp)) <= TOL[torch.bfloat16], case.name


RANDOM = [
    # (kind, hq, hkv, dqk, dv, mla, page, prefixes, trees, dtype)
    ("gqa", 32, 8, 128, 128, False, 1, [0, 37, 1500], [1, 17, 64], torch.bfloat16),
    ("gqa", 32, 8, 128, 128, False, 16, [5000, 0], [1025, 3], torch.float16),
    ("gqa", 8, 2, 64, 64, False, 64, [130, 64, 0, 4000], [33, 32, 31, 200], torch.bfloat16),
    ("gqa", 16, 4, 256, 256, False, 16, [777, 3], [45, 9], torch.float16),
    ("gqa", 12, 4, 128, 128, False, 16, [2000, 5], [20, 7], torch.bfloat16),  # G = 3
    ("mha", 8, 8, 128, 128, False, 1, [300, 9000], [12, 70], torch.bfloat16),
    ("gqa", 8, 2, 128, 128, False, 16, [3000, 0], [40, 5], torch.float32),
    ("mla", 8, 1, 576, 512, True, 64, [0, 2100, 65], [16, 100, 1025], torch.bfloat16),
    ("mla", 64, 1, 576, 512, True, 1, [1000, 3], [5, 40], torch.float16),
    ("mla", 16, 1, 576, 512, True, 16, [20000], [64], torch.bfloat16),
    ("mla", 4, 1, 576, 512, True, 16, [700, 0], [9, 33], torch.float32),
]


@pytest.mark.parametrize(
    "spec", RANDOM, ids=[f"{s[0]}-{s[1]}q-p{s[6]}-{i}" for i, s in enumerate(RANDOM)]
)
@pytest.mark.parametrize("seed", [1, 2])
def test_random_ragged_cases(spec, seed):
    from treeverify.bench.cases import Case, make_inputs

    kind, hq, hkv, dqk, dv, mla, page, prefixes, trees, dtype = spec
    case = Case(kind, len(prefixes), max(prefixes), max(trees), hq, hkv, dqk, dv, mla)
    inp = make_inputs(case, page_size=page, device="cuda", dtype=dtype, seed=seed * 101,
                      prefix_lens=prefixes, tree_sizes=trees)  # fmt: skip
    assert _rel(_triton(inp), _reference(inp)) <= TOL[dtype]


def _runner(case, dtype, max_batch, max_tree, max_kv, total_q_cap, **kw):
    from treeverify.kernels.triton import TritonTreeAttention

    return TritonTreeAttention(
        case.hq, case.hkv, case.dqk, case.dv, case.mla, max_batch, max_tree, max_kv,
        total_q_cap, "cuda", dtype, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("mla", [False, True])
def test_forced_multi_split(mla):
    from treeverify.bench.cases import Case, make_inputs
    from treeverify.kernels.triton import SplitPolicy, num_splits

    case = Case("t", 3, 3000, 70, 8 if mla else 16, 1 if mla else 4, 576 if mla else 128,
                512 if mla else 128, mla)  # fmt: skip
    prefixes, trees = [3000, 0, 90], [70, 9, 40]
    inp = make_inputs(case, page_size=16, device="cuda", seed=9, prefix_lens=prefixes,
                      tree_sizes=trees)  # fmt: skip
    policy = SplitPolicy(16, 64)
    assert [num_splits(p + t, 16, 64) for p, t in zip(prefixes, trees, strict=True)] == [16, 1, 3]
    runner = _runner(case, torch.bfloat16, 3, 70, 3070, inp["q"].shape[0], splits=policy)
    o_shape, lse_shape = runner.workspace_shapes()
    part_o = torch.full(o_shape, float("nan"), device="cuda")
    part_lse = torch.full(lse_shape, float("nan"), device="cuda")
    out = _poisoned(inp)
    runner.launch(inp["q"], inp["k_cache"], inp["v_cache"], out, inp["block_table"],
                  inp["prefix_lens"], inp["qo_indptr"], inp["tree_mask"], part_o, part_lse,
                  inp["sm_scale"])  # fmt: skip
    assert _rel(out, _reference(inp)) <= TOL[torch.bfloat16]


class _Buffers:
    """What a plan owns: fixed-address metadata and workspace, rewritten in place per step."""

    def __init__(self, runner, max_batch, max_pages, words):
        dev = "cuda"
        self.block_table = torch.zeros(max_batch, max_pages, dtype=torch.int32, device=dev)
        self.prefix_lens = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self.qo_indptr = torch.zeros(max_batch + 1, dtype=torch.int32, device=dev)
        self.tree_mask = torch.zeros(runner.total_q_cap, words, dtype=torch.int32, device=dev)
        o_shape, lse_shape = runner.workspace_shapes()
        self.part_o = torch.empty(o_shape, dtype=torch.float32, device=dev)
        self.part_lse = torch.empty(lse_shape, dtype=torch.float32, device=dev)

    def write(self, inp):
        b = inp["prefix_lens"].shape[0]
        total = int(inp["qo_indptr"][-1])
        self.block_table.zero_()
        self.block_table[:b, : inp["block_table"].shape[1]].copy_(inp["block_table"])
        self.prefix_lens.zero_()
        self.prefix_lens[:b].copy_(inp["prefix_lens"])
        self.qo_indptr.fill_(total)
        self.qo_indptr[: b + 1].copy_(inp["qo_indptr"])
        self.tree_mask.zero_()
        self.tree_mask[:total, : inp["tree_mask"].shape[1]].copy_(inp["tree_mask"])

    def launch(self, runner, q, kc, vc, out, sm_scale):
        runner.launch(q, kc, vc, out, self.block_table, self.prefix_lens, self.qo_indptr,
                      self.tree_mask, self.part_o, self.part_lse, sm_scale)  # fmt: skip


@pytest.mark.parametrize("mla", [False, True])
def test_capture_then_rewrite_metadata_in_place(mla):
    """One graph captured; new lengths, trees and pages written into the buffers; replay ==
    reference == eager."""
    from treeverify.bench.cases import Case, make_inputs

    case = Case("t", 3, 3000, 40, 8 if mla else 16, 1 if mla else 4, 576 if mla else 128,
                512 if mla else 128, mla)  # fmt: skip
    page, dt = 16, torch.bfloat16
    first = make_inputs(case, page_size=page, device="cuda", seed=5, prefix_lens=[3000, 10, 700],
                        tree_sizes=[40, 7, 21])  # fmt: skip
    pool_pages = first["k_cache"].shape[0]
    rows = 3 * 40
    runner = _runner(case, dt, 3, 40, 3100, rows)
    assert runner.splits.max_splits > 1  # the merge kernel is in the graph
    buf = _Buffers(runner, 3, math.ceil(3100 / page), 2)
    buf.write(first)
    q = torch.randn(rows, case.hq, case.dqk, device="cuda", dtype=dt)
    out = torch.full((rows, case.hq, case.dv), float("nan"), device="cuda", dtype=dt)
    kc, vc = first["k_cache"], first["v_cache"]
    buf.launch(runner, q, kc, vc, out, first["sm_scale"])  # warm-up: compiles outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        buf.launch(runner, q, kc, vc, out, first["sm_scale"])
    steps = [([17, 2990, 0], [1, 40, 33]), ([1500, 1500, 64], [40, 40, 40]), ([0], [9])]
    for step, (prefixes, trees) in enumerate(steps):
        nxt = make_inputs(case, page_size=page, device="cuda", seed=50 + step,
                          prefix_lens=prefixes, tree_sizes=trees)  # fmt: skip
        n_pages = nxt["k_cache"].shape[0]
        assert n_pages <= pool_pages
        kc[:n_pages].copy_(nxt["k_cache"])  # new cache content, same pool
        if vc is not None:
            vc[:n_pages].copy_(nxt["v_cache"])
        buf.write(nxt)
        total = nxt["q"].shape[0]
        q.normal_()
        q[:total].copy_(nxt["q"])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager_inp = dict(nxt, q=q[:total].clone(), k_cache=kc[:n_pages],
                         v_cache=None if vc is None else vc[:n_pages])  # fmt: skip
        assert _rel(out[:total], _reference(eager_inp)) <= TOL[dt]
        assert _rel(out[:total], _triton(eager_inp)) <= TOL[dt]
        assert torch.isnan(out[total:]).all()  # padding rows untouched


def test_launch_neither_syncs_nor_allocates():
    from treeverify.bench.cases import Case, make_inputs

    case = Case("t", 2, 5000, 16, 32, 8, 128, 128, False)
    inp = make_inputs(case, page_size=16, device="cuda", seed=3)
    runner = _runner(case, torch.bfloat16, 2, 16, 5016, 32)
    buf = _Buffers(runner, 2, inp["block_table"].shape[1], 1)
    buf.write(inp)
    out = _poisoned(inp)
    args = (runner, inp["q"], inp["k_cache"], inp["v_cache"], out, inp["sm_scale"])
    buf.launch(*args)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            buf.launch(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="global"):  # strict: unsafe calls raise
        buf.launch(*args)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(out, _reference(inp)) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("mla", [False, True])
def test_agrees_with_the_cuda_backend(mla):
    try:
        from treeverify.kernels.api import cuda_backend

        cuda = cuda_backend()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    from treeverify.bench.cases import Case, make_inputs

    case = Case("t", 2, 4000, 64, 8 if mla else 32, 1 if mla else 8, 576 if mla else 128,
                512 if mla else 128, mla)  # fmt: skip
    inp = make_inputs(case, page_size=16, device="cuda", seed=17, prefix_lens=[4000, 33],
                      tree_sizes=[64, 20])  # fmt: skip
    ours = _triton(inp)
    theirs = cuda(inp["q"], inp["k_cache"], inp["v_cache"], inp["block_table"],
                  inp["prefix_lens"], inp["qo_indptr"], inp["tree_mask"], inp["sm_scale"],
                  v_head_dim=inp["v_head_dim"], out=_poisoned(inp))  # fmt: skip
    assert _rel(ours, theirs) <= TOL[torch.bfloat16]
