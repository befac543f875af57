"""Linear layers for decode-sized batches: a Triton GEMV where cuBLAS leaves HBM bandwidth unused.

A batch-1 decode step reads every weight once for a handful of rows (M <= 4), so each linear
layer is a matrix-vector product bound by HBM bandwidth. On the H200 cuBLAS ran the 1B shape's
2-8 MB projections at ~50% of the bandwidth that the 64 MB gate|up GEMM reaches (~89%), and
`down` through split-K plus a reduce kernel at ~70% (docs/performance.md, "Decode against the
memory roofline"): with ~6 us a layer at stake on the 1B shape, a forward of ~1.2 ms.

`linear(x, weight, bias)` is F.linear except that CUDA bf16/fp16 inputs of at most
GEMV_MAX_ROWS rows run the GEMV kernel: every program streams BLOCK_N whole weight rows in
32 KB slices (one coalesced read of the weight, fp32 products summed once at the end) and
writes BLOCK_N outputs for each of the M rows. No split-K, no atomics: one deterministic order
per shape, the same eager and inside a CUDA graph. Anything else (the CPU, more rows, fp32,
a strided weight) is F.linear, as before; TREEVERIFY_DECODE_GEMV=0 turns it off.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

GEMV_MAX_ROWS = 4  # decode batches up to this many rows; verify/prefill tiles stay on cuBLAS
BLOCK_N = 8  # weight rows per program: 256 programs already for the 1B shape's N = 2048
# weight elements a program reads per slice (32 KB of bf16) and keeps as fp32 products per row
# of x: 16384 / M_PAD columns x 8 rows x M_PAD rows = 64 fp32 registers a thread (8 warps)
SLICE = 16384
NUM_WARPS = 8


@functools.cache
def _kernel():
    """The compiled-on-first-use kernel; None without Triton or with TREEVERIFY_DECODE_GEMV=0."""
    from treeverify import env

    if not env.decode_gemv():
        return None
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def gemv_kernel(X, W, B, Y, M, N, K, stride_x, stride_w, stride_y, HAS_BIAS: tl.constexpr,
                    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) output features
        rk = tl.arange(0, BLOCK_K)  # (BK,)
        rm = tl.arange(0, M_PAD)  # (M_PAD,) input rows
        n_ok = rn < N
        w_rows = W + rn.to(tl.int64)[:, None] * stride_w  # (BN, 1)
        x_rows = X + rm.to(tl.int64)[:, None] * stride_x  # (M_PAD, 1)
        acc = tl.zeros((M_PAD, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + rk) < K
            w = tl.load(w_rows + (k0 + rk)[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0)  # fmt: skip  # (BN, BK)
            x = tl.load(x_rows + (k0 + rk)[None, :], mask=(rm < M)[:, None] & k_ok[None, :],
                        other=0.0)  # fmt: skip  # (M_PAD, BK)
            acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        y = tl.sum(acc, axis=2)  # (M_PAD, BN)
        if HAS_BIAS:
            y += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out = Y + rm.to(tl.int64)[:, None] * stride_y + rn[None, :]
        tl.store(out, y.to(Y.dtype.element_ty), mask=(rm < M)[:, None] & n_ok[None, :])

    return gemv_kernel


def block_k(k: int, m_pad: int) -> int:
    """Weight columns per slice: SLICE / (BLOCK_N x M_PAD), or all of a shorter row."""
    return min(1 << max(k - 1, 1).bit_length(), SLICE // (BLOCK_N * m_pad))


def uses_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` runs the Triton GEMV for this input (see the module docstring)."""
    return (
        x.is_cuda
        and x.dim() == 2
        and x.shape[0] <= GEMV_MAX_ROWS
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and weight.stride(-1) == 1
        and x.stride(-1) == 1
        and _kernel() is not None
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): (M, K) x (N, K) -> (M, N), by the GEMV for decode-sized M."""
    if not uses_gemv(x, weight):
        return F.linear(x, weight, bias)
    return gemv(x, weight, bias)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The GEMV kernel itself, whatever the device (the CPU under TRITON_INTERPRET=1 in tests):
    x (M <= 4, K), weight (N, K) with unit column stride, bias (N,) or None -> (M, N)."""
    if x.shape[0] > GEMV_MAX_ROWS or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"x: expected (M <= {GEMV_MAX_ROWS}, {weight.shape[1]}), got {tuple(x.shape)}"
        )
    m, k = x.shape
    n = weight.shape[0]
    y = x.new_empty(m, n)
    m_pad = 1 if m == 1 else (2 if m == 2 else 4)
    _kernel()[(-(-n // BLOCK_N),)](
        x, weight, bias if bias is not None else weight, y, m, n, k,
        x.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=bias is not None,
        M_PAD=m_pad, BLOCK_N=BLOCK_N, BLOCK_K=block_k(k, m_pad), num_warps=NUM_WARPS,
    )  # fmt: skip
    return y


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state dict) whose forward is `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
