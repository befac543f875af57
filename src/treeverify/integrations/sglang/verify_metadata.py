"""SGLang's target-verify batch -> our plan's metadata buffers, on the device, in place.

SGLang describes a verify step with (facts: shared/design/sglang-backend.md §3):
* ``req_to_token (R, C)`` int32: token-slot id of every position of every request row; before a
  verify step the draft tokens' slots are already at positions ``P_b .. P_b+N-1``;
* ``req_pool_indices (B,)``: each request's row; ``seq_lens (B,)``: ``P_b``, the committed length
  *without* the draft tokens;
* a custom mask in one of two layouts: FULL_MASK (request ``b`` owns a row-major ``[N, P_b+N]``
  block at ``N*N*b + N*sum(P_<b)``, prefix columns 1, the last ``N`` columns ancestor-or-self) or
  QLEN_ONLY (an ``[N, N]`` block at ``N*N*b``).
Slot ids are page-aligned when ``page_size > 1`` (slot = page * page_size + offset), so page ``p``
of a request is ``req_to_token[row, p * page_size] // page_size``.

Everything here is shape-driven device work: no host reads, no allocation that depends on values,
so it may run right before a graph replay (or inside a capture) on fixed-address buffers.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from treeverify.spec.sglang_layout import sglang_mask_to_tree_mask

FULL_MASK = "full"  # SGLang's TreeMaskMode.FULL_MASK: [N, P+N] per request
QLEN_ONLY = "qlen"  # SGLang's TreeMaskMode.QLEN_ONLY: [N, N] per request
MASK_MODES = (FULL_MASK, QLEN_ONLY)


def sglang_mask_to_bits(custom_mask: Tensor, seq_lens: Tensor, n: int, mode: str) -> Tensor:
    """SGLang's flat verify mask -> our packed ``(B*N, ceil(N/32))`` int32 ``tree_mask``.

    ``seq_lens``: ``(B,)`` prefix lengths (only FULL_MASK's layout depends on them). The offsets
    are recomputed on the device (SGLang's mask_indptr is their cumsum), so no host value is
    needed; requests past the mask's end (a padded graph batch) read inside it.
    """
    if mode not in MASK_MODES:
        raise ValueError(f"mode: expected one of {MASK_MODES}, got {mode!r}")
    bsz = seq_lens.shape[0]
    dev = custom_mask.device
    kv_indptr = torch.zeros(bsz + 1, dtype=torch.int32, device=dev)
    mask_indptr = torch.zeros(bsz + 1, dtype=torch.int64, device=dev)
    mask_indptrs(seq_lens.to(dev), n, custom_mask.numel(), mode, kv_indptr, mask_indptr)
    plen = kv_indptr[1:] - kv_indptr[:-1]  # (B,): the layout's prefix columns (0 for QLEN_ONLY)
    return sglang_mask_to_tree_mask(custom_mask, mask_indptr, plen, n)


def block_table_from_req_to_token(
    req_to_token: Tensor, req_pool_indices: Tensor, page_size: int, pages: int
) -> Tensor:
    """``(B, pages)`` int32 page ids of each request's first ``pages`` pages.

    Columns past a request's length hold whatever ``req_to_token`` holds there; the kernels never
    read past ``P_b + N`` tokens.
    """
    cols = torch.arange(pages, device=req_to_token.device) * page_size  # (pages,)
    cols = cols.clamp(max=req_to_token.shape[1] - 1)
    slots = req_to_token[req_pool_indices.long()][:, cols]  # (B, pages)
    return torch.div(slots, page_size, rounding_mode="floor").to(torch.int32)


def mask_indptrs(
    prefix_lens: Tensor, n: int, mask_numel: int, mode: str, kv_indptr: Tensor, mask_indptr: Tensor
) -> None:
    """``kv_indptr`` (int32) and ``mask_indptr`` (int64), ``(B+1,)``, of SGLang's mask layout
    ``mode``, written in place from ``prefix_lens (B,)`` (padding requests 0).

    A graph replay may pad the batch past the requests the mask was built for: each request's
    start is clamped so its ``N * (P + N)`` bytes stay inside the mask (real requests already do;
    padding rows' output is never used).
    """
    plen = prefix_lens.long() if mode == FULL_MASK else torch.zeros_like(prefix_lens).long()
    kv_indptr[0] = 0
    kv_indptr[1:].copy_(torch.cumsum(plen, 0))
    size = n * (plen + n)  # (B,) mask bytes per request
    mask_indptr[0] = 0
    mask_indptr[1:].copy_(torch.cumsum(size, 0))
    mask_indptr[:-1] = torch.minimum(mask_indptr[:-1], (mask_numel - size).clamp(min=0))


def _bits_on_gpu(plan, custom_mask: Tensor, n: int, mode: str) -> bool:
    """The mask conversion as one CUDA kernel (kernels/cuda's SGLang byte-mask converter) writing
    straight into ``plan.tree_mask``; False where that kernel is not available (CPU, no NVRTC).

    The torch path materialises (B, N, N) int64 index and bit tensors (~270 MB at B=32,
    N=1025); this reads each mask byte once. Needs ``plan.prefix_lens``/``qo_indptr`` filled.
    """
    if not custom_mask.is_cuda:
        return False
    try:
        from treeverify.kernels.cuda.launch import load
        from treeverify.kernels.cuda.variants import MaskVariant

        kernel = load(MaskVariant(), custom_mask.device)
    except Exception:  # no cuda extra / NVRTC here: the torch path serves
        return False
    bufs = getattr(plan, "_sglang_indptrs", None)
    if bufs is None:  # (kv_indptr int32, mask_indptr int64), fixed per plan
        m = plan.max_batch + 1
        bufs = plan._sglang_indptrs = (
            torch.zeros(m, dtype=torch.int32, device=plan.prefix_lens.device),
            torch.zeros(m, dtype=torch.int64, device=plan.prefix_lens.device),
        )
    kv_indptr, mask_indptr = bufs
    mask_indptrs(plan.prefix_lens, n, custom_mask.numel(), mode, kv_indptr, mask_indptr)
    mask = custom_mask.view(torch.uint8) if custom_mask.dtype == torch.bool else custom_mask
    args = [
        ctypes.c_void_p(mask.data_ptr()), ctypes.c_void_p(mask_indptr.data_ptr()),
        ctypes.c_void_p(plan.qo_indptr.data_ptr()), ctypes.c_void_p(kv_indptr.data_ptr()),
        ctypes.c_void_p(plan.tree_mask.data_ptr()), ctypes.c_int(plan.max_batch),
        ctypes.c_int(plan.tree_mask.shape[1]), ctypes.c_int(plan.tree_mask.shape[0]),
    ]  # fmt: skip
    stream = torch.cuda.current_stream(custom_mask.device).cuda_stream
    kernel.launch((plan.tree_mask.shape[0], 1, 1), args, stream)
    return True


def fill_verify_metadata(
    plan,
    *,
    req_to_token: Tensor,  # (R, C) int32 slot ids
    req_pool_indices: Tensor,  # (B,)
    seq_lens: Tensor,  # (B,) prefix lengths P_b (draft tokens excluded)
    custom_mask: Tensor,  # flat, `mask_mode` layout
    n: int,  # draft tokens per request (tree nodes, root included)
    page_size: int,
    mask_mode: str = FULL_MASK,
    out_cache_loc: Tensor | None = None,  # (B*N,) the draft tokens' slots
) -> None:
    """Write one verify step's metadata into ``plan``'s fixed buffers (device ops only).

    Requests ``B..max_batch-1`` of the plan become empty (no tree, no prefix), so a plan sized for
    a larger bucket serves a smaller batch.
    """
    bsz = req_pool_indices.shape[0]
    if bsz > plan.max_batch:
        raise ValueError(f"req_pool_indices: batch {bsz} exceeds the plan's max_batch")
    if n > plan.max_tree:
        raise ValueError(f"n: {n} draft tokens exceed the plan's max_tree {plan.max_tree}")
    if page_size != plan.page_size:
        raise ValueError(f"page_size: {page_size} differs from the plan's {plan.page_size}")
    total = bsz * n
    pages = plan.block_table.shape[1]
    plan.block_table[:bsz].copy_(
        block_table_from_req_to_token(req_to_token, req_pool_indices, page_size, pages)
    )
    plan.block_table[bsz:].zero_()
    if out_cache_loc is not None and out_cache_loc.numel() == total:
        # The draft tokens' pages from their own slots, so the table does not depend on SGLang
        # having written them into req_to_token before this hook (it does for EAGLE; the same
        # values then). Position P_b + i lies on page (P_b + i) // page_size.
        pos = seq_lens.long().view(bsz, 1) + torch.arange(n, device=seq_lens.device)  # (B, N)
        col = (pos // page_size).clamp(max=pages - 1)
        page = torch.div(out_cache_loc.view(bsz, n), page_size, rounding_mode="floor")
        plan.block_table[:bsz].scatter_(1, col, page.to(torch.int32))
    plan.prefix_lens[:bsz].copy_(seq_lens)
    plan.prefix_lens[bsz:].zero_()
    step = torch.arange(plan.qo_indptr.shape[0], device=plan.qo_indptr.device) * n
    plan.qo_indptr.copy_(step.clamp(max=total))  # (max_batch+1,): padding requests are empty
    if not _bits_on_gpu(plan, custom_mask, n, mask_mode):
        bits = sglang_mask_to_bits(custom_mask, seq_lens, n, mask_mode)  # (B*N, W)
        plan.tree_mask.zero_()
        plan.tree_mask[:total, : bits.shape[1]].copy_(bits)
    plan.batch = bsz  # host bookkeeping for the torch backend
