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
def _step(s, a_prev, a_cur, row, r, K, mask):
    """One heap sibling step for rank ``r`` (a no-op past ``K``)."""
    live = (tl.zeros_like(s) + r) < K  # broadcast the scalar test over the block
    s_next = (s - a_prev) + a_cur
    tl.store(row + r, s_next, mask=mask & live)
    return tl.where(live, s_next, s), tl.where(r < K, a_cur, a_prev)


@triton.jit
def _sibling_chain_kernel(prev_ptr, a_ptr, out_ptr, W, K, KP, BLOCK_W: tl.constexpr):
    b = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    mask = offs < W
    s = tl.load(prev_ptr + b * W + offs, mask=mask, other=0.0)
    a_row = a_ptr + b * KP  # padded to a multiple of 4 past K: loads need no mask
    a_prev = tl.load(a_row)
    s = s + a_prev
    row = out_ptr + (b * W + offs).to(tl.int64) * K
    tl.store(row, s, mask=mask)
    # Four ranks per trip: their log-probs are loaded together, off the dependency chain.
    for r in range(1, K, 4):
        a1 = tl.load(a_row + r)
        a2 = tl.load(a_row + r + 1)
        a3 = tl.load(a_row + r + 2)
        a4 = tl.load(a_row + r + 3)
        s, a_prev = _step(s, a_prev, a1, row, r, K, mask)
        s, a_prev = _step(s, a_prev, a2, row, r + 1, K, mask)
        s, a_prev = _step(s, a_prev, a3, row, r + 2, K, mask)
        s, a_prev = _step(s, a_prev, a4, row, r + 3, K, mask)


def sibling_chain_triton(prev_score: Tensor, a: Tensor) -> Tensor:
    """``prev_score (B, W)`` fp32, ``a (B, K)`` fp32 -> ``(B, W, K)`` fp32 chain values."""
    bsz, w = prev_score.shape
    k = a.shape[1]
    prev_score = prev_score.contiguous()
    kp = k + 4  # room for the unrolled loop's last loads
    a_pad = torch.zeros(bsz, kp, dtype=torch.float32, device=a.device)
    a_pad[:, :k] = a
    out = torch.empty(bsz, w, k, dtype=torch.float32, device=prev_score.device)
    block = 128 if w >= 128 else max(16, triton.next_power_of_2(w))
    grid = (bsz, triton.cdiv(w, block))
    _sibling_chain_kernel[grid](prev_score, a_pad, out, w, k, kp, BLOCK_W=block)
    return out
