"""Split-KV on a GPU (CUDA backend): the merge inside the forward and by the merge kernel
(token and tile grids, with and without programmatic dependent launch), the padding rows zeroed
there, and balanced splits for batches of mixed lengths, each in a captured plan replayed over
new lengths against the reference.

Skipped where no CUDA GPU (or no cuda-python) exists; scripts/gpu-check runs them on the H200.
Outputs are poisoned with NaN before the kernels run; inputs are fresh random data.
"""

from __future__ import annotations

import math

import pytest
import torch

from test_cuda_gpu import TOL, _load_step, _plan, _poisoned, _reference, _rel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# ---- v8: the split merge inside the forward (split_merge.cuh) and padding rows zeroed there.

MERGE_SHAPES = [
    # (hq, hkv, dqk, dv, mla): the engine's tiny GQA shape, a 1B-like one, MLA
    (4, 2, 64, 64, False),
    (32, 8, 128, 128, False),
    (16, 1, 576, 512, True),
]


@pytest.mark.parametrize("lanes", ["0", "1"], ids=["merge-v12", "merge-split-lanes"])
@pytest.mark.parametrize("pdl", ["0", "1"])
@pytest.mark.parametrize("shape", MERGE_SHAPES, ids=["gqa64", "gqa128", "mla"])
@pytest.mark.parametrize("portable", [False, True], ids=["best", "portable"])
def test_merge_in_forward_replayed_with_new_split_counts(shape, portable, pdl, lanes, monkeypatch):
    """Captured plans that merge every split tile in the forward, none, or those whose read is
    small (auto: the rest by the merge kernel, which must skip the others), replayed over
    lengths that change every request's split count and twice per replay (as two layers
    would): each equals the reference and the merge kernel's plan; the tile counters are back at
    zero after each replay; rows of padding requests come out zero (out poisoned before), and
    the partials workspace is poisoned too (a merge may read only what the forward wrote).
    lanes=1 (TREEVERIFY_CUDA_MERGE_SPLIT_LANES, v30): where the plan splits more than 8 ways
    (the GQA shapes here; MLA's plans stay at 8 or fewer), the merge kernel takes a head's
    splits with 4 groups of threads (some with no split at the short lengths below)."""
    from treeverify.bench.cases import Case, make_inputs

    if portable:
        monkeypatch.setenv("TREEVERIFY_CUDA_PORTABLE", "1")
    monkeypatch.setenv("TREEVERIFY_CUDA_PDL", pdl)  # the merge kernel's programmatic launch
    monkeypatch.setenv("TREEVERIFY_CUDA_MERGE_SPLIT_LANES", lanes)
    hq, hkv, dqk, dv, mla = shape
    case = Case("m", 4, 1500, 17, hq, hkv, dqk, dv, mla)
    page, max_batch, max_tree, max_kv = 16, 4, 17, 1600
    first = make_inputs(case, page_size=page, device="cuda", seed=1,
                        prefix_lens=[1500, 1500, 1500], tree_sizes=[17, 17, 17])  # fmt: skip
    pool = first["k_cache"].shape[0]
    plans = {}
    for mode in ("forward", "kernel", "auto"):
        monkeypatch.setenv("TREEVERIFY_CUDA_SPLIT_MERGE", mode)
        plans[mode] = _plan(first, case, page, max_batch, max_tree, math.ceil(max_kv / page),
                            max_kv)  # fmt: skip
    assert not plans["forward"]._launcher.merge_kernel_needed
    assert plans["kernel"]._launcher.merge_kernel_needed
    assert plans["forward"].split_policy.max_splits >= 4  # lengths below reach several counts
    for plan in plans.values():
        many = plan.split_policy.max_splits > 8  # the split lanes' rule (variants.merge_variant)
        assert plan._launcher.merge.s == (4 if lanes == "1" and many else 1)
        plan.part_o.fill_(float("nan"))  # a merge reading a partial the forward did not write
    rows = max_batch * max_tree
    q = torch.randn(rows, hq, dqk, device="cuda", dtype=torch.bfloat16)
    kc, vc = first["k_cache"], first["v_cache"]
    outs, graphs = {}, {}
    for mode, plan in plans.items():
        plan.plan(first["block_table"], first["prefix_lens"], first["qo_indptr"],
                  first["tree_mask"])  # fmt: skip
        outs[mode] = (torch.empty(rows, hq, dv, device="cuda", dtype=torch.bfloat16),
                      torch.empty(rows, hq, dv, device="cuda", dtype=torch.bfloat16))  # fmt: skip
        plan.run(q, kc, vc, outs[mode][0])  # warmup, eager
        torch.cuda.synchronize()
        graphs[mode] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[mode]):
            plan.run(q, kc, vc, outs[mode][0])
            plan.run(q, kc, vc, outs[mode][1])
    for step, (prefixes, trees) in enumerate([([0, 40, 130], [1, 17, 5]),
                                              ([1400, 63, 64, 700], [17, 2, 17, 9]),
                                              ([300], [17]),
                                              ([1583, 1200], [17, 1])]):  # fmt: skip
        nxt = make_inputs(case, page_size=page, device="cuda", seed=70 + step,
                          prefix_lens=prefixes, tree_sizes=trees)  # fmt: skip
        assert nxt["k_cache"].shape[0] <= pool
        total, ref = _load_step(nxt, kc, vc, q)
        for mode, plan in plans.items():
            plan.plan(nxt["block_table"], nxt["prefix_lens"], nxt["qo_indptr"], nxt["tree_mask"])
            for o in outs[mode]:
                o.fill_(float("nan"))
            graphs[mode].replay()
        torch.cuda.synchronize()
        for mode, plan in plans.items():
            for o in outs[mode]:
                assert _rel(o[:total], ref) <= TOL, (mode, step)
                assert (o[total:] == 0).all(), f"{mode}: padding rows not zeroed (step {step})"
            counters = plan._workspace.counters
            assert int(counters.abs().sum()) == 0, f"{mode}: tile counters left {counters}"
        # fused and separate merges read the same partials: equal up to summation order
        assert _rel(outs["forward"][0][:total], outs["kernel"][0][:total].float()) <= 1e-2


