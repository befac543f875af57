"""A graph bucket's staged inputs unpacked into its fixed buffers by one kernel at the start of
the graph (TREEVERIFY_STAGE_UNPACK), instead of a copy node per buffer.

Why: a replayed step begins by moving its stage's device twin (engine/step_stage.py) into the
buffers the forward reads: token ids, positions, KV slots, valid rows (int32 -> bool) and each
attention plan's prefix lengths, qo_indptr, tree mask and page table (stored transposed). As
torch copies these are 9 graph nodes for a one-plan model: 7 driver memcpy kernels and 2
elementwise copies, ~11 us of a ~147 us tiny-code decode forward on the H100 (the forty-sixth
session's kernel list: memcpy32_post x7 6.8 us, direct_copy x2 4.1 us), each its own launch with
a gap. One kernel copies them all in one launch.

    unpack   grid (NX, 4 * common + 4 * plan): axis 1 picks the segment (ids, pos, slots,
             valid | prefix, qo, mask, table); each program strides over its segment by
             NX * BLOCK values. The table segment reads the stage's (P, B) and writes the
             plan's block_table[b, p] (row stride `table_stride`).

A model with several attention plans (shapes) launches once per plan, the common segments with
the first. Only where Triton is installed; otherwise, and with the switch off, the copies.
"""

from __future__ import annotations

import functools

import torch

from treeverify import env
from treeverify.kernels.api import triton_available


def kernel_unpacks() -> bool:
    """Whether graphs unpack their stage with one kernel: TREEVERIFY_STAGE_UNPACK on and
    Triton importable (else a torch copy per buffer)."""
    return env.stage_unpack() and triton_available()


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def unpack(s_ids, s_pos, s_slots, s_valid, ids, pos, slots, valid, rows,
               s_prefix, s_qo, s_mask, s_table, prefix, qo, mask, table,
               batch, mask_values, table_values, table_stride,
               COMMON: tl.constexpr, PLAN: tl.constexpr,
               BLOCK: tl.constexpr, NX: tl.constexpr):  # fmt: skip
        # every pointer but valid's and the table's is int32 (int64 buffers as word pairs), so
        # one loop copies whichever plain segment this program's axis 1 picks
        seg = tl.program_id(1) + (0 if COMMON else 4)
        first = tl.program_id(0) * BLOCK
        if seg == 3:  # valid rows: int32 -> bool
            for start in range(first, rows, NX * BLOCK):
                offs = start + tl.arange(0, BLOCK)  # (BLOCK,)
                m = offs < rows
                tl.store(valid + offs, tl.load(s_valid + offs, mask=m) != 0, mask=m)
        elif seg == 7:  # the stage's (P, B) table into block_table (B, >= P)
            if PLAN:
                for start in range(first, table_values, NX * BLOCK):
                    offs = start + tl.arange(0, BLOCK)  # (BLOCK,) = page * B + request
                    m = offs < table_values
                    page, req = offs // batch, offs % batch
                    tl.store(table + req * table_stride + page,
                             tl.load(s_table + offs, mask=m), mask=m)  # fmt: skip
        else:
            src, dst, total = s_ids, ids, 2 * rows
            if seg == 1:
                src, dst = s_pos, pos
            if seg == 2:
                src, dst = s_slots, slots
            if PLAN:
                if seg == 4:
                    src, dst, total = s_prefix, prefix, batch
                if seg == 5:
                    src, dst, total = s_qo, qo, batch + 1
                if seg == 6:
                    src, dst, total = s_mask, mask, mask_values
            for start in range(first, total, NX * BLOCK):
                offs = start + tl.arange(0, BLOCK)  # (BLOCK,)
                m = offs < total
                tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)

    return unpack


def unpack_stage(views: dict[str, torch.Tensor], common: dict[str, torch.Tensor],
                 plans: list, max_pages: int, block: int = 1024,
                 programs: int = 16) -> None:  # fmt: skip
    """The stage's device twin `views` (StepStage.views) into the bucket's buffers: `common`
    holds ids, pos, slots ((R,) int64) and valid ((R,) bool), each plan its prefix_lens,
    qo_indptr, tree_mask (rows R) and block_table's first `max_pages` pages. One launch per
    plan (one when there is none); capture-safe. `block`, `programs`: values a program copies
    at a time and programs per segment (the tests make them small to stride)."""
    rows = views["ids"].shape[0]
    for name, dtype in (("ids", torch.int64), ("pos", torch.int64), ("slots", torch.int64),
                        ("valid", torch.bool)):  # fmt: skip
        buf = common[name]
        if buf.shape != (rows,) or buf.dtype != dtype or not buf.is_contiguous():
            raise ValueError(f"unpack_stage: {name} {tuple(buf.shape)} {buf.dtype}; expected "
                             f"({rows},) {dtype}, contiguous")  # fmt: skip
    kernel = _kernel()
    words = [views[k].view(torch.int32) for k in ("ids", "pos", "slots")]  # (2R,) each
    src = (*words, views["valid"])
    dst = (*(common[k].view(torch.int32) for k in ("ids", "pos", "slots")), common["valid"])
    pages, batch = views["table"].shape
    if pages != max_pages:
        raise ValueError(f"unpack_stage: the stage holds {pages} pages, max_pages {max_pages}")
    for i, p in enumerate(plans or [None]):
        first = i == 0
        if p is None:  # no attention plan: the common part alone (placeholders for the rest)
            plan_src = plan_dst = (*words, views["valid"])  # (int32 placeholders, unread)
            mask_values = table_values = stride = 0
        else:
            mask = p.tree_mask[:rows]  # (R, W)
            if mask.shape != views["mask"].shape or not mask.is_contiguous():
                raise ValueError(f"unpack_stage: tree_mask {tuple(mask.shape)}, the stage's "
                                 f"{tuple(views['mask'].shape)}")  # fmt: skip
            if p.prefix_lens.shape != (batch,) or p.block_table.stride(1) != 1:
                raise ValueError(f"unpack_stage: a plan of batch {p.prefix_lens.shape[0]} "
                                 f"for a stage of {batch}")  # fmt: skip
            if p.block_table.shape[1] < pages:  # the kernel writes pages columns a request
                raise ValueError(f"unpack_stage: block_table {tuple(p.block_table.shape)} "
                                 f"holds fewer than the stage's {pages} pages")  # fmt: skip
            plan_src = (views["prefix"], views["qo"], views["mask"], views["table"])
            plan_dst = (p.prefix_lens, p.qo_indptr, mask, p.block_table)
            mask_values, table_values = mask.numel(), pages * batch
            stride = p.block_table.stride(0)
        segments = 4 * first + 4 * (p is not None)
        kernel[(programs, segments)](*src, *dst, rows, *plan_src, *plan_dst, batch,
                                     mask_values, table_values, stride, COMMON=first,
                                     PLAN=p is not None, BLOCK=block, NX=programs,
                                     num_warps=4)  # fmt: skip
