"""The grouped-GEMM MoE path's dispatch and combine as two Triton kernels (issue 14: the batch-1
MLA+MoE decode is launch-bound).

models/moe.py's `_grouped_mm` path around its two grouped GEMMs runs ~20 small PyTorch kernels a
layer: the expert counts (zeros, index_add, and again for the valid rows), a stable argsort of the
(token, expert) pairs, the offsets (cumsum, cast), the rows gathered in sorted order, then the
outputs scattered back, weighted, summed over a token's k experts and cast. Here:

    dispatch  two launches: each pair's place in the expert-sorted order (its expert's start,
              by counting the pairs of smaller experts, plus the pairs of its own expert before
              it: the order a stable argsort gives) and its token's row copied to that place;
              then (count_kernel, one program) every expert's count, over valid rows, and offsets
    combine   one launch: a token's k output rows read from their sorted places, weighted in
              fp32 and summed in expert order 0..k-1, cast once

The sorted rows, counts and offsets equal the PyTorch path's exactly, so the grouped GEMMs see the
same inputs; the combine sums each token's k terms in order, as PyTorch's reduction over that dim
does, to float rounding (tests/test_fused_moe_interpret.py on the CPU interpreter,
tests/test_fused_moe_gpu.py on a GPU). The comparison count is (pairs)^2 / BLOCK a program: fine
for decode and verify batches (a few thousand pairs), not meant for prefill-sized ones, which keep
the PyTorch path (MAX_PAIRS).

TREEVERIFY_FUSED_MOE_DISPATCH (env.py) picks it: auto (default) where a batch has at most
AUTO_MAX_PAIRS pairs. Measured on the H200 (random:mla-moe, k=6, 2026-12-04, bench engine A/B):
decode b=1 (6 pairs) 1.82 -> 1.57 ms, b=32 (192) 4.50 -> 4.26 ms, verify of 64 tokens (384)
1.06x; at 768 pairs even to 0.98x, 1536-6144 pairs 0.83-0.88x (each program's comparison loop
runs pairs/BLOCK rounds back to back, and the first program counts alone).
"""

from __future__ import annotations

import functools

import torch

from treeverify.models import pdl

