"""The Triton backend on the CPU interpreter (TRITON_INTERPRET=1) against the torch reference.

Small random cases: GQA (4q/2kv/64, 8q/2kv/128) and MLA (2-4 heads x 576/512), page sizes 1/16/64,
ragged prefixes including 0, trees over 32 nodes (multi-word masks), forced multi-split (the
merge path, including splits that are empty for some m-tiles), fp16/bf16/fp32, and one launcher
reused over rewritten metadata with padded capacities (what a captured graph replays).
Every output (and workspace) is poisoned with NaN first; inputs are fresh random data.

Skipped where triton is not installed, and on machines with a GPU: the interpreter is chosen when
the kernels are decorated (import time), and tests/test_triton_gpu.py covers the GPU there.
"""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if torch.cuda.is_available():
    pytest.skip("a GPU is present: tests/test_triton_gpu.py runs there", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are decorated (first import)

from treeverify.bench.cases import Case, make_inputs  # noqa: E402
from treeverify.kernels.reference import tree_attention_reference  # noqa: E402
from treeverify.kernels.splits import policy_splits, split_chunk  # noqa: E402
from treeverify.kernels.triton import (  # noqa: E402
    SplitPolicy,
    TritonConfig,
    TritonTreeAttention,
    choose_config,
    choose_splits,
    num_splits,
    tree_attention_triton,
)
from treeverify.kernels.triton.runner import INTERPRETED  # noqa: E402

pytestmark = pytest.mark.skipif(
    not INTERPRETED, reason="treeverify.kernels.triton was imported before TRITON_INTERPRET=1"
)

# (global relative error, worst single (token, head) row relative error)
TOL = {
    torch.float32: (2e-5, 2e-4),
    torch.float16: (5e-3, 3e-2),
    torch.bfloat16: (5e-3, 3e-2),
}
GQA_SMALL = ("gqa", 4, 2, 64, 64, False)
GQA_128 = ("gqa", 8, 2, 128, 128, False)
MLA_2 = ("mla", 2, 1, 576, 512, True)
MLA_4 = ("mla", 4, 1, 576, 512, True)


def _problem(family, page, prefixes, trees, dtype, seed):
    """make_inputs' random data on the CPU, q scaled x3 so the softmax is peaky (a wrong mask bit
    or a lost tile moves the output well past the tolerance)."""
    kind, hq, hkv, dqk, dv, mla = family
    case = Case(kind, len(prefixes), max(prefixes), max(trees), hq, hkv, dqk, dv, mla)
    inp = make_inputs(case, page_size=page, device="cpu", dtype=dtype, seed=seed,
                      prefix_lens=prefixes, tree_sizes=trees)  # fmt: skip
    inp["q"] = (3 * inp["q"].float()).to(dtype)
    inp["dv"] = dv
    return inp


def _reference(inp):
    f64 = torch.float64
    return tree_attention_reference(
        inp["q"].to(f64), inp["k_cache"].to(f64),
        None if inp["v_cache"] is None else inp["v_cache"].to(f64),
        inp["block_table"], inp["prefix_lens"], inp["qo_indptr"], inp["tree_mask"],
        inp["sm_scale"], v_head_dim=inp["v_head_dim"],
    )  # fmt: skip


def _poisoned(inp):
    q = inp["q"]
    return torch.full((q.shape[0], q.shape[1], inp["dv"]), float("nan"), dtype=q.dtype)


def _check(out, ref, dtype):
    assert out.dtype == dtype
    assert torch.isfinite(out).all(), "output has NaN/inf: some element was not written"
    diff = (out.double() - ref).flatten(0, 1)
    rows = ref.flatten(0, 1)
    glob = float(diff.norm() / rows.norm())
    worst = float((diff.norm(dim=-1) / rows.norm(dim=-1)).max())
    tol_glob, tol_row = TOL[dtype]
    assert glob <= tol_glob and worst <= tol_row, (glob, worst)


def _eager(inp, out=None):
    return tree_attention_triton(
        inp["q"], inp["k_cache"], inp["v_cache"], inp["block_table"], inp["prefix_lens"],
        inp["qo_indptr"], inp["tree_mask"], inp["sm_scale"], v_head_dim=inp["v_head_dim"],
        out=out if out is not None else _poisoned(inp),
    )  # fmt: skip


DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("page", [1, 16, 64])
def test_gqa_small_pages_dtypes(page, dtype):
    dt = DTYPES[dtype]
    inp = _problem(GQA_SMALL, page, [0, 37, 70], [5, 40, 1], dt, seed=page * 7 + len(dtype))
    _check(_eager(inp), _reference(inp), dt)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_gqa_head_dim_128(dtype):
    dt = DTYPES[dtype]
    inp = _problem(GQA_128, 16, [100, 3], [12, 33], dt, seed=11)
    _check(_eager(inp), _reference(inp), dt)


@pytest.mark.parametrize(
    "family,page,dtype",
    [(MLA_2, 1, "bf16"), (MLA_4, 64, "fp16"), (MLA_2, 16, "fp32"), (MLA_4, 16, "bf16")],
)
def test_mla(family, page, dtype):
    dt = DTYPES[dtype]
    inp = _problem(family, page, [0, 50], [36, 3], dt, seed=page + 3)
    _check(_eager(inp), _reference(inp), dt)


def test_tree_of_70_nodes_three_mask_words():
    inp = _problem(GQA_SMALL, 16, [20, 0], [70, 66], torch.float16, seed=5)
    assert inp["tree_mask"].shape[1] == 3
    _check(_eager(inp), _reference(inp), torch.float16)


def test_out_view_with_padded_strides():
    """out= a strided view (rows padded): the kernel writes through out's strides only."""
    inp = _problem(GQA_SMALL, 16, [9, 40], [7, 20], torch.bfloat16, seed=8)
    q = inp["q"]
    big = torch.full((q.shape[0], q.shape[1] + 1, inp["dv"] + 16), float("nan"), dtype=q.dtype)
    out = big[:, 1:, 8 : 8 + inp["dv"]]
    res = _eager(inp, out=out)
    assert res.data_ptr() == out.data_ptr()
    _check(out, _reference(inp), torch.bfloat16)
    assert torch.isnan(big[:, 0]).all() and torch.isnan(big[..., :8]).all()


def _launcher(inp, *, splits, config=None):
    hq, dqk = inp["q"].shape[1:]
    hkv = inp["k_cache"].shape[2]
    trees = (inp["qo_indptr"][1:] - inp["qo_indptr"][:-1]).tolist()
    kv = (inp["prefix_lens"] + inp["qo_indptr"][1:] - inp["qo_indptr"][:-1]).tolist()
    return TritonTreeAttention(
        hq, hkv, dqk, inp["dv"], inp["v_cache"] is None, len(trees), max(trees), max(kv),
        inp["q"].shape[0], "cpu", inp["q"].dtype, splits=splits, config=config,
    )  # fmt: skip


def _launch(runner, inp, q, out, meta):
    o_shape, lse_shape = runner.workspace_shapes()
    part_o = torch.full(o_shape, float("nan"))
    part_lse = torch.full(lse_shape, float("nan"))
    runner.launch(
        q, inp["k_cache"], inp["v_cache"], out, meta["block_table"], meta["prefix_lens"],
        meta["qo_indptr"], meta["tree_mask"], part_o, part_lse, inp["sm_scale"],
    )  # fmt: skip


@pytest.mark.parametrize(
    "family,page,dtype,policy",
    [
        (GQA_SMALL, 1, "fp16", SplitPolicy(4, 16)),
        (GQA_SMALL, 16, "bf16", SplitPolicy(3, 32)),
        (GQA_SMALL, 64, "fp32", SplitPolicy(8, 12)),  # chunk not a multiple of BN
        (MLA_2, 16, "bf16", SplitPolicy(3, 32)),
    ],
)
def test_forced_multi_split_runs_merge(family, page, dtype, policy):
    dt = DTYPES[dtype]
    prefixes, trees = [70, 0, 33], [40, 9, 2]
    inp = _problem(family, page, prefixes, trees, dt, seed=policy.chunk + page)
    n = [
        num_splits(p + t, policy.max_splits, policy.chunk)
        for p, t in zip(prefixes, trees, strict=True)
    ]
    assert max(n) > 1 and min(n) == 1  # both the merge and the direct-write paths run
    runner = _launcher(inp, splits=policy)
    assert runner.grid[1] == policy.max_splits
    out = _poisoned(inp)
    _launch(runner, inp, inp["q"], out, inp)
    _check(out, _reference(inp), dt)


@pytest.mark.parametrize("family", [GQA_SMALL, ("gqa", 6, 2, 64, 64, False)])
def test_small_tiles_many_m_tiles_and_empty_splits(family):
    """BM=16: m-tiles end mid-tree (and mid-node when G=3 does not divide 16), so the later
    splits of the early m-tiles see no column at all (LSE -inf) and must not disturb the merge."""
    prefixes, trees = [10, 45], [40, 18]
    inp = _problem(family, 16, prefixes, trees, torch.float16, seed=family[1])
    runner = _launcher(inp, splits=SplitPolicy(4, 16), config=TritonConfig(16, 16, 4, 1))
    assert runner.m_tiles == math.ceil(40 * family[1] // family[2] / 16)
    out = _poisoned(inp)
    _launch(runner, inp, inp["q"], out, inp)
    _check(out, _reference(inp), torch.float16)


def test_balanced_policy_gives_the_long_request_the_spare_splits():
    """A balanced policy (kernels/splits.py, v12): the forward and the merge both read the
    batch's keys; the long request takes more splits, the short ones fewer, output unchanged."""
    prefixes, trees = [150, 3, 20], [20, 5, 9]
    kv = [p + t for p, t in zip(prefixes, trees, strict=True)]
    balanced, plain = SplitPolicy(4, 16, balance_div=3), SplitPolicy(4, 16)
    assert policy_splits(balanced, kv) == [3, 1, 1]  # no split under sum(kv) / 3 = 69 keys
    assert policy_splits(plain, kv) == [4, 1, 2]
    inp = _problem(GQA_SMALL, 16, prefixes, trees, torch.float16, seed=22)
    runner = _launcher(inp, splits=balanced)
    out = _poisoned(inp)
    _launch(runner, inp, inp["q"], out, inp)
    _check(out, _reference(inp), torch.float16)


def test_split_count_follows_the_length_beyond_max_splits_times_chunk():
    """P+T > max_splits*chunk: chunks grow instead of losing the tail."""
    inp = _problem(GQA_SMALL, 16, [150], [20], torch.float16, seed=21)
    policy = SplitPolicy(2, 16)
    assert num_splits(170, 2, 16) == 2
    runner = _launcher(inp, splits=policy)
    out = _poisoned(inp)
    _launch(runner, inp, inp["q"], out, inp)
    _check(out, _reference(inp), torch.float16)


@pytest.mark.parametrize("balance_div", [0, 3])
@pytest.mark.parametrize("family", [GQA_SMALL, MLA_2])
def test_one_launcher_over_rewritten_metadata(family, balance_div):
    """Capacities fixed once; each step rewrites fixed metadata buffers in place (padded batch,
    padded rows, larger page table) and launches the same runner: what a CUDA graph replays."""
    page, dt = 16, torch.bfloat16
    max_batch, max_tree, max_kv, cap_rows, max_pages = 3, 40, 140, 3 * 40, 10
    runner = None
    bt = torch.zeros(max_batch, max_pages, dtype=torch.int32)
    pl = torch.zeros(max_batch, dtype=torch.int32)
    qo = torch.zeros(max_batch + 1, dtype=torch.int32)
    mask = torch.zeros(cap_rows, 2, dtype=torch.int32)
    meta = {"block_table": bt, "prefix_lens": pl, "qo_indptr": qo, "tree_mask": mask}
    q = torch.empty(cap_rows, family[1], family[3], dtype=dt)
    out = torch.empty(cap_rows, family[1], family[4], dtype=dt)
    steps = [([90, 0, 7], [40, 3, 33]), ([17], [9]), ([0, 100], [1, 40])]
    for step, (prefixes, trees) in enumerate(steps):
        inp = _problem(family, page, prefixes, trees, dt, seed=40 + step)
        if runner is None:
            # small chunks: the merge runs on these short lengths; balanced: padding requests
            # (prefix 0, no tree) count towards the batch's keys as nothing
            policy = SplitPolicy(4, 32, balance_div=balance_div)
            runner = TritonTreeAttention(
                family[1], family[2], family[3], family[4], family[5], max_batch, max_tree,
                max_kv, cap_rows, "cpu", dt, splits=policy,
            )  # fmt: skip
        b, total = len(prefixes), sum(trees)
        bt.zero_()
        bt[:b, : inp["block_table"].shape[1]].copy_(inp["block_table"])
        pl.zero_()
        pl[:b].copy_(inp["prefix_lens"])
        qo.fill_(total)
        qo[: b + 1].copy_(inp["qo_indptr"])
        mask.zero_()
        mask[:total, : inp["tree_mask"].shape[1]].copy_(inp["tree_mask"])
        q.normal_()
        q[:total].copy_(inp["q"])
        out.fill_(float("nan"))
        _launch(runner, inp, q, out, meta)
        _check(out[:total], _reference(inp), dt)
        assert torch.isnan(out[total:]).all()  # padding rows untouched


def test_config_and_split_policy_are_capacity_only():
    cfg = choose_config(hq=32, hkv=8, dqk=128, dv=128, mla=False, max_tree=64,
                        dtype=torch.bfloat16)  # fmt: skip
    assert (cfg.bm, cfg.bn) == (128, 64)  # the H200 sweep's choices (runner.choose_config)
    cfg = choose_config(hq=8, hkv=1, dqk=576, dv=512, mla=True, max_tree=16,
                        dtype=torch.bfloat16)  # fmt: skip
    assert (cfg.bm, cfg.bn) == (64, 32)
    cfg = choose_config(hq=4, hkv=2, dqk=64, dv=64, mla=False, max_tree=3, dtype=torch.float16)
    assert cfg.bm == 16  # never more rows than the bucket can have (tl.dot needs >= 16)
    cfg = choose_config(hq=32, hkv=8, dqk=128, dv=128, mla=False, max_tree=16,
                        dtype=torch.bfloat16)  # fmt: skip
    assert (cfg.bm, cfg.bn, cfg.num_warps) == (64, 64, 4)
    pol = choose_splits(batch=1, hkv=8, m_tiles=1, max_kv=8256, bn=64, num_sms=132, ctas_per_sm=2)
    assert pol.max_splits == 33 and pol.chunk % 64 == 0
    for kv in (1, 255, 520, 8256, 50000):
        n = num_splits(kv, pol.max_splits, pol.chunk)
        c = split_chunk(kv, pol.max_splits, pol.chunk)
        assert c % pol.chunk == 0 and c >= math.ceil(kv / pol.max_splits)
        assert 1 <= n <= pol.max_splits and (n - 1) * c < kv <= n * c
    assert num_splits(520, pol.max_splits, pol.chunk) == 9  # a short request still spreads


def test_split_rule_matches_the_cuda_backend():
    try:
        from treeverify.kernels.cuda.runner import choose_splits as cuda_choose_splits
    except ImportError:
        pytest.skip("the cuda backend does not import here")
    for kw in (
        dict(batch=1, hkv=8, m_tiles=1, max_kv=8256, bn=64, num_sms=132, ctas_per_sm=2),
        dict(batch=32, hkv=1, m_tiles=16, max_kv=32832, bn=32, num_sms=132, ctas_per_sm=1),
        dict(batch=8, hkv=1, m_tiles=2, max_kv=1040, bn=32, num_sms=132, ctas_per_sm=1),
    ):
        a, b = choose_splits(**kw), cuda_choose_splits(**kw)
        assert (a.max_splits, a.chunk) == (b.max_splits, b.chunk)