def test_merge_kernel_launched_only_where_a_tile_can_exceed_the_limit(monkeypatch):
    """Decode plans never launch the merge kernel; 17-node trees over long contexts do (their
    short contexts still merge in the forward); forcing the forward launches none."""
    from treeverify.kernels.cuda.runner import Launcher

    def launcher(tree, max_kv):
        return Launcher(device=torch.device("cuda"), dtype=torch.bfloat16, hq=4, hkv=2, dqk=64,
                        dv=64, mla=False, max_batch=1, max_tree=tree, max_kv=max_kv,
                        total_q_cap=tree)  # fmt: skip

    monkeypatch.delenv("TREEVERIFY_CUDA_SPLIT_MERGE", raising=False)
    assert not launcher(1, 32768).merge_kernel_needed  # tiny-code decode
    assert launcher(17, 32768).merge_kernel_needed  # DDTREE-16 verify, 64 splits
    # tiny-code's verify bucket (1024 positions): 16 splits of 34 rows, 139 KB at most: a small
    # plan merges every tile in the forward (kernels/splits.py, plan_merge_limit)
    small = launcher(17, 1024)
    assert small.splits.max_splits == 16 and not small.merge_kernel_needed
    monkeypatch.setenv("TREEVERIFY_CUDA_SPLIT_MERGE", "forward")
    assert not launcher(17, 32768).merge_kernel_needed
    monkeypatch.setenv("TREEVERIFY_CUDA_SPLIT_MERGE", "sideways")
    with pytest.raises(ValueError, match="TREEVERIFY_CUDA_SPLIT_MERGE"):
        launcher(17, 1041)


# ---- v12: balanced splits (kernels/splits.py): a batch of mixed lengths spreads its long requests.


@pytest.mark.parametrize("shape", [(32, 8, 128, 128, False), (8, 1, 576, 512, True)],
                         ids=["gqa128", "mla"])  # fmt: skip
