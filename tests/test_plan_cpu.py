"""TreeAttentionPlan on the CPU (backend="torch"): plan/run equals the eager op, metadata can be
rewritten by plan() between runs, and capacities are enforced with ValueErrors naming them."""

from __future__ import annotations

import itertools

import pytest
import torch

from treeverify.bench.cases import Case, make_inputs
from treeverify.kernels import TreeAttentionPlan, tree_attention


def _plan(case, page, **kw):
    args = dict(num_qo_heads=case.hq, num_kv_heads=case.hkv, head_dim_qk=case.dqk,
                head_dim_v=case.dv, mla=case.mla, page_size=page, max_batch=3, max_tree=40,
                max_pages_per_request=64, max_kv_len=1000, sm_scale=0.1, dtype=torch.float32,
                device="cpu", backend="torch")  # fmt: skip
    args.update(kw)
    return TreeAttentionPlan(**args)


@pytest.mark.parametrize("mla", [False, True])
def test_plan_run_equals_eager_across_replans(mla):
    case = Case("t", 3, 500, 40, 4 if mla else 8, 1 if mla else 2, 576 if mla else 64,
                512 if mla else 64, mla)  # fmt: skip
    plan = _plan(case, 16)
    views = (plan.block_table, plan.prefix_lens, plan.qo_indptr, plan.tree_mask)
    meta = sum(t.nbytes for t in views)  # one buffer, each view 256-byte aligned in it
    assert meta <= plan.workspace_bytes < meta + 4 * 256  # torch plans hold no partials
    for seed, (prefixes, trees) in enumerate([([500, 0, 37], [40, 1, 17]), ([9, 900], [3, 33])]):
        inp = make_inputs(case, page_size=16, device="cpu", dtype=torch.float32, seed=seed,
                          prefix_lens=prefixes, tree_sizes=trees)  # fmt: skip
        plan.plan(inp["block_table"], inp["prefix_lens"], inp["qo_indptr"], inp["tree_mask"])
        out = torch.full((inp["q"].shape[0], case.hq, case.dv), float("nan"))
        plan.run(inp["q"], inp["k_cache"], inp["v_cache"], out)
        ref = tree_attention(inp["q"], inp["k_cache"], inp["v_cache"], inp["block_table"],
                             inp["prefix_lens"], inp["qo_indptr"], inp["tree_mask"], 0.1,
                             v_head_dim=inp["v_head_dim"], backend="torch")  # fmt: skip
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_plan_capacities_raise_value_errors_naming_them():
    case = Case("t", 2, 100, 16, 8, 2, 64, 64, False)
    inp = make_inputs(case, page_size=16, device="cpu", dtype=torch.float32, seed=1)
    plan = _plan(case, 16, max_tree=8)
    with pytest.raises(ValueError, match="max_tree|max_total_q"):
        plan.plan(inp["block_table"], inp["prefix_lens"], inp["qo_indptr"], inp["tree_mask"])
    plan = _plan(case, 16, max_batch=1)
    with pytest.raises(ValueError, match="max_batch"):
        plan.plan(inp["block_table"], inp["prefix_lens"], inp["qo_indptr"], inp["tree_mask"])
    plan = _plan(case, 16, max_kv_len=50)
    with pytest.raises(ValueError, match="max_kv_len"):
        plan.plan(inp["block_table"], inp["prefix_lens"], inp["qo_indptr"], inp["tree_mask"])
    plan = _plan(case, 16, max_pages_per_request=2)
    with pytest.raises(ValueError, match="block_table"):
        plan.plan(inp["block_table"], inp["prefix_lens"], inp["qo_indptr"], inp["tree_mask"])
    plan = _plan(case, 16)
    plan.plan(inp["block_table"], inp["prefix_lens"], inp["qo_indptr"], inp["tree_mask"])
    with pytest.raises(ValueError, match="q:"):
        plan.run(inp["q"].double(), inp["k_cache"], inp["v_cache"], inp["q"])
    with pytest.raises(ValueError, match="num_qo_heads"):
        _plan(case, 16, num_qo_heads=7)
    with pytest.raises(ValueError, match="backend"):
        _plan(case, 16, backend="tpu")


