"""The routed experts of a decode-sized MoE batch as two expert-indexed GEMVs (issue 14).

At batch 1 a MoE layer's k routed (token, expert) pairs each multiply one token row by one
expert's weights: memory-bound matrix-vector products. The grouped-GEMM path (models/moe.py,
torch._grouped_mm) runs them as a CUTLASS grouped GEMM with one row per group, after sorting the
pairs (dispatch) and preparing the groups; on the H200 its two GEMMs took ~29 us a call for
random:mla-moe's 6 experts of 17 MB (~35% of HBM bandwidth), the dispatch 11 us and the group
preparation 3 us (scripts/profile_decode_gpu.py, 2026-12-04). Here, in pair order, no sort:

    gate_up  h[p] = W_gate_up[e_p] @ x[p // k]                  (P, 2I), programs (P, 2I / BN)
    down     y[p] = W_down[e_p] @ (silu(h[p, :I]) * h[p, I:])   (P, H), the activation on load
    combine  out[t] = sum_i w[t, i] y[t k + i] (+ shared[t])    fused_moe.combine, pair order
    counts   each pair's first gate_up program adds its token to its expert's running count
             (integer atomics, straight into the model's counter when given)

Each program reads BN weight rows of its pair's expert in BK-wide tiles, fp32 sums; the
activation rounds to the input's dtype before the product as fused_ops.silu_mul does. The sums'
order differs from the grouped GEMM's, so outputs match it within bf16 rounding, not bit for bit
(tests/test_moe_gemv_interpret.py on the CPU interpreter, tests/test_fused_moe_gpu.py on a GPU).

Measured on the H200 (docs/performance.md): with a first-guess tile (f00918d) ~25 us a GEMV call
at b=1 (~43% of HBM), the decode replay 1.426 -> 1.287 ms, the engine step 1.569 -> 1.523 ms; the
tile sweep (43b3363, scripts/moe_gemv_bench.py) then found 9-19 us a call (~3.6 TB/s, ~75% of
HBM) for the GATE_UP_TILE / DOWN_TILE below.

A pair reads its expert's weights whether or not another pair routed to the same expert, so this
pays only while pairs rarely share experts: batches of at most MAX_PAIRS pairs
(TREEVERIFY_MOE_GEMV, env.py: auto (default) up to AUTO_MAX_PAIRS, 1 up to MAX_PAIRS, 0 never).
"""

from __future__ import annotations

import functools

import torch

from treeverify.models import pdl

