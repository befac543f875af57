"""engine/stage_unpack.py's kernel on the CPU interpreter (TRITON_INTERPRET=1): one launch per
attention plan must leave every buffer a graph reads exactly as the copy per buffer leaves it
(CudaGraphs._targets), including what lies outside the bucket: the tree mask's rows past the
bucket's and the page table's columns past max_pages keep their poison. The stage holds random
words (valid rows as assorted non-zero values: any non-zero word is a valid row).
tests/test_stage_unpack_gpu.py runs it compiled, inside captured graphs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from triton_interpreter import cache_cleared, interpret_on_cpu

interpret_on_cpu("tests/test_stage_unpack_gpu.py")

from treeverify.engine import stage_unpack as stage_unpack_module  # noqa: E402
from treeverify.engine.stage_unpack import unpack_stage  # noqa: E402
from treeverify.engine.step_stage import StepStage  # noqa: E402

interpreted_kernels = cache_cleared(stage_unpack_module._kernel)


def _random_stage(batch: int, n: int, words: int, pages: int, g: torch.Generator) -> StepStage:
    stage = StepStage(batch, n, words, pages, scratch_slot=999, device=torch.device("cpu"))
    stage.dev.copy_(torch.randint(-(2**31), 2**31 - 1, stage.dev.shape, generator=g,
                                  dtype=torch.int64).to(torch.int32))  # fmt: skip
    valid = stage.views["valid"]
    valid.copy_(torch.arange(valid.shape[0]) % 3 * -7)  # 0, -7, -14, 0, ...: mixed rows
    return stage


def _buffers(batch: int, rows: int, words: int, max_pages: int, plans: int,
             g: torch.Generator) -> tuple[dict, list]:  # fmt: skip
    """Poisoned buffers as CudaGraphs holds them: larger than the bucket where they are."""
    big = 3 * rows + 5
    common = {k: torch.randint(-99, 99, (big,), generator=g)[:rows]
              for k in ("ids", "pos", "slots")}  # fmt: skip
    common["valid"] = torch.randint(0, 2, (rows,), generator=g).bool()
    out = []
    for _ in range(plans):
        i32 = dict(dtype=torch.int32)
        out.append(SimpleNamespace(
            prefix_lens=torch.randint(-99, 99, (batch,), generator=g, **i32),
            qo_indptr=torch.randint(-99, 99, (batch + 1,), generator=g, **i32),
            tree_mask=torch.randint(-99, 99, (big, words), generator=g, **i32),
            block_table=torch.randint(-99, 99, (batch, max_pages + 3), generator=g, **i32),
        ))  # fmt: skip
    return common, out


def _copied(stage: StepStage, common: dict, plans: list, max_pages: int) -> None:
    """What CudaGraphs._unpack does without the kernel."""
    v, rows = stage.views, stage.rows
    for k in ("ids", "pos", "slots", "valid"):
        common[k].copy_(v[k])
    for p in plans:
        p.prefix_lens.copy_(v["prefix"])
        p.qo_indptr.copy_(v["qo"])
        p.tree_mask[:rows].copy_(v["mask"])
        p.block_table[:, :max_pages].t().copy_(v["table"])


def _clone(common: dict, plans: list) -> tuple[dict, list]:
    plans = [SimpleNamespace(**{k: t.clone() for k, t in vars(p).items()}) for p in plans]
    return {k: t.clone() for k, t in common.items()}, plans


@pytest.mark.parametrize(
    "batch,n,words,pages,plans,block,programs",
    [(1, 17, 1, 6, 1, 1024, 16), (3, 5, 2, 7, 2, 4, 2), (2, 1, 1, 9, 0, 8, 3),
     (4, 33, 2, 5, 1, 16, 1)],
    ids=["b1-tree", "two-plans-strided", "no-plan", "one-program"],
)  # fmt: skip
def test_kernel_leaves_the_buffers_as_the_copies_do(batch, n, words, pages, plans, block,
                                                    programs):  # fmt: skip
    g = torch.Generator().manual_seed(batch * 100 + n)
    stage = _random_stage(batch, n, words, pages, g)
    common, plan_list = _buffers(batch, stage.rows, words, pages, plans, g)
    want_common, want_plans = _clone(common, plan_list)
    _copied(stage, want_common, want_plans, pages)
    unpack_stage(stage.views, common, plan_list, pages, block=block, programs=programs)
    for k in want_common:
        assert torch.equal(common[k], want_common[k]), k
    assert bool(common["valid"].any()) and not bool(common["valid"].all())
    for got, want in zip(plan_list, want_plans, strict=True):
        for k, t in vars(want).items():
            assert torch.equal(getattr(got, k), t), k


def test_mismatched_buffers_are_refused_by_name():
    g = torch.Generator().manual_seed(5)
    stage = _random_stage(2, 3, 1, 4, g)
    common, plans = _buffers(2, stage.rows, 1, 4, 1, g)
    with pytest.raises(ValueError, match="valid"):
        unpack_stage(stage.views, {**common, "valid": common["valid"].int()}, plans, 4)
    with pytest.raises(ValueError, match="max_pages"):
        unpack_stage(stage.views, common, plans, 5)
    narrow = plans[0].block_table
    plans[0].block_table = narrow[:, :3]  # fewer columns than the stage's 4 pages
    with pytest.raises(ValueError, match="block_table"):
        unpack_stage(stage.views, common, plans, 4)
    plans[0].block_table = narrow
    plans[0].tree_mask = plans[0].tree_mask[:, :0]
    with pytest.raises(ValueError, match="tree_mask"):
        unpack_stage(stage.views, common, plans, 4)