def test_host_metadata_written_into_the_buffers_the_kernels_read():
    """plan() writes a step's metadata into the fixed buffers the kernels read: the step's prefix
    lengths (zeros past the batch), qo_indptr (total_q past it), the batch's page rows (zeros
    past each row's width and past the batch) and its mask rows (zeros past them), step after
    step as the batch shrinks and grows, at the same addresses (what a captured graph reads):
    nothing of a larger earlier step survives."""
    case = Case("t", 3, 200, 20, 8, 2, 64, 64, False)
    plan = _plan(case, 16)
    addresses = [t.data_ptr() for t in (plan.prefix_lens, plan.qo_indptr, plan.block_table,
                                        plan.tree_mask)]  # fmt: skip
    for step, (prefixes, trees) in enumerate([([200, 3, 77], [20, 5, 9]), ([31], [20]),
                                              ([0, 190], [1, 17])]):  # fmt: skip
        inp = make_inputs(case, page_size=16, device="cpu", dtype=torch.float32, seed=step,
                          prefix_lens=prefixes, tree_sizes=trees)  # fmt: skip
        plan.plan(inp["block_table"], inp["prefix_lens"], inp["qo_indptr"], inp["tree_mask"])
        b, total = len(prefixes), sum(trees)
        width = inp["block_table"].shape[1]
        assert plan.prefix_lens.tolist() == prefixes + [0] * (3 - b)
        assert plan.qo_indptr.tolist() == inp["qo_indptr"].tolist() + [total] * (3 - b)
        assert torch.equal(plan.block_table[:b, :width], inp["block_table"])
        assert (plan.block_table[:b, width:] == 0).all() and (plan.block_table[b:] == 0).all()
        words = inp["tree_mask"].shape[1]
        assert torch.equal(plan.tree_mask[:total, :words], inp["tree_mask"])
        assert (plan.tree_mask[:total, words:] == 0).all() and (plan.tree_mask[total:] == 0).all()
        assert [t.data_ptr() for t in (plan.prefix_lens, plan.qo_indptr, plan.block_table,
                                       plan.tree_mask)] == addresses  # fmt: skip


def test_plan_rejects_metadata_whose_shapes_disagree():
    case = Case("t", 2, 100, 16, 8, 2, 64, 64, False)
    inp = make_inputs(case, page_size=16, device="cpu", dtype=torch.float32, seed=1)
    plan = _plan(case, 16)
    bt, pl, qo, mask = (inp[k] for k in ("block_table", "prefix_lens", "qo_indptr", "tree_mask"))
    with pytest.raises(ValueError, match="block_table"):
        plan.plan(bt[:1], pl, qo, mask)
    with pytest.raises(ValueError, match="qo_indptr"):
        plan.plan(bt, pl, qo[:2], mask)
    with pytest.raises(ValueError, match="tree_mask"):
        plan.plan(bt, pl, qo, mask[:5])
    # values (a new user's audit): a negative prefix ran to NaN, a decreasing indptr to a
    # shape error in the backend
    with pytest.raises(ValueError, match="prefix_lens: expected lengths >= 0"):
        plan.plan(bt, pl - pl.max() - 1, qo, mask)
    with pytest.raises(ValueError, match="qo_indptr: expected non-decreasing"):
        plan.plan(bt, pl, qo.flip(0), mask)
    with pytest.raises(ValueError, match="qo_indptr: expected non-decreasing"):
        plan.plan(bt, pl, qo + 1, mask)
    plan.plan(bt, pl, qo, mask)  # the plan still works after the rejections