# (weight rows a program reads, columns a tile reads, warps), per GEMM: the fastest of 22 tiles
# on the H200 for random:mla-moe at 6 and 12 pairs, and near the best for a Kimi-sized expert
# (scripts/moe_gemv_bench.py, 43b3363, bench_results/2026-12-04-h200-43b3363-moe_gemv_bench.json):
# gate_up 32.4 -> 19.3 us, down 12.8 -> 9.2 us at 6 pairs against the first guess (32, 128, 4).
GATE_UP_TILE = (16, 128, 8)
DOWN_TILE = (16, 256, 8)
AUTO_MAX_PAIRS = 16  # "auto": decode of <= 2 requests at k = 6 (no expert read twice at b=1)
MAX_PAIRS = 512  # "1": an A/B bound, the fused dispatch's auto bound


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    gdc_wait, gdc_launch_dependents = pdl.gdc()  # PDL's two calls (models/pdl.py)

    @triton.jit
    def expert_gemv_kernel(X, Idx, W, Y, Counts, Valid, N, K, x_stride, k_sel, k_tot,
                           e_shared, ACT: tl.constexpr, COUNT: tl.constexpr,
                           HAS_VALID: tl.constexpr, SHARED: tl.constexpr, BN: tl.constexpr,
                           BK: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
        # Program (pair p, row block): Y[p, rows] = W[e_p, rows, :] @ x, where x is the pair's
        # token row X[p // k_tot] (gate_up) or, with ACT, silu(X[p, :K]) * X[p, K:] (down).
        # A token's pairs are its k_sel routed slots (experts from Idx) and, with SHARED, then
        # k_tot - k_sel shared-expert slots: experts e_shared, e_shared + 1, ... of the stack.
        # COUNT: each routed pair's first program adds 1 (or its token's Valid) to Counts[e_p]:
        # integer atomics, so the sums do not depend on the order.
        if PDL:  # models/pdl.py: wait for the kernel before, then let the next start
            gdc_wait()
            gdc_launch_dependents()
        p = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * BN + tl.arange(0, BN)
        rmask = rows < N
        tok = p // k_tot
        if SHARED:
            slot = p % k_tot
            e = tl.load(Idx + tok * k_sel + tl.minimum(slot, k_sel - 1))
            e = tl.where(slot < k_sel, e, e_shared + slot - k_sel)
        else:
            e = tl.load(Idx + p)
        if COUNT:  # noqa: SIM102 (a constexpr, then a runtime test: kept apart for Triton)
            counted = tl.program_id(1) == 0
            if SHARED:
                counted = counted & (p % k_tot < k_sel)  # the shared chunks are not counted
            if counted:
                if HAS_VALID:  # noqa: SIM108
                    inc = tl.load(Valid + tok).to(tl.int64)
                else:
                    inc = tl.full([], 1, tl.int64)
                tl.atomic_add(Counts + e, inc)
        src = X + (p if ACT else tok) * x_stride
        wrow = W + e * N * K + rows.to(tl.int64)[:, None] * K  # (BN, 1) row starts
        acc = tl.zeros([BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            cols = k0 + tl.arange(0, BK)
            cmask = cols < K
            if ACT:
                g = tl.load(src + cols, mask=cmask, other=0.0).to(tl.float32)
                u = tl.load(src + K + cols, mask=cmask, other=0.0).to(tl.float32)
                dt = X.dtype.element_ty
                a = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # silu rounds, then the product
                xv = (a * u).to(dt).to(tl.float32)
            else:
                xv = tl.load(src + cols, mask=cmask, other=0.0).to(tl.float32)
            w = tl.load(wrow + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * xv[None, :], axis=1)
        tl.store(Y + p * N + rows, acc.to(Y.dtype.element_ty), mask=rmask)

    return expert_gemv_kernel


def takes(mode: str, x: torch.Tensor, idx: torch.Tensor, w_gate_up: torch.Tensor) -> bool:
    """Whether a MoE layer runs its routed experts here under TREEVERIFY_MOE_GEMV `mode` (auto,
    1 or 0): a CUDA (or interpreted) 16-bit contiguous batch of few enough pairs."""
    if mode == "0" or idx.dtype != torch.int64 or not idx.is_contiguous():
        return False
    if x.dim() != 2 or not x.is_contiguous() or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if w_gate_up.dtype != x.dtype or not w_gate_up.is_contiguous():
        return False
    return 0 < idx.numel() <= (AUTO_MAX_PAIRS if mode == "auto" else MAX_PAIRS)


@functools.cache
def tile(act: bool = False) -> tuple[int, int, int]:
    """(rows, columns, warps) a program of the gate_up (act False) or down (act True) GEMV
    takes: TREEVERIFY_MOE_GEMV_TILE "BN,BK,WARPS" for both (an A/B of the tile,
    scripts/moe_gemv_bench.py), else GATE_UP_TILE / DOWN_TILE. Read once a process."""
    from treeverify import env

    return env.moe_gemv_tile() or (DOWN_TILE if act else GATE_UP_TILE)


def expert_gemv(
    x: torch.Tensor,  # (T, K) token rows, or with `act` (P, 2K) the gate|up rows of each pair
    idx: torch.Tensor,  # (T, k) int64 expert of each pair, pairs in (token, slot) order
    weight: torch.Tensor,  # (E + S, N, K) stacked expert weights, contiguous
    act: bool = False,
    tiles: tuple[int, int, int] | None = None,  # (BN, BK, warps); None: tile(act)
    counts: torch.Tensor | None = None,  # (E,) int64: each routed pair adds 1 (or valid)
    valid: torch.Tensor | None = None,  # (T,) bool: what a pair adds to `counts`
    shared: int = 0,  # S: each token's k routed pairs are followed by S pairs on experts
    # E .. E + S - 1 of the stack (the shared experts' chunks, models/moe.py)
) -> torch.Tensor:  # (T * (k + S), N) in x's dtype, pairs in (token, slot) order
    bn, bk, warps = tiles or tile(act)
    t, k = idx.shape
    p, n = t * (k + shared), weight.shape[1]
    kk = weight.shape[2]
    y = x.new_empty(p, n)
    count = counts is not None
    _kernels()[(p, -(-n // bn))](x, idx, weight, y, counts if count else y,
                                 valid if valid is not None else idx, n, kk, x.stride(0), k,
                                 k + shared, weight.shape[0] - shared, ACT=act, COUNT=count,
                                 HAS_VALID=valid is not None, SHARED=shared > 0, BN=bn, BK=bk,
                                 num_warps=warps, **pdl.flags(x))  # fmt: skip
    return y


def routed(
    x: torch.Tensor,  # (T, H)
    idx: torch.Tensor,  # (T, k) int64
    w: torch.Tensor,  # (T, k) fp32 routing weights
    w_gate_up: torch.Tensor,  # (E, 2I, H)
    w_down: torch.Tensor,  # (E, H, I)
    valid: torch.Tensor | None,  # (T,) bool
    counter: torch.Tensor | None = None,  # (E,) int64 running counts to add the valid ones to
    shared: torch.Tensor | None = None,  # (T, H) in x's dtype: the shared experts' output
    stacked_shared: int = 0,  # S: the shared experts are the stacks' last S experts instead
) -> tuple[torch.Tensor, torch.Tensor | None]:  # out (T, H) in x's dtype, valid counts (E,)
    """The routed experts' weighted sum (+ the shared experts' output: `shared`, or computed
    here as S more pairs a token) by the two GEMVs and the combine, and the valid rows'
    expert counts: added to `counter` in place (None returned), else returned."""
    from treeverify.models import fused_moe

    if shared is not None and stacked_shared:
        raise ValueError("shared: given while the shared experts are stacked (stacked_shared)")
    s = stacked_shared
    counts = counter if counter is not None else idx.new_zeros(w_gate_up.shape[0] - s)
    h = expert_gemv(x, idx, w_gate_up, counts=counts, valid=valid, shared=s)  # (T(k+S), 2I)
    y = expert_gemv(h, idx, w_down, act=True, shared=s)  # (T(k+S), H)
    out = fused_moe.combine(y, None, w, x.dtype, add=shared, shared_pairs=s)
    return out, (None if counter is not None else counts)
