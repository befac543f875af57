"""plan() with host metadata on the GPU (kernels/plan_metadata.py): the step's values reach the
fixed device buffers through a ring of pinned staging buffers, without a sync, even when the GPU
runs many plans behind (a staging buffer is never rewritten while a queued copy still reads it),
and with the mask on the device (a speculative round's). Skipped without a CUDA GPU."""

from __future__ import annotations

import pytest
import torch

from treeverify.bench.cases import Case, make_inputs
from treeverify.kernels.plan import TreeAttentionPlan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CASE = Case("t", 4, 900, 40, 8, 2, 64, 64, False)
META = ("block_table", "prefix_lens", "qo_indptr", "tree_mask")
STEPS = [([900, 3, 77, 400], [40, 5, 9, 33]), ([31], [20]), ([0, 890, 5], [1, 17, 40]),
         ([600, 600, 600, 600], [40, 40, 40, 40]), ([12, 0], [3, 1])]  # fmt: skip


def _plan() -> TreeAttentionPlan:
    return TreeAttentionPlan(
        num_qo_heads=CASE.hq, num_kv_heads=CASE.hkv, head_dim_qk=CASE.dqk, page_size=16,
        max_batch=4, max_tree=40, max_pages_per_request=60, max_kv_len=960, sm_scale=0.1,
    )  # fmt: skip


def _expected(inp: dict, plan: TreeAttentionPlan) -> dict[str, torch.Tensor]:
    """The buffers as if zeroed and refilled with this step's metadata."""
    b, total = inp["prefix_lens"].shape[0], int(inp["qo_indptr"][-1])
    bt = torch.zeros_like(plan.block_table, device="cpu")
    bt[:b, : inp["block_table"].shape[1]] = inp["block_table"].cpu()
    pl = torch.zeros_like(plan.prefix_lens, device="cpu")
    pl[:b] = inp["prefix_lens"].cpu()
    qo = torch.full_like(plan.qo_indptr, total, device="cpu")
    qo[: b + 1] = inp["qo_indptr"].cpu()
    mask = torch.zeros_like(plan.tree_mask, device="cpu")
    mask[:total, : inp["tree_mask"].shape[1]] = inp["tree_mask"][:total].cpu()
    return {"block_table": bt, "prefix_lens": pl, "qo_indptr": qo, "tree_mask": mask}


def _steps() -> list[dict]:
    return [make_inputs(CASE, page_size=16, device="cpu", seed=s, prefix_lens=p, tree_sizes=t)
            for s, (p, t) in enumerate(STEPS)]  # fmt: skip


@pytest.mark.parametrize("mask_on_device", [False, True])
def test_host_plans_queued_behind_a_busy_gpu_land_in_order(mask_on_device):
    """Twenty plans queued while the GPU sleeps, so the ring comes round to staging buffers
    whose copies have not run (plan() must wait for them, not overwrite them): a device copy
    of the buffers taken after each plan holds that step's metadata exactly."""
    plan = _plan()
    steps = _steps()
    masks = [inp["tree_mask"].cuda() if mask_on_device else inp["tree_mask"] for inp in steps]
    snapshots = []
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # GPU time ahead of every copy below
    for i in range(20):
        inp = steps[i % len(steps)]
        plan.plan(inp["block_table"], inp["prefix_lens"], inp["qo_indptr"], masks[i % len(steps)])
        snapshots.append({k: getattr(plan, k).clone() for k in META})  # queued after the copies
    torch.cuda.synchronize()
    for i, snap in enumerate(snapshots):
        want = _expected(steps[i % len(steps)], plan)
        for k in META:
            assert torch.equal(snap[k].cpu(), want[k]), (i, k)


def test_host_plan_on_an_idle_gpu_never_syncs():
    plan = _plan()
    steps = _steps()
    plan.plan(*[steps[0][k] for k in META])  # the first plan makes the staging ring
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for inp in steps[1:3]:
            plan.plan(*[inp[k] for k in META])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    want = _expected(steps[2], plan)
    for k in META:
        assert torch.equal(getattr(plan, k).cpu(), want[k]), k


def test_host_and_device_metadata_fill_the_same_buffers():
    """Steps alternating host and device metadata (the device path zeroes and refills; the
    host path writes up to the previous extent): the buffers equal the expected ones after
    every step, at the same addresses."""
    plan = _plan()
    addresses = [getattr(plan, k).data_ptr() for k in META]
    for i, inp in enumerate(_steps() * 2):
        meta = [inp[k] if i % 3 else inp[k].cuda() for k in META]
        plan.plan(*meta)
        torch.cuda.synchronize()
        want = _expected(inp, plan)
        for k in META:
            assert torch.equal(getattr(plan, k).cpu(), want[k]), (i, k)
    assert [getattr(plan, k).data_ptr() for k in META] == addresses