@pytest.mark.parametrize("batch", [1, 5, 16, 17, 40])  # Python ints up to 16 requests, numpy past
def test_capacity_checks_hold_exactly_at_the_limits(batch):
    """A step exactly at max_tree, max_kv_len and max_total_q plans; one more node or token
    than a capacity raises the ValueError naming it, whichever request carries it."""
    import random

    rng = random.Random()
    trees = [rng.randint(1, 12) for _ in range(batch)]
    prefixes = [rng.randint(0, 80) for _ in range(batch)]
    qo = torch.tensor([0] + list(itertools.accumulate(trees)), dtype=torch.int32)
    longest = max(p + t for p, t in zip(prefixes, trees, strict=True))
    meta = (torch.zeros(batch, 8, dtype=torch.int32), torch.tensor(prefixes, dtype=torch.int32),
            qo, torch.zeros(int(qo[-1]), 1, dtype=torch.int32))  # fmt: skip
    limits = dict(max_batch=batch, max_tree=max(trees), max_kv_len=longest,
                  max_total_q=int(qo[-1]), max_pages_per_request=8)  # fmt: skip
    case = Case("t", batch, 80, 12, 8, 2, 64, 64, False)
    _plan(case, 16, **limits).plan(*meta)  # exactly at every limit
    for name in ("max_tree", "max_kv_len", "max_total_q"):
        tight = dict(limits, **{name: limits[name] - 1})
        with pytest.raises(ValueError, match=name):
            _plan(case, 16, **tight).plan(*meta)


def test_split_arena_only_for_the_cuda_backend():
    """A shared split arena is the CUDA launcher's; another backend refuses it by name instead
    of silently allocating its own partials."""
    from treeverify.kernels.split_arena import SplitArena

    case = Case("t", 3, 500, 40, 8, 2, 64, 64, False)
    with pytest.raises(ValueError, match="split_arena"):
        _plan(case, 16, split_arena=SplitArena("cpu"))


def test_run_refuses_a_cache_of_another_page_size():
    """A cache whose page size is not the plan's: a ValueError naming k_cache at run() (a shape:
    no sync; it ran silently before). A block-table row short of the pages its prefix + tree
    reaches is not refused at plan(): its missing columns read page 0, the engine's scratch
    page, which its padded prefill rows reach by design (tests/test_prefill_graphs.py)."""
    from treeverify.kernels.plan import TreeAttentionPlan

    q, k, v = torch.randn(3, 4, 64), torch.randn(8, 16, 2, 64), torch.randn(8, 16, 2, 64)
    pl, qo = torch.tensor([20], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32)
    mask = torch.tensor([[1], [3], [7]], dtype=torch.int32)
    plan = TreeAttentionPlan(num_qo_heads=4, num_kv_heads=2, head_dim_qk=64, page_size=16,
                             max_batch=2, max_tree=8, max_pages_per_request=4, sm_scale=0.125,
                             dtype=torch.float32, device="cpu", backend="torch")  # fmt: skip
    plan.plan(torch.tensor([[3, 5]], dtype=torch.int32), pl, qo, mask)
    with pytest.raises(ValueError, match="k_cache"):
        plan.run(q, torch.randn(8, 8, 2, 64), torch.randn(8, 8, 2, 64), torch.empty(3, 4, 64))
    out = plan.run(q, k, v, torch.full((3, 4, 64), float("nan")))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(
    "field, value",
    [("head_dim_v", -1), ("dtype", torch.int32), ("dtype", "bf16"), ("max_kv_len", -5),
     ("max_total_q", 0), ("split_balance", -3), ("sm_scale", "abc"), ("sm_scale", float("nan")),
     ("device", "gpu"), ("num_qo_heads", True)],
)  # fmt: skip
def test_plan_constructor_refuses_nonsense_naming_the_argument(field, value):
    """Each was accepted (or failed later, or in torch's words): a ValueError naming it."""
    base = dict(num_qo_heads=4, num_kv_heads=2, head_dim_qk=64, page_size=16, max_batch=2,
                max_tree=8, max_pages_per_request=4, sm_scale=0.125, dtype=torch.float32,
                device="cpu", backend="torch")  # fmt: skip
    with pytest.raises(ValueError, match=field):
        TreeAttentionPlan(**{**base, field: value})