BLOCK = 64  # pairs a dispatch program places (and compares at a time)
MAX_PAIRS = 8192  # beyond, the PyTorch path (the comparisons grow as pairs^2)
AUTO_MAX_PAIRS = 512  # "auto" takes batches up to here: faster at <= 384 pairs, not at >= 768


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    gdc_wait, gdc_launch_dependents = pdl.gdc()  # PDL's two calls (models/pdl.py)

    @triton.jit
    def count_kernel(Idx, Valid, Counts, ValidCounts, Offs, P, k, E: tl.constexpr,
                     EP: tl.constexpr, BLOCK: tl.constexpr, HAS_VALID: tl.constexpr,
                     PDL: tl.constexpr):  # fmt: skip
        # One program: every expert's pair count (and over valid rows) and end offset.
        if PDL:  # models/pdl.py: wait for the kernel before, then let the next start
            gdc_wait()
            gdc_launch_dependents()
        e = tl.arange(0, EP)
        cnt = tl.zeros([EP], dtype=tl.int64)
        vcnt = tl.zeros([EP], dtype=tl.int64)
        for start in range(0, P, BLOCK):
            q = start + tl.arange(0, BLOCK)
            qlive = q < P
            eq = tl.load(Idx + q, mask=qlive, other=0)
            hit = ((eq[None, :] == e[:, None]) & qlive[None, :]).to(tl.int64)  # (EP, BLOCK)
            cnt += tl.sum(hit, axis=1)
            if HAS_VALID:
                v = tl.load(Valid + q // k, mask=qlive, other=0).to(tl.int64)
                vcnt += tl.sum(hit * v[None, :], axis=1)
        ends = tl.cumsum(cnt, axis=0)
        tl.store(Counts + e, cnt, mask=e < E)
        tl.store(Offs + e, ends.to(tl.int32), mask=e < E)
        if HAS_VALID:
            tl.store(ValidCounts + e, vcnt, mask=e < E)

    @triton.jit
    def dispatch_kernel(Idx, X, Xs, Pos, P, k, hidden, BLOCK: tl.constexpr,
                        HB: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
        if PDL:  # models/pdl.py: wait for the kernel before, then let the next start
            gdc_wait()
            gdc_launch_dependents()
        pid = tl.program_id(0)
        p = pid * BLOCK + tl.arange(0, BLOCK)  # this program's pairs
        live = p < P
        ep = tl.load(Idx + p, mask=live, other=0)
        less = tl.zeros([BLOCK], dtype=tl.int32)  # pairs of smaller experts
        before = tl.zeros([BLOCK], dtype=tl.int32)  # pairs of the same expert earlier
        for start in range(0, P, BLOCK):
            q = start + tl.arange(0, BLOCK)
            qlive = q < P
            eq = tl.load(Idx + q, mask=qlive, other=0)
            lt = (eq[None, :] < ep[:, None]) & qlive[None, :]
            same = (eq[None, :] == ep[:, None]) & (q[None, :] < p[:, None])
            less += tl.sum(lt.to(tl.int32), axis=1)
            before += tl.sum(same.to(tl.int32), axis=1)
        pos = (less + before).to(tl.int64)
        tl.store(Pos + p, pos, mask=live)
        tok = p // k
        for h0 in range(0, hidden, HB):  # the pair's token row to its sorted place
            cols = h0 + tl.arange(0, HB)
            m = live[:, None] & (cols[None, :] < hidden)
            rows = tl.load(X + tok[:, None] * hidden + cols[None, :], mask=m)
            tl.store(Xs + pos[:, None] * hidden + cols[None, :], rows, mask=m)

    @triton.jit
    def combine_kernel(Y, Pos, W, Add, Out, hidden, K: tl.constexpr, HB: tl.constexpr,
                       SORTED: tl.constexpr, HAS_ADD: tl.constexpr, S: tl.constexpr,
                       PDL: tl.constexpr):  # fmt: skip
        # S > 0 (pair order only): each token's K routed rows of Y are followed by S rows of the
        # shared experts' chunks (models/moe_gemv.py), summed unweighted as the shared output.
        if PDL:  # models/pdl.py: wait for the kernel before, then let the next start
            gdc_wait()
            gdc_launch_dependents()
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * HB + tl.arange(0, HB)
        m = cols < hidden
        acc = tl.zeros([HB], dtype=tl.float32)
        for i in tl.static_range(K):  # in expert order 0..k-1, as the PyTorch path sums
            if SORTED:  # noqa: SIM108 (Y in expert order: the pair's place from the dispatch)
                pos = tl.load(Pos + t * K + i)
            else:  # Y in pair order (models/moe_gemv.py)
                pos = t * (K + S) + i
            wt = tl.load(W + t * K + i).to(tl.float32)
            y = tl.load(Y + pos * hidden + cols, mask=m, other=0.0).to(tl.float32)
            acc += y * wt
        res = acc.to(Out.dtype.element_ty)
        if HAS_ADD:  # + the shared experts' output, as `out.to(dtype) + shared` rounds
            a = tl.load(Add + t * hidden + cols, mask=m, other=0.0).to(tl.float32)
            res = (res.to(tl.float32) + a).to(Out.dtype.element_ty)
        if S > 0:  # the same with the shared output summed here (rounded as its GEMV would)
            sh = tl.zeros([HB], dtype=tl.float32)
            for j in tl.static_range(S):
                pos = t * (K + S) + K + j
                sh += tl.load(Y + pos * hidden + cols, mask=m, other=0.0).to(tl.float32)
            sh = sh.to(Out.dtype.element_ty).to(tl.float32)
            res = (res.to(tl.float32) + sh).to(Out.dtype.element_ty)
        tl.store(Out + t * hidden + cols, res, mask=m)

    return dispatch_kernel, combine_kernel, count_kernel


def fits(x: torch.Tensor, idx: torch.Tensor) -> bool:
    """Whether the kernels take these operands (else the caller keeps the PyTorch path)."""
    return (
        x.dim() == 2 and x.is_contiguous() and idx.dim() == 2 and idx.shape[0] == x.shape[0]
        and idx.dtype == torch.int64 and idx.is_contiguous() and 0 < idx.numel() <= MAX_PAIRS
    )  # fmt: skip


def takes(mode: str, x: torch.Tensor, idx: torch.Tensor) -> bool:
    """Whether the grouped-GEMM path runs these kernels under TREEVERIFY_FUSED_MOE_DISPATCH `mode`
    (auto, 1 or 0): they must fit, and under auto the batch be small (AUTO_MAX_PAIRS)."""
    if mode == "0" or not fits(x, idx):
        return False
    return mode == "1" or idx.numel() <= AUTO_MAX_PAIRS


def dispatch(
    x: torch.Tensor,  # (T, hidden)
    idx: torch.Tensor,  # (T, k) int64 expert of each (token, slot) pair
    valid: torch.Tensor | None,  # (T,) bool: rows the counters report (None: all)
    n_experts: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(xs (T*k, hidden) rows in expert order, pos (T*k,) int64 each pair's sorted place,
    counts (E,) int64, valid_counts (E,) int64, offs (E,) int32 each expert's end row)."""
    t, k = idx.shape
    p, hidden = t * k, x.shape[1]
    xs = x.new_empty(p, hidden)
    pos = torch.empty(p, dtype=torch.int64, device=x.device)
    counts = torch.empty(n_experts, dtype=torch.int64, device=x.device)
    offs = torch.empty(n_experts, dtype=torch.int32, device=x.device)
    valid_counts = counts if valid is None else torch.empty_like(counts)
    from triton import next_power_of_2

    _kernels()[0][(-(-p // BLOCK),)](idx, x, xs, pos, p, k, hidden, BLOCK=BLOCK,
                                     HB=min(128, next_power_of_2(hidden)),
                                     **pdl.flags(x))  # fmt: skip
    _kernels()[2][(1,)](idx, valid if valid is not None else idx, counts, valid_counts, offs, p, k,
                        E=n_experts, EP=next_power_of_2(n_experts), BLOCK=BLOCK,
                        HAS_VALID=valid is not None, **pdl.flags(x))  # fmt: skip
    return xs, pos, counts, valid_counts, offs


def combine(
    y: torch.Tensor,  # (T*k, hidden) expert outputs in sorted order (pos) or pair order (None)
    pos: torch.Tensor | None,  # (T*k,) int64 from dispatch; None: y[t*k + i] is pair (t, i)'s
    w: torch.Tensor,  # (T, k) fp32 routing weights
    dtype: torch.dtype,
    add: torch.Tensor | None = None,  # (T, hidden) in `dtype`, contiguous: added after the cast
    shared_pairs: int = 0,  # S (pair order only): y holds T*(k+S) rows, each token's last S
    # the shared experts' chunks, added (summed, rounded to `dtype`) as `add` would be
) -> torch.Tensor:  # (T, hidden) sum_i w[t, i] * y[pos[t*k + i]] (+ add), in `dtype`
    t, k = w.shape
    if shared_pairs and (pos is not None or add is not None):
        raise ValueError("shared_pairs: only for pair-order rows without `add`")
    hidden = y.shape[1]
    out = torch.empty(t, hidden, dtype=dtype, device=y.device)
    from triton import next_power_of_2

    hb = min(1024, next_power_of_2(hidden))
    sorted_, has_add = pos is not None, add is not None
    _kernels()[1][(t, -(-hidden // hb))](y, pos if sorted_ else y, w.contiguous(),
                                          add if has_add else out, out, hidden, K=k, HB=hb,
                                          SORTED=sorted_, HAS_ADD=has_add,
                                          S=shared_pairs, **pdl.flags(y))  # fmt: skip
    return out
