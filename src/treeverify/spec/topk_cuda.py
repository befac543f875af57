"""DDTree's draft table for small k as one CUDA launch (kernels/cuda/ddtree_topk.cu).

`draft_topk` (tree.py) is fp32 log_softmax + torch.topk; on the H200 torch's radix select took
49 us for 15 rows of 8192 and k = 16, the largest single kernel of a whole round after the target
forward's. The kernel computes the same table in one CTA per row: the row's max and log-sum-exp,
then the k best entries by a threshold (the k-th best of the 256 threads' best entries: every
entry at or before it is gathered and ranked among them; k block-wide rounds for a row with a
NaN, or with more such entries than shared memory holds, which k <= MAX_K rules out up to 8192).
Three passes over each row from memory (k rounds' rescans took 1.65 ms for 15 rows of Llama 3's
128256 on the H100; rows up to 8192 held in registers were slower at every k: 10.5 against
7.4 us at k = 16). Ties rank the smaller token id first. Capture-safe: no host sync.
bf16 logits (the DFlash drafter's lm_head output on CUDA) are read as they are, each entry
widened exactly: the same table as from their fp32 upcast, without that copy (one launch and
15 x V x 6 bytes a request: ~2-3 us of a b=1 round at V = 8192, more at larger vocabularies);
other dtypes are upcast first.

With TREEVERIFY_DDTREE_WARP_TOPK=1 (vocabularies <= 8192) the same table by warps first:
each warp's k best by shuffle-only rounds, then warp 0 over the 8 x k candidates
(`ddtree_topk_warp`): no block barrier a round (an A/B variant: refuted in the forty-eighth
session against the block-wide rounds that `ddtree_topk` has since replaced).
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

MAX_K = 32  # beyond, torch.topk: the gathering's bound (k x 32 entries up to V = 8192) grows
MAX_VOCAB = 2**31 - 4096  # ddtree_topk's int indices (a pass steps 2048 entries past V)
# ddtree_topk_warp (TREEVERIFY_DDTREE_WARP_TOPK): rows held in registers, 256 threads x 32
WARP_MAX_VOCAB = 8192


def usable(draft_logits: Tensor, k: int) -> bool:
    """CUDA tensors, cuda-python present, k and the vocabulary within the kernel's bounds."""
    from .tree_heap import available

    return (draft_logits.is_cuda and 1 <= k <= MAX_K and draft_logits.shape[-1] <= MAX_VOCAB
            and available(draft_logits.device))  # fmt: skip


def draft_topk_cuda(draft_logits: Tensor, k: int, floor: float) -> tuple[Tensor, Tensor]:
    """(B, L, V) fp32 or bf16 logits (others upcast) -> (lp (B, L, k) fp32 sorted
    descending, clamped to [floor, 0], ids (B, L, k) int64): `draft_topk`'s table."""
    from treeverify import env
    from treeverify.kernels.cuda.launch import load
    from treeverify.kernels.cuda.variants import DDTreeTopkVariant, DDTreeTopkWarpVariant

    bsz, n_depth, vocab = draft_logits.shape
    if vocab > MAX_VOCAB:  # the kernel's int indices run a few thousand past V
        raise ValueError(f"draft_logits: a vocabulary of at most {MAX_VOCAB}, got {vocab}")
    if not 1 <= k <= min(MAX_K, vocab):
        raise ValueError(f"k: expected 1..{min(MAX_K, vocab)}, got {k}")
    dev = draft_logits.device
    bf16 = draft_logits.dtype == torch.bfloat16  # read as is: exact, no upcast copy
    x = (draft_logits if bf16 else draft_logits.float()).contiguous()  # (B, L, V)
    lp = torch.empty(bsz, n_depth, k, dtype=torch.float32, device=dev)
    ids = torch.empty(bsz, n_depth, k, dtype=torch.int64, device=dev)
    rows = bsz * n_depth
    if rows:
        warp = env.ddtree_warp_topk() and vocab <= WARP_MAX_VOCAB  # read when captured
        dtype = "bf16" if bf16 else "fp32"
        kernel = load(DDTreeTopkWarpVariant(dtype) if warp else DDTreeTopkVariant(dtype), dev)
        ptr = ctypes.c_void_p
        args = [ptr(x.data_ptr()), ctypes.c_int(vocab), ctypes.c_int(k), ctypes.c_float(floor),
                ptr(lp.data_ptr()), ptr(ids.data_ptr())]  # fmt: skip
        with torch.cuda.device(dev):
            kernel.launch((rows, 1, 1), args, torch.cuda.current_stream(dev).cuda_stream)
    return lp, ids