@pytest.mark.parametrize("portable", [False, True], ids=["best", "portable"])
@pytest.mark.parametrize("order", ["request", "longest"])
def test_balanced_splits_on_mixed_lengths_replayed(shape, portable, order, monkeypatch):
    """SGLang's batch path's shape (8 requests, N=64, a plan sized for 8256 keys): with
    balancing the grid has room for more splits than a uniform batch uses and the long requests
    take them. Captured once, replayed over mixed (sorted and shuffled), uniform and padded
    batches: equal to the reference each time, and the forward and merge kernels agree on every
    request's splits (they would not write a finite output otherwise: out is poisoned). With
    TREEVERIFY_CUDA_SPLIT_ORDER=longest the later splits' CTAs serve the requests longest
    first: each tile's split counter still counts one tile's splits (else a merge would run
    early, or never, and leave NaN)."""
    from treeverify.bench.cases import Case, make_inputs
    from treeverify.kernels.splits import policy_splits

    if portable:
        monkeypatch.setenv("TREEVERIFY_CUDA_PORTABLE", "1")
    monkeypatch.setenv("TREEVERIFY_CUDA_SPLIT_ORDER", order)
    hq, hkv, dqk, dv, mla = shape
    case = Case("b", 8, 8192, 64, hq, hkv, dqk, dv, mla)
    page, max_batch, max_tree, max_kv = 16, 8, 64, 8256
    first = make_inputs(case, page_size=page, device="cuda", seed=3)
    plans = {}
    for balance in ("1", "2"):
        monkeypatch.setenv("TREEVERIFY_CUDA_SPLIT_BALANCE", balance)
        plans[balance] = _plan(first, case, page, max_batch, max_tree, max_kv // page, max_kv)
    plain, balanced = plans["1"].split_policy, plans["2"].split_policy
    # One split a request (gqa128): the divisor is 8 / SINGLE_SPLIT_SHARE = 7 (v26).
    div = 7 if plain.max_splits == 1 else 8 * plain.max_splits
    assert plain.balance_div == 0 and balanced.balance_div == div
    assert plans["2"]._launcher.split_longest_first == (order == "longest")
    assert balanced.max_splits == 2 * plain.max_splits
    kc, vc = first["k_cache"], first["v_cache"]
    rows = max_batch * max_tree
    q = torch.randn(rows, hq, dqk, device="cuda", dtype=torch.bfloat16)
    outs, graphs = {}, {}
    for key, plan in plans.items():
        plan.plan(first["block_table"], first["prefix_lens"], first["qo_indptr"],
                  first["tree_mask"])  # fmt: skip
        outs[key] = torch.empty(rows, hq, dv, device="cuda", dtype=torch.bfloat16)
        plan.run(q, kc, vc, outs[key])
        torch.cuda.synchronize()
        graphs[key] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[key]):
            plan.run(q, kc, vc, outs[key])
    steps = [
        [8192, 6000, 4100, 3000, 1800, 800, 240, 1],  # mixed: the long ones split more
        [8192] * 8,  # uniform: the same splits as unbalanced
        [8000, 17, 5000],  # padded: 3 requests in a plan for 8
        [240, 6000, 1, 8192, 800, 3000, 4100, 1800],  # step 0 shuffled: longest first differs
        [3000, 5000, 5000, 17, 3000, 5000, 700, 5000],  # ties in length
    ]
    for step, prefixes in enumerate(steps):
        nxt = make_inputs(case, page_size=page, device="cuda", seed=90 + step,
                          prefix_lens=prefixes, tree_sizes=[64] * len(prefixes))  # fmt: skip
        total, ref = _load_step(nxt, kc, vc, q)
        kv = [p + 64 for p in prefixes]
        if step == 0:
            assert max(policy_splits(balanced, kv)) > max(policy_splits(plain, kv))
        if step == 1:
            assert policy_splits(balanced, kv) == policy_splits(plain, kv)
        for key, plan in plans.items():
            plan.plan(nxt["block_table"], nxt["prefix_lens"], nxt["qo_indptr"], nxt["tree_mask"])
            outs[key].fill_(float("nan"))
            graphs[key].replay()
        torch.cuda.synchronize()
        for key in plans:
            assert _rel(outs[key][:total], ref) <= TOL, (key, step)


