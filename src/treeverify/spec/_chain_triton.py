"""Fused sibling chain for ``build_tree`` on CUDA (Triton): one launch per depth.

Each program owns a block of parents of one request and runs the heap's fp32 operation sequence
``s_0 = parent + a[0]``, ``s_{r+1} = (s_r - a[r]) + a[r+1]`` in registers, storing every ``s_r``.
The additions are plain round-to-nearest fp32 ``add``/``sub`` (no multiply, so no FMA contraction;
no reassociation without fast-math), bit-identical to the PyTorch loop; the GPU tests check it.
Imported lazily: only when the inputs are on a CUDA device and Triton is installed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _sibling_chain_kernel(prev_ptr, a_ptr, out_ptr, W, K, BLOCK_W: tl.constexpr):
    b = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    mask = offs < W
    s = tl.load(prev_ptr + b * W + offs, mask=mask, other=0.0)
    a_prev = tl.load(a_ptr + b * K)
    s = s + a_prev
    row = out_ptr + (b * W + offs).to(tl.int64) * K
    tl.store(row, s, mask=mask)
    for r in range(1, K):
        a_cur = tl.load(a_ptr + b * K + r)
        s = (s - a_prev) + a_cur
        tl.store(row + r, s, mask=mask)
        a_prev = a_cur


def sibling_chain_triton(prev_score: Tensor, a: Tensor) -> Tensor:
    """``prev_score (B, W)`` fp32, ``a (B, K)`` fp32 -> ``(B, W, K)`` fp32 chain values."""
    bsz, w = prev_score.shape
    k = a.shape[1]
    prev_score = prev_score.contiguous()
    a = a.contiguous()
    out = torch.empty(bsz, w, k, dtype=torch.float32, device=prev_score.device)
    block = 128 if w >= 128 else max(16, triton.next_power_of_2(w))
    grid = (bsz, triton.cdiv(w, block))
    _sibling_chain_kernel[grid](prev_score, a, out, w, k, BLOCK_W=block)
    return out
