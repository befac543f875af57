"""Fused elementwise ops for the decode path: one Triton kernel where PyTorch launches 2-5.

Inside a captured decode step every kernel costs ~2-3 us of launch latency on the GPU whatever
its size (docs/performance.md: a 1B-shape forward was 336 kernels, ~250 of them tiny). These
fuse the per-layer chains:

  add_rmsnorm(x, residual, norm)  residual + x, then RMSNorm      (2 kernels -> 1)
  rmsnorm(x, norm)                RMSNorm of a strided view, by the same kernel
                                                                   (copy + norm -> 1)
  residual_stream(x, layers, final_norm, body)
                                  a pre-norm decoder's adds fused into the next norms (Llama,
                                  DeepSeek-V3 and the DFlash drafter run their layers by it)
  rope_qk(qkv, cos2, sin2, hq, hkv) q and k rotated, q contiguous  (5 kernels -> 1)
  silu_mul(gate_up)               silu(gate) * up                  (2 kernels -> 1)
  rope_qk_store(qkv, ..., slots, k_cache, v_cache)
                                  rope_qk + the step's K/V written to their cache slots
                                  (engine/kv_store.py's kernel)    (2 kernels -> 1; the same
                                  Triton kernel as rope_qk's, STORE specialised)
  rope_rows(cos_table, sin_table, positions)
                                  a forward's rotate-half tables read from Rope.tabulate's at
                                  its positions                   (~10 kernels -> 1; a copy)

Each rounds to the activation dtype where the PyTorch sequence it replaces rounds, so results
match the unfused ops to the last bit of a bf16 value (the residual add exactly; measured on the
H200 in tests/test_fused_ops_gpu.py). Eager and captured steps on a GPU both run these, so CUDA
graphs on or off still give identical tokens. The Triton path runs for CUDA tensors when Triton
imports; anything else (the CPU, fp32 tests) runs the PyTorch ops.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.nn.functional as F

from treeverify.models import pdl


@functools.cache
def _triton():
    try:
        import triton  # noqa: F401
        import triton.language as tl  # noqa: F401
    except ImportError:
        return None
    return _build_kernels()


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and _triton() is not None


def _build_kernels():
    import triton
    import triton.language as tl

    gdc_wait, gdc_launch_dependents = pdl.gdc()  # PDL's two calls (models/pdl.py)

    @triton.jit
    def add_rmsnorm_kernel(X, R, W, Y, ROut, n, x_row, eps, Tap, tap_row, BLOCK: tl.constexpr,
                           HAS_RES: tl.constexpr, PDL: tl.constexpr,
                           HAS_TAP: tl.constexpr = False):  # fmt: skip
        # HAS_RES: Y = norm(X + R), ROut = X + R; else Y = norm(X) (X rows x_row apart).
        # HAS_TAP (with HAS_RES): X + R also to Tap's row (rows tap_row apart: a drafter's
        # layer columns of the forward's captured rows, in place of a torch.cat after it).
        # PDL (models/pdl.py): wait for the kernel before (a no-op unless launched by PDL), then
        # let the next start (a decode GEMV loads its weights while this kernel runs).
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < n
        x = tl.load(X + row * x_row + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(R + row * n + cols, mask=m, other=0.0).to(tl.float32)
            s = (x + r).to(ROut.dtype.element_ty)  # the residual add rounds, as torch's does
            tl.store(ROut + row * n + cols, s, mask=m)
            if HAS_TAP:
                tl.store(Tap + row * tap_row + cols, s, mask=m)
            sf = s.to(tl.float32)
        else:
            sf = x
        rstd = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / n + eps)
        w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(Y + row * n + cols, (sf * rstd * w).to(Y.dtype.element_ty), mask=m)

    @triton.jit
    def rmsnorm_pair_kernel(X, W1, W2, Y1, Y2, n1, n2, x_row, eps1, eps2, BLOCK: tl.constexpr,
                            PDL: tl.constexpr):  # fmt: skip
        # Program (row, seg): seg 0 norms X[row, :n1] by W1 into Y1, seg 1 X[row, n1:n1+n2] by
        # W2 into Y2; add_rmsnorm_kernel's arithmetic (HAS_RES off) on each segment.
        if PDL:  # as in add_rmsnorm_kernel
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        first = tl.program_id(1) == 0
        n = tl.where(first, n1, n2)
        cols = tl.arange(0, BLOCK)
        m = cols < n
        m1 = cols < tl.where(first, n, 0)  # this segment's columns, where it is the first
        m2 = cols < tl.where(first, 0, n)
        x = tl.load(X + row * x_row + tl.where(first, 0, n1) + cols, mask=m, other=0.0)
        sf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / n + tl.where(first, eps1, eps2))
        w = tl.load(W1 + cols, mask=m1, other=0.0).to(tl.float32) + tl.load(
            W2 + cols, mask=m2, other=0.0).to(tl.float32)  # fmt: skip
        y = (sf * rstd * w).to(Y1.dtype.element_ty)
        tl.store(Y1 + row * n1 + cols, y, mask=m1)
        tl.store(Y2 + row * n2 + cols, y, mask=m2)

    @triton.jit
    def rope_qk_kernel(QKV, C, S, Q, K, Slots, VC, hq, hkv, D: tl.constexpr,
                       HALF: tl.constexpr, STORE: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
        # Program (t, h): head h of token t. STORE: k goes to its cache slot (K is the cache)
        # and heads past q and k copy v to VC's slot (rope_qk_store); else k to K's row t.
        if PDL:  # as in add_rmsnorm_kernel
            gdc_wait()
            gdc_launch_dependents()
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        d = tl.arange(0, D)
        width = (hq + 2 * hkv) * D
        src = QKV + t * width + h * D
        row = t
        if STORE:
            row = tl.load(Slots + t).to(tl.int64)
        if h < hq + hkv:
            x = tl.load(src + d).to(tl.float32)
            swapped = tl.load(src + (d + HALF) % D).to(tl.float32)
            c = tl.load(C + t * D + d).to(tl.float32)
            s = tl.load(S + t * D + d).to(tl.float32)
            dt = Q.dtype.element_ty
            # x*cos and swap(x)*sin each round, then their sum: torch's three ops on bf16
            out = ((x * c).to(dt).to(tl.float32) + (swapped * s).to(dt).to(tl.float32)).to(dt)
            if h < hq:
                tl.store(Q + (t * hq + h) * D + d, out)
            else:  # a cache's flat (slots, Hkv, D) view, as store_kv writes it, or k (T, Hkv, D)
                tl.store(K + (row * hkv + (h - hq)) * D + d, out)
        else:  # v (STORE grids only): copied
            tl.store(VC + (row * hkv + (h - hq - hkv)) * D + d, tl.load(src + d))

    @triton.jit
    def silu_mul_kernel(GU, Y, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # as in add_rmsnorm_kernel: the down GEMV may start loading its weights
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < n
        g = tl.load(GU + row * 2 * n + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(GU + row * 2 * n + n + cols, mask=m, other=0.0).to(tl.float32)
        dt = Y.dtype.element_ty
        a = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # silu rounds, then the product
        tl.store(Y + row * n + cols, (a * u).to(dt), mask=m)

    @triton.jit
    def rope_rows_kernel(POS, TC, TS, C, S, limit, D: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):  # fmt: skip
        # Program t: the rows of the (limit, D) tables at position POS[t], copied (clamped to
        # the table: the engine's positions stay inside it, see Rope.tabulate).
        if PDL:  # as in add_rmsnorm_kernel: the positions come from the step's copy
            gdc_wait()
            gdc_launch_dependents()
        t = tl.program_id(0).to(tl.int64)
        p = tl.minimum(tl.maximum(tl.load(POS + t).to(tl.int64), 0), limit - 1)
        d = tl.arange(0, BLOCK)
        m = d < D
        tl.store(C + t * D + d, tl.load(TC + p * D + d, mask=m), mask=m)
        tl.store(S + t * D + d, tl.load(TS + p * D + d, mask=m), mask=m)

    return (add_rmsnorm_kernel, rope_qk_kernel, silu_mul_kernel, rmsnorm_pair_kernel,
            rope_rows_kernel)  # fmt: skip


def add_rmsnorm(
    x: torch.Tensor,  # (T, H)
    residual: torch.Tensor,  # (T, H)
    norm,  # an RMSNorm module (weight (H,), eps)
    tap: torch.Tensor | None = None,  # (T, H), rows may be strided: residual + x copied here too
) -> tuple[torch.Tensor, torch.Tensor]:  # normed (T, H), residual + x (T, H)
    if not (_use_triton(x) and norm.weight.dtype == x.dtype and x.is_contiguous()
            and residual.is_contiguous()
            and (tap is None or (tap.dtype == x.dtype and tap.stride(1) == 1))):  # fmt: skip
        summed = residual + x
        if tap is not None:
            tap.copy_(summed)
        return norm(summed), summed
    r_out = torch.empty_like(x)
    return _launch_norm(x, residual, r_out, norm, tap), r_out


def rmsnorm(
    x: torch.Tensor,  # (T, H); rows may be strided (a view into a wider projection)
    norm,  # an RMSNorm module (weight (H,), eps)
) -> torch.Tensor:  # (T, H) contiguous
    """norm(x) by add_rmsnorm's kernel without the residual: one launch, and a strided x read in
    place (PyTorch's norm of a strided view copies it first: a second launch)."""
    if not (_use_triton(x) and norm.weight.dtype == x.dtype and x.dim() == 2
            and x.stride(1) == 1):  # fmt: skip
        return norm(x)
    return _launch_norm(x, None, None, norm)


def rmsnorm_pair(
    x: torch.Tensor,  # (T, >= H1 + H2); rows may be strided, columns contiguous
    norm1,  # an RMSNorm module of H1 = norm1.weight.numel() columns
    norm2,  # an RMSNorm module of H2 columns
) -> tuple[torch.Tensor, torch.Tensor]:  # norm1(x[:, :H1]) (T, H1), norm2(x[:, H1:H1+H2]) (T, H2)
    """Two RMSNorms of one row's adjacent column ranges in one launch on a GPU (MLA's q_a and
    kv_a norms of the fused a-projection, models/deepseek_v3.py): outputs contiguous."""
    n1, n2 = norm1.weight.numel(), norm2.weight.numel()
    if not (_use_triton(x) and x.dim() == 2 and x.stride(1) == 1 and x.shape[1] >= n1 + n2
            and norm1.weight.dtype == norm2.weight.dtype == x.dtype):  # fmt: skip
        return norm1(x[:, :n1]), norm2(x[:, n1 : n1 + n2])
    import triton

    t = x.shape[0]
    y1, y2 = x.new_empty(t, n1), x.new_empty(t, n2)
    if t:
        _triton()[3][(t, 2)](x, norm1.weight, norm2.weight, y1, y2, n1, n2, x.stride(0),
                             norm1.eps, norm2.eps, BLOCK=triton.next_power_of_2(max(n1, n2)),
                             **pdl.flags(x), num_warps=4)  # fmt: skip
    return y1, y2


def _launch_norm(x, residual, r_out, norm, tap=None) -> torch.Tensor:
    """add_rmsnorm_kernel's launch: norm(x + residual) with the sum to r_out (and to `tap`'s
    rows, strided, when given), or with residual None norm(x) (x's rows may be strided);
    returns the normed rows, contiguous."""
    import triton

    t, n = x.shape
    y = x.new_empty(t, n)
    has_res = residual is not None
    has_tap = has_res and tap is not None
    tap, tap_row = (tap, tap.stride(0)) if has_tap else (y, 0)
    _triton()[0][(t,)](x, residual if has_res else x, norm.weight, y, r_out if has_res else y, n,
                       x.stride(0), norm.eps, tap, tap_row,
                       BLOCK=triton.next_power_of_2(n), HAS_RES=has_res, HAS_TAP=has_tap,
                       **pdl.flags(x), num_warps=4)  # fmt: skip
    return y


def tap_columns(
    x: torch.Tensor,  # (T, H)
    layers: int,
    taps: Collection[int],
) -> tuple[torch.Tensor | None, dict[int, torch.Tensor]]:
    """The forward's tapped rows (T, len(taps) * H), or None without taps, and each tapped
    layer's columns of them (T, H), rows len(taps) * H apart, in layer order."""
    order = sorted(set(taps))  # the columns follow the layers' order
    if order and not 0 <= order[0] <= order[-1] < layers:
        raise ValueError(f"taps: expected layer indices in [0, {layers}), got {order}")
    hidden = x.shape[-1]
    tapped = x.new_empty(x.shape[0], len(order) * hidden) if order else None  # (T, k * H)
    return tapped, {i: tapped[:, j * hidden : (j + 1) * hidden] for j, i in enumerate(order)}


def residual_stream(
    x: torch.Tensor,  # (T, H) the embedded tokens
    layers,  # pre-norm layers, each with an `input_layernorm`
    final_norm,  # the RMSNorm after the last layer
    body: Callable[[int, Any, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    taps: Collection[int] = (),
) -> tuple[torch.Tensor, torch.Tensor | None]:  # final-normed (T, H), tapped (T, len(taps) * H)
    """A pre-norm decoder's residual stream with each add fused into the next norm:
    h = norm_0(x); per layer i, (m, residual) = body(i, layer, h, residual) (m: what the layer
    adds after its own fused post-attention add), then h, residual = add_rmsnorm(m, residual,
    norm_{i+1} or final_norm). Returns the final norm's output and the layers in `taps` side by
    side, in layer order: each one's output (the residual after its add), written into its
    columns by the add's own kernel (a torch.cat after the forward was one more kernel of every
    DFlash engine's step: ~2-3 us of a ~180 us plain step on the H100); None without taps."""
    tapped, cols = tap_columns(x, len(layers), taps)
    residual, h = x, rmsnorm(x, layers[0].input_layernorm)
    for i, layer in enumerate(layers):
        m, residual = body(i, layer, h, residual)
        nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else final_norm
        h, residual = add_rmsnorm(m, residual, nxt, cols.get(i))  # residual = layer i's output
    return h, tapped


def rope_qk(
    qkv: torch.Tensor,  # (T, Hq + 2 Hkv, D) the fused projection's output
    cos2: torch.Tensor,  # (T, D) Rope.rotate_half_tables
    sin2: torch.Tensor,  # (T, D)
    hq: int,
    hkv: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # q (T, Hq, D) contiguous, k (T, Hkv, D)
    t, _, d = qkv.shape
    if not _rope_fits(qkv, cos2, sin2):
        from treeverify.models.layers import apply_rope_tables

        qk = apply_rope_tables(qkv[:, : hq + hkv], cos2, sin2)  # (T, Hq+Hkv, D)
        return qk[:, :hq].contiguous(), qk[:, hq:]
    k = qkv.new_empty(t, hkv, d)
    return _launch_rope(qkv, cos2, sin2, hq, hkv, k), k


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # (..., 2I) -> (..., I)
    if not (_use_triton(gate_up) and gate_up.is_contiguous()):
        g, u = gate_up.chunk(2, dim=-1)
        return F.silu(g) * u
    kernel = _triton()[2]
    lead, n2 = gate_up.shape[:-1], gate_up.shape[-1]  # any leading dims: (..., 2I)
    t, n = gate_up.numel() // n2, n2 // 2
    y = gate_up.new_empty(*lead, n)
    block = 1024
    kernel[(t, (n + block - 1) // block)](gate_up, y, n, BLOCK=block, **pdl.flags(gate_up),
                                          num_warps=4)  # fmt: skip
    return y


def rope_qk_store(
    qkv: torch.Tensor,  # (T, Hq + 2 Hkv, D) the fused projection's output
    cos2: torch.Tensor,  # (T, D) Rope.rotate_half_tables
    sin2: torch.Tensor,  # (T, D)
    hq: int,
    hkv: int,
    slots: torch.Tensor,  # (T,) int64 cache slot of each token
    k_cache: torch.Tensor,  # (pages, page_size, Hkv, D)
    v_cache: torch.Tensor,  # same shape
) -> torch.Tensor | None:  # q (T, Hq, D) contiguous
    """rope_qk whose k (rotated) and v go straight to their cache slots, as store_kv writes
    them, in the same kernel: one launch a layer fewer. None where it does not apply (the CPU,
    fp32, a non-contiguous operand, a cache of another dtype or row shape): the caller then
    runs rope_qk and the cache write."""
    t, _, d = qkv.shape
    fits = (
        _rope_fits(qkv, cos2, sin2) and k_cache.dtype == qkv.dtype and v_cache.dtype == qkv.dtype
        and k_cache.shape == v_cache.shape and tuple(k_cache.shape[-2:]) == (hkv, d)
        and k_cache.is_contiguous() and v_cache.is_contiguous()
        and slots.shape == (t,) and slots.dtype == torch.int64 and slots.is_contiguous()
    )  # fmt: skip
    return _launch_rope(qkv, cos2, sin2, hq, hkv, k_cache, slots, v_cache) if fits else None


def _rope_fits(qkv: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> bool:
    """rope_qk_kernel takes these: a GPU 16-bit contiguous qkv, a power-of-two head size, tables
    of qkv's dtype."""
    d = qkv.shape[2]
    return (
        _use_triton(qkv) and qkv.is_contiguous() and d & (d - 1) == 0
        and cos2.dtype == qkv.dtype and sin2.dtype == qkv.dtype
    )  # fmt: skip


def rope_rows(
    cos_table: torch.Tensor,  # (L, D) Rope.tabulate's
    sin_table: torch.Tensor,  # (L, D)
    positions: torch.Tensor,  # (T,) int, on the tables' device
) -> tuple[torch.Tensor, torch.Tensor]:  # cos2, sin2 (T, D): the tables' rows at `positions`
    """Both tables' rows at `positions` by one kernel (Triton, CUDA) in place of the ~10 small
    kernels that compute them each forward (models/layers.py Rope.rotate_half_tables);
    elsewhere by index. Positions past the table read its last row (the engine never asks)."""
    t, (limit, d) = positions.shape[0], cos_table.shape
    if not (_use_triton(cos_table) and positions.is_cuda and cos_table.is_contiguous()
            and sin_table.is_contiguous()):  # fmt: skip
        idx = positions.long().clamp(0, limit - 1)
        return cos_table[idx], sin_table[idx]
    import triton

    positions = positions.contiguous()  # the kernel reads POS + t
    cos2, sin2 = cos_table.new_empty(t, d), sin_table.new_empty(t, d)
    if t:
        _triton()[4][(t,)](positions, cos_table, sin_table, cos2, sin2, limit, D=d,
                           BLOCK=triton.next_power_of_2(d), num_warps=1,
                           **pdl.flags(cos_table))  # fmt: skip
    return cos2, sin2


def _launch_rope(qkv, cos2, sin2, hq: int, hkv: int, k_out, slots=None, v_cache=None):
    """rope_qk_kernel's launch (tests run it on Triton's CPU interpreter): q (T, Hq, D) returned,
    k written to `k_out` (T, Hkv, D); with `slots`, k to those slots of the cache `k_out` and v
    to the same slots of `v_cache` (rope_qk_store)."""
    t, _, d = qkv.shape
    q = qkv.new_empty(t, hq, d)
    store = slots is not None
    heads = hq + (2 if store else 1) * hkv  # v's heads only when storing
    _triton()[1][(t, heads)](qkv, cos2.contiguous(), sin2.contiguous(), q, k_out,
                             slots if store else qkv, v_cache if store else qkv, hq, hkv, D=d,
                             HALF=d // 2, STORE=store, num_warps=1, **pdl.flags(qkv))  # fmt: skip
    return q