@pytest.mark.parametrize("ilp", ["0", "1", "wide"], ids=["merge-v12", "merge-ilp", "merge-wide"])
@pytest.mark.parametrize("shape", MERGE_SHAPES, ids=["gqa64", "gqa128", "mla"])
def test_merge_kernel_with_several_heads_per_cta(shape, ilp, monkeypatch):
    """The merge kernel's CTA takes p.merge_heads heads (v12): the grid forced small
    (TREEVERIFY_CUDA_MERGE_MAX_CTAS) so that it does here, the merge kernel doing every merge,
    and the output still equals the reference; with TREEVERIFY_CUDA_MERGE_ILP=1 (v22) as four
    heads of loads at once where the CTA has at least four (a last group part-empty where the
    heads do not divide by four); with TREEVERIFY_CUDA_MERGE_WIDE=1 (v28) as head lanes of
    dv / 4 threads taking the CTA's heads in turns."""
    from treeverify.bench.cases import Case, make_inputs
    from treeverify.kernels.cuda.variants import merge_head_lanes

    monkeypatch.setenv("TREEVERIFY_CUDA_MERGE_MAX_CTAS", "64")
    monkeypatch.setenv("TREEVERIFY_CUDA_SPLIT_MERGE", "kernel")
    monkeypatch.setenv("TREEVERIFY_CUDA_MERGE_ILP", "1" if ilp == "1" else "0")
    monkeypatch.setenv("TREEVERIFY_CUDA_MERGE_WIDE", "1" if ilp == "wide" else "0")
    monkeypatch.setenv("TREEVERIFY_CUDA_MERGE_SPLIT_LANES", "0")  # it would win over both
    hq, hkv, dqk, dv, mla = shape
    case = Case("h", 3, 1500, 17, hq, hkv, dqk, dv, mla)
    inp = make_inputs(case, page_size=16, device="cuda", seed=5, prefix_lens=[1500, 7, 640],
                      tree_sizes=[17, 3, 9])  # fmt: skip
    plan = _plan(inp, case, 16, 3, 17, inp["block_table"].shape[1], 1600)
    launcher = plan._launcher
    assert launcher.merge_kernel_needed
    assert launcher.merge_heads > 1
    assert launcher.merge_grid[1] == -(-hq // launcher.merge_heads)
    assert launcher.merge_grid[0] * launcher.merge_grid[1] <= 64 or launcher.merge_heads >= hq
    wide = ilp == "1" and launcher.merge_heads >= 4
    assert (launcher.merge.hi, launcher.merge.u) == ((4, 4) if wide else (1, 8))
    lanes = merge_head_lanes(dv) if launcher.merge_heads >= merge_head_lanes(dv) else 1
    assert launcher.merge.w == (lanes if ilp == "wide" else 1)
    plan.plan(inp["block_table"], inp["prefix_lens"], inp["qo_indptr"], inp["tree_mask"])
    out = _poisoned(inp, dv)
    plan.run(inp["q"], inp["k_cache"], inp["v_cache"], out)
    assert _rel(out, _reference(inp)) <= TOL


@pytest.mark.parametrize("ilp", ["0", "1", "lanes"], ids=["merge-v12", "merge-ilp", "split-lanes"])
@pytest.mark.parametrize("shape", MERGE_SHAPES, ids=["gqa64", "gqa128", "mla"])
def test_merge_kernel_with_many_splits(shape, ilp, monkeypatch):
    """Rows split 24 ways (TREEVERIFY_CUDA_MAX_SPLITS), merged by the kernel: with
    TREEVERIFY_CUDA_MERGE_ILP=1 one head's 16 splits of loads at once (v22; two rounds for 24
    splits, the second's last 8 predicated off), equal to the reference; splits that saw no key
    (the short requests') weigh nothing."""
    from treeverify.bench.cases import Case, make_inputs

    monkeypatch.setenv("TREEVERIFY_CUDA_MAX_SPLITS", "24")
    monkeypatch.setenv("TREEVERIFY_CUDA_SPLIT_MERGE", "kernel")
    monkeypatch.setenv("TREEVERIFY_CUDA_MERGE_ILP", "1" if ilp == "1" else "0")
    monkeypatch.setenv("TREEVERIFY_CUDA_MERGE_SPLIT_LANES", "1" if ilp == "lanes" else "0")
    hq, hkv, dqk, dv, mla = shape
    case = Case("s", 2, 3000, 9, hq, hkv, dqk, dv, mla)
    inp = make_inputs(case, page_size=16, device="cuda", seed=8, prefix_lens=[3000, 40],
                      tree_sizes=[9, 5])  # fmt: skip
    plan = _plan(inp, case, 16, 2, 9, inp["block_table"].shape[1], 3100)
    launcher = plan._launcher
    assert launcher.merge_kernel_needed and launcher.splits.max_splits == 24
    assert launcher.merge.s == (4 if ilp == "lanes" else 1)  # 24 splits: 6 a group
    if launcher.merge_heads < 4 and ilp != "lanes":
        assert (launcher.merge.hi, launcher.merge.u) == ((1, 16) if ilp == "1" else (1, 8))
    plan.plan(inp["block_table"], inp["prefix_lens"], inp["qo_indptr"], inp["tree_mask"])
    out = _poisoned(inp, dv)
    plan.run(inp["q"], inp["k_cache"], inp["v_cache"], out)
    assert _rel(out, _reference(inp)) <= TOL


@pytest.mark.parametrize("tree", [16, 64], ids=["one-wave", "four-waves"])
def test_split_lanes_auto_only_where_the_merge_grid_is_one_wave(tree, monkeypatch):
    """TREEVERIFY_CUDA_MERGE_SPLIT_LANES=auto (v31) on the grid's Kimi TP8 shape at batch 1,
    8192 keys: the N=16 plan (16 tokens x 8 heads = 128 merge CTAs, one wave on the H200) takes
    the split lanes, the N=64 one (512 CTAs) the plain merge; both equal the reference with the
    output poisoned."""
    from treeverify.bench.cases import Case, make_inputs

    monkeypatch.setenv("TREEVERIFY_CUDA_MERGE_SPLIT_LANES", "auto")
    for name in ("TREEVERIFY_CUDA_MAX_SPLITS", "TREEVERIFY_CUDA_SPLIT_MERGE"):
        monkeypatch.delenv(name, raising=False)
    case = Case("kimi-tp8", 1, 8192, tree, 8, 1, 576, 512, True)
    inp = make_inputs(case, page_size=16, device="cuda", seed=31)
    plan = _plan(inp, case, 16, 1, tree, inp["block_table"].shape[1], 8192 + tree)
    launcher = plan._launcher
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    one_wave = math.prod(launcher.merge_grid) <= sms
    assert launcher.merge_kernel_needed and launcher.splits.max_splits > 8
    assert one_wave == (tree == 16 and sms >= 128)
    assert launcher.merge.s == (4 if one_wave else 1)
    plan.plan(inp["block_table"], inp["prefix_lens"], inp["qo_indptr"], inp["tree_mask"])
    out = _poisoned(inp, 512)
    plan.run(inp["q"], inp["k_cache"], inp["v_cache"], out)
    assert _rel(out, _reference(inp)) <= TOL


@pytest.mark.parametrize("mode", ["forward", "auto"])
@pytest.mark.parametrize("fused_ilp", ["0", "1"], ids=["fused-v8", "fused-4x2"])
@pytest.mark.parametrize("shape", MERGE_SHAPES, ids=["gqa64", "gqa128", "mla"])
def test_two_split_tiles_merged_in_the_forward(shape, fused_ilp, mode, monkeypatch):
    """Every tile split at most two ways (TREEVERIFY_CUDA_MAX_SPLITS=2) and merged in the forward
    (TREEVERIFY_CUDA_SPLIT_MERGE=forward) or by the default rule (auto): with
    TREEVERIFY_CUDA_FUSED_MERGE_ILP=1 (v28) the last CTA of a tile loads 4 rows x 2 splits at a
    time, its rows not a multiple of four (17-node trees), and under auto a tile of up to twice
    the byte limit merges there (gqa128's 68-row tiles, 68 KiB: the merge kernel not launched);
    the output equals the reference on two runs in a row (the tile counters reset)."""
    from treeverify.bench.cases import Case, make_inputs
    from treeverify.kernels.splits import merge_bytes, merged_in_forward

    monkeypatch.setenv("TREEVERIFY_CUDA_MAX_SPLITS", "2")
    monkeypatch.setenv("TREEVERIFY_CUDA_SPLIT_MERGE", mode)
    monkeypatch.setenv("TREEVERIFY_CUDA_FUSED_MERGE_ILP", fused_ilp)
    hq, hkv, dqk, dv, mla = shape
    case = Case("f", 3, 2000, 17, hq, hkv, dqk, dv, mla)
    inp = make_inputs(case, page_size=16, device="cuda", seed=11, prefix_lens=[2000, 1100, 30],
                      tree_sizes=[17, 13, 17])  # fmt: skip
    plan = _plan(inp, case, 16, 3, 17, inp["block_table"].shape[1], 2100)
    launcher = plan._launcher
    assert launcher.splits.max_splits == 2
    tile = min(launcher.fwd.bm, 17 * launcher.group)
    fused = merged_in_forward(2, tile, dv, launcher.fused_merge_bytes, launcher.fused_merge_ilp)
    assert launcher.merge_kernel_needed == (not fused)
    if mode == "forward":
        assert fused
    elif merge_bytes(2, tile, dv) > launcher.fused_merge_bytes:  # gqa128's 68-row tiles
        assert hq != 32 or fused == (fused_ilp == "1")
    plan.plan(inp["block_table"], inp["prefix_lens"], inp["qo_indptr"], inp["tree_mask"])
    ref = _reference(inp)
    for _ in range(2):
        out = _poisoned(inp, dv)
        plan.run(inp["q"], inp["k_cache"], inp["v_cache"], out)
        assert _rel(out, ref) <= TOL


# ---- Plans sharing one SplitArena (kernels/split_arena.py): the SGLang backend's plans.


@pytest.mark.parametrize("shape", [(32, 8, 128, 128, False), (16, 1, 576, 512, True)],
                         ids=["gqa128", "mla"])  # fmt: skip
def test_plans_sharing_a_split_arena_replayed_in_turn(shape):
    """Two captured plans of different batch sizes (8 and 2 requests, both splitting) take
    their partials and merge counters from one arena, as the SGLang backend's per-batch-size
    plans do; their graphs replayed in turn over new lengths (each twice, as two layers) equal
    the reference every time: neither leaves state the other reads wrongly, the counters
    included."""
    from treeverify.bench.cases import Case, make_inputs
    from treeverify.kernels.plan import TreeAttentionPlan
    from treeverify.kernels.split_arena import SplitArena

    hq, hkv, dqk, dv, mla = shape
    page, max_tree, max_kv = 16, 64, 8256
    arena = SplitArena("cuda")
    plans, cases, firsts = {}, {}, {}
    for batch in (8, 2):  # the larger first, as SGLang captures
        cases[batch] = Case("a", batch, 8192, 64, hq, hkv, dqk, dv, mla)
        firsts[batch] = make_inputs(cases[batch], page_size=page, device="cuda", seed=batch)
        plans[batch] = TreeAttentionPlan(
            num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=dqk, head_dim_v=dv, mla=mla,
            page_size=page, max_batch=batch, max_tree=max_tree,
            max_pages_per_request=max_kv // page + 1, max_kv_len=max_kv,
            sm_scale=firsts[batch]["sm_scale"], dtype=torch.bfloat16, device="cuda",
            split_balance=2, split_arena=arena,
        )  # fmt: skip
    assert all(p._launcher.splits.max_splits > 1 for p in plans.values())
    assert arena.requests == 2
    if arena.grown == 0:  # the smaller plan's partials are views of the larger one's
        assert plans[2].part_o.data_ptr() == plans[8].part_o.data_ptr()
    outs, graphs, qs = {}, {}, {}
    for batch, plan in plans.items():
        first = firsts[batch]
        plan.plan(first["block_table"], first["prefix_lens"], first["qo_indptr"],
                  first["tree_mask"])  # fmt: skip
        qs[batch] = torch.randn(batch * max_tree, hq, dqk, device="cuda", dtype=torch.bfloat16)
        outs[batch] = torch.empty(batch * max_tree, hq, dv, device="cuda", dtype=torch.bfloat16)
        plan.run(qs[batch], first["k_cache"], first["v_cache"], outs[batch])
        torch.cuda.synchronize()
        graphs[batch] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[batch]):
            plan.run(qs[batch], first["k_cache"], first["v_cache"], outs[batch])
            plan.run(qs[batch], first["k_cache"], first["v_cache"], outs[batch])
    steps = {8: [[8192, 6000, 4100, 3000, 1800, 800, 240, 1], [4000] * 8],
             2: [[8000, 300], [5000, 5000]]}  # fmt: skip
    for i in range(2):
        for batch in (2, 8):  # in turn, the smaller first
            prefixes = steps[batch][i]
            nxt = make_inputs(cases[batch], page_size=page, device="cuda", seed=50 + 10 * i + batch,
                              prefix_lens=prefixes, tree_sizes=[64] * batch)  # fmt: skip
            first = firsts[batch]
            total, ref = _load_step(nxt, first["k_cache"], first["v_cache"], qs[batch])
            plans[batch].plan(nxt["block_table"], nxt["prefix_lens"], nxt["qo_indptr"],
                              nxt["tree_mask"])  # fmt: skip
            outs[batch].fill_(float("nan"))
            graphs[batch].replay()
            torch.cuda.synchronize()
            assert _rel(outs[batch][:total], ref) <= TOL, (batch, i)
