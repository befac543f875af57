"""A pre-norm layer's residual add and RMSNorm made on the load of the projection after them
(TREEVERIFY_NORM_LINEAR): `add_norm_linear(x, residual, norm, weight)` is
`linear(add_rmsnorm(x, residual, norm))`, one kernel where the decode GEMV or the few-row kernel
takes the projection.

Why: a Llama layer runs two adds + norms (before qkv and before gate|up), each a Triton kernel
of its own between two linear kernels: tiny-code's decode and verify forwards launch 17 of them
(the forty-sixth session's kernel lists), each on the critical path (its row must be read,
reduced and written before the projection reads it; PDL overlaps only the projection's weight
loads; the lists' ~2.5-6 us a norm include that overlap, so the saving was estimated at
~1.5-2 us a norm and measured at 10.5 us a tiny-code decode forward by the first version).
Each CTA of the projection reads every column of its rows anyway,
so it can add the residual, sum the squares and scale by gamma itself (NORM instances of
decode_gemv.cu / skinny_gemm.cu; linear_common.cuh NormArgs, norm_stage), and scale its sums by
the row's 1 / rms at the end: rstd * sum_k (s_k gamma_k) w_k. CTA 0 writes the residual stream's
sum (and a drafter's tap), which the next add reads.

Rounding: the unfused path feeds the product round(s_k * rstd * gamma_k); the fused one
round(s_k * gamma_k), scaling after the sum: the same bf16 error class, not the same bits
(tests/test_norm_linear_gpu.py bounds the difference). Everywhere the fused kernel does not apply
(the CPU, rows past 32, a weight past the kernels' caps, fp32, odd strides) it is the two steps,
bit for bit the path without the switch.

    models/llama.py: with the switch on, a fused model's layers take (m, residual) un-normed and
    fold both norms into qkv and gate|up (`fold_norms`); the final norm stays add_rmsnorm (the
    lm_head is also a drafter's, over the drafter's own norm). spec/dflash.py: the drafter's
    layers the same way on its ring draft (`forward_ring_folded`; its 16-row blocks on the
    few-row kernel's norm instance).

The kernels stage the rows' normalized inputs once a CTA in shared memory (linear_common.cuh
`norm_stage`; `gemv.norm_smem_bytes`); rows past NORM_SMEM_MAX_BYTES take the two steps. The
first version made the input in every warp's loop: the few-row call ~6 us against ~3.3 plain,
the 1B's b=1 decode forward x0.951 (H200, 61224e3); the staged one is not yet measured.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch

from treeverify.models import gemv
from treeverify.models.fused_ops import add_rmsnorm, rmsnorm, tap_columns


def _aligned_rows(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0


def fused_kernel(x: torch.Tensor, residual: torch.Tensor | None, norm, weight: torch.Tensor,
                 bias: torch.Tensor | None = None, tap: torch.Tensor | None = None):  # fmt: skip
    """The linear kernel (`gemv.gemv` / `gemv.skinny`) that takes this add + norm + projection
    on its load, or None (then the two steps). (Whether to fold at all is the model's choice,
    TREEVERIFY_NORM_LINEAR read once when it is fused for inference: its `fold_norms`.)"""
    kernel = gemv._route(x, weight, bias)
    # bf16 only: the kernel rounds s * gamma before the 1 / rms, which fp16's range can overflow
    # (|s * gamma| > 65504) where the two steps, scaling first, stay finite
    if kernel is None or x.dtype != torch.bfloat16:
        return None
    if gemv.norm_smem_bytes(x.shape[0], x.shape[1]) > gemv.NORM_SMEM_MAX_BYTES:
        return None  # the rows' inputs would not fit the CTA's shared memory
    g = norm.weight
    if not (g.dtype == x.dtype and g.device == x.device and g.shape == (x.shape[1],)
            and g.is_contiguous() and g.data_ptr() % 16 == 0 and not g.requires_grad):  # fmt: skip
        return None
    if residual is not None and not (residual.shape == x.shape and residual.dtype == x.dtype
                                     and residual.device == x.device
                                     and residual.is_contiguous()
                                     and residual.data_ptr() % 16 == 0):  # fmt: skip
        return None
    if tap is not None and not (tap.shape == x.shape and tap.dtype == x.dtype
                                and tap.device == x.device and _aligned_rows(tap)):  # fmt: skip
        return None
    return kernel


def add_norm_linear(
    x: torch.Tensor,  # (M, K) what the previous sublayer adds (or, with no residual, the input)
    residual: torch.Tensor | None,  # (M, K) the residual stream, or None: norm x itself
    norm,  # an RMSNorm module (weight (K,), eps)
    weight: torch.Tensor,  # (N, K)
    bias: torch.Tensor | None = None,  # (N,)
    tap: torch.Tensor | None = None,  # (M, K), rows may be strided: residual + x copied here too
) -> tuple[torch.Tensor, torch.Tensor]:  # linear(norm(residual + x)) (M, N), residual + x (M, K)
    """(linear(norm(residual + x), weight, bias), residual + x); with residual None
    (linear(norm(x)), x). One kernel where `fused_kernel` finds one, else add_rmsnorm (or
    rmsnorm) and `gemv.linear`."""
    if tap is not None and residual is None:
        raise ValueError("tap: a tap copies the residual add's sum; give a residual too")
    kernel = fused_kernel(x, residual, norm, weight, bias, tap)
    if kernel is None:
        if residual is None:
            return gemv.linear(rmsnorm(x, norm), weight, bias), x
        h, summed = add_rmsnorm(x, residual, norm, tap)
        return gemv.linear(h, weight, bias), summed
    r_out = torch.empty_like(x) if residual is not None else None
    operands = gemv.NormOperands(residual, r_out, tap, norm.weight, float(norm.eps))
    y = kernel(x, weight, bias, norm=operands)
    return y, (r_out if r_out is not None else x)


def folded_residual_stream(
    x: torch.Tensor,  # (T, H) the embedded tokens
    layers,  # pre-norm layers
    final_norm,  # the RMSNorm after the last layer
    body: Callable[
        [int, Any, torch.Tensor, torch.Tensor | None, torch.Tensor | None],
        tuple[torch.Tensor, torch.Tensor],
    ],
    taps: Collection[int] = (),
) -> tuple[torch.Tensor, torch.Tensor | None]:  # final-normed (T, H), tapped (T, len(taps) * H)
    """fused_ops.residual_stream with each layer's input norm made by the layer itself, on its
    first projection's load: (m, residual) = body(i, layer, m, residual, tap), from (x, None);
    the add at layer i's start makes layer i - 1's output, so it takes that layer's tap. The
    final norm is add_rmsnorm's, with the last layer's tap."""
    tapped, cols = tap_columns(x, len(layers), taps)
    m, residual = x, None
    for i, layer in enumerate(layers):
        m, residual = body(i, layer, m, residual, cols.get(i - 1))
    h, _ = add_rmsnorm(m, residual, final_norm, cols.get(len(layers) - 1))
    return h, tapped
