"""The MoE router's expert selection in one Triton kernel (issue 14: "routing top-k and sorts").

`select_experts` (models/moe.py) is ~15 small PyTorch kernels a layer (sigmoid, the bias, the
groups' top-2 sums, their top-k, a scatter, an expand, a masked fill, the experts' top-k, a
gather, the normalisation): the batch-1 MLA+MoE decode profile put routing top-k and sorts at
~0.24 ms of a 2.10 ms forward, launch-bound (docs/performance.md). Here one program per token
does the same selection in registers:

    scores  sigmoid (or softmax) of the router logits, fp32
    choice  scores + e_score_correction_bias (noaux_tc)
    groups  each group's score (the sum of its top-2 choices for noaux_tc, else its max); the
            topk_group best groups keep their experts, the others' choices become -inf
    top-k   k rounds of "take the largest choice" (lowest index among equals), each expert's
            weight its unbiased score; normalised to sum 1 (norm_topk_prob), times
            routed_scaling_factor

At decode sizes the router's logits come from one Triton GEMV too (`logits`: fp32 sums, one
launch instead of cuBLAS's four for one row).

The same experts in the same (descending) order as `torch.topk` whenever no two choices tie
exactly; weights equal up to float summation order (tests/test_fused_routing_interpret.py on the
CPU interpreter). Groups must hold a power-of-two number of experts (every DeepSeek-V3 / Kimi
layout does); other configurations keep the PyTorch path, as does a machine without Triton.
On by default on a GPU (TREEVERIFY_FUSED_ROUTING=0 turns it off, env.py): on the H200 it took
random:mla-moe's batch-1 decode step from 2.34 to 2.04 ms and its verify forward 0.87-0.97x
(docs/performance.md, sixteenth session).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from treeverify.models import pdl
from treeverify.models.config import DeepseekV3Config


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    gdc_wait, gdc_launch_dependents = pdl.gdc()  # PDL's two calls (models/pdl.py)

    @triton.jit
    def route_kernel(L, Bias, Idx, W, E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr,
                     KP: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, GS: tl.constexpr,
                     TOPK_GROUP: tl.constexpr, SIGMOID: tl.constexpr, NOAUX: tl.constexpr,
                     TOP2: tl.constexpr, NORM: tl.constexpr, scale, PDL: tl.constexpr):  # fmt: skip
        if PDL:  # models/pdl.py: wait for the kernel before, then let the next start
            gdc_wait()
            gdc_launch_dependents()
        t = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, EP)
        live = offs < E
        x = tl.load(L + t * E + offs, mask=live, other=float("-inf")).to(tl.float32)
        if SIGMOID:
            scores = 1.0 / (1.0 + tl.exp(-x))
        else:
            ex = tl.exp(x - tl.max(x, axis=0))
            scores = ex / tl.sum(ex, axis=0)
        scores = tl.where(live, scores, 0.0)
        choice = scores
        if NOAUX:
            choice = scores + tl.load(Bias + offs, mask=live, other=0.0).to(tl.float32)
        choice = tl.where(live, choice, float("-inf"))
        if G > 1:
            gidx = tl.arange(0, GP)
            gscore = tl.full([GP], float("-inf"), tl.float32)
            for g in tl.static_range(G):
                in_g = (offs >= g * GS) & (offs < (g + 1) * GS)
                c = tl.where(in_g, choice, float("-inf"))
                top1 = tl.max(c, axis=0)
                if TOP2:  # the sum of the group's two largest (a tie counts twice, as topk)
                    first = tl.min(tl.where(c == top1, offs, EP), axis=0)
                    top2 = tl.max(tl.where(offs == first, float("-inf"), c), axis=0)
                    s = top1 + top2
                else:
                    s = top1
                gscore = tl.where(gidx == g, s, gscore)
            keep = tl.zeros([GP], tl.int32)  # 1: the group's experts stay
            for _ in tl.static_range(TOPK_GROUP):
                best = tl.max(gscore, axis=0)
                pick = tl.min(tl.where(gscore == best, gidx, GP), axis=0)
                keep = tl.where(gidx == pick, 1, keep)
                gscore = tl.where(gidx == pick, float("-inf"), gscore)
            kept = tl.zeros([EP], tl.int32)
            for g in tl.static_range(G):
                g_kept = tl.sum(tl.where(gidx == g, keep, 0), axis=0)
                in_g = (offs >= g * GS) & (offs < (g + 1) * GS)
                kept = tl.where(in_g, g_kept, kept)
            choice = tl.where(kept > 0, choice, float("-inf"))
        kidx = tl.arange(0, KP)
        ids = tl.zeros([KP], tl.int64)
        ws = tl.zeros([KP], tl.float32)
        for i in tl.static_range(K):
            best = tl.max(choice, axis=0)
            j = tl.min(tl.where(choice == best, offs, EP), axis=0)
            ids = tl.where(kidx == i, j.to(tl.int64), ids)
            ws = tl.where(kidx == i, tl.sum(tl.where(offs == j, scores, 0.0), axis=0), ws)
            choice = tl.where(offs == j, float("-inf"), choice)
        if NORM:
            ws = ws / (tl.sum(ws, axis=0) + 1e-20)
        tl.store(Idx + t * K + kidx, ids, mask=kidx < K)
        tl.store(W + t * K + kidx, ws * scale, mask=kidx < K)

    return route_kernel


# One warp a token: the ~60 reductions over <= 256 experts are then shuffles, no shared-memory
# round trips and barriers (the default 4 warps: 6.2 us a call for 64 experts on the H200).
ROUTE_WARPS = 1
LOGITS_MAX_ROWS = 64  # above: cuBLAS (each program here re-reads its weight rows per token)
# One expert's row a program, read in one tile where it fits: one memory round trip a program
# (4 rows a program in 512-column tiles, 4 dependent loads, took 7.5 us a call on the H200).
LOGITS_ROWS = 1  # experts a logits program sums: 64 programs a token for 64 experts
LOGITS_MAX_COLS = 8192  # hidden columns a tile reads at most (Kimi K2's 7168 in one)


@functools.cache
def _logits_kernel():
    import triton
    import triton.language as tl

    gdc_wait, gdc_launch_dependents = pdl.gdc()  # PDL's two calls (models/pdl.py)

    @triton.jit
    def logits_kernel(X, Wt, L, E, H, x_stride, BE: tl.constexpr, BH: tl.constexpr,
                      PDL: tl.constexpr):  # fmt: skip
        if PDL:  # models/pdl.py: wait for the kernel before, then let the next start
            gdc_wait()
            gdc_launch_dependents()
        t = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * BE + tl.arange(0, BE)  # (BE,) experts
        live = rows < E
        acc = tl.zeros([BE], dtype=tl.float32)
        for h0 in range(0, H, BH):
            cols = h0 + tl.arange(0, BH)
            cm = cols < H
            x = tl.load(X + t * x_stride + cols, mask=cm, other=0.0).to(tl.float32)  # (BH,)
            w = tl.load(Wt + rows.to(tl.int64)[:, None] * H + cols[None, :],
                        mask=live[:, None] & cm[None, :], other=0.0).to(tl.float32)  # fmt: skip
            acc += tl.sum(w * x[None, :], axis=1)
        tl.store(L + t * E + rows, acc, mask=live)

    return logits_kernel


def logits(
    x: torch.Tensor,  # (T, H) hidden rows, any float dtype
    weight: torch.Tensor,  # (E, H) router weight (fp32 as DeepSeek keeps it)
) -> torch.Tensor:  # (T, E) fp32
    """The router's logits x W^T in fp32, one Triton launch for T <= LOGITS_MAX_ROWS rows.

    F.linear(x.float(), weight.float()) at batch 1 was four launches on the H200 (x's fp32
    copy, cuBLAS's dot, its block reduce and a copy back: ~7 us a layer, 2026-12-04 decode
    profile); here one, each program summing LOGITS_ROWS experts' rows in fp32. More rows (a
    prefill) go to F.linear. The sums' order differs from cuBLAS's: equal within fp32
    rounding, not bit for bit."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x: expected (T, {weight.shape[-1]}) for a router weight of shape "
                         f"{tuple(weight.shape)}, got {tuple(x.shape)}")  # fmt: skip
    t, h = x.shape
    e = weight.shape[0]
    if t > LOGITS_MAX_ROWS or x.stride(1) != 1:
        return F.linear(x.float(), weight.float())
    weight = weight.contiguous()
    out = torch.empty(t, e, dtype=torch.float32, device=x.device)
    if t:
        grid = (t, -(-e // LOGITS_ROWS))
        _logits_kernel()[grid](x, weight, out, e, h, x.stride(0), BE=LOGITS_ROWS,
                               BH=min(_pow2(h), LOGITS_MAX_COLS), num_warps=4,
                               **pdl.flags(x))  # fmt: skip
    return out


def describe(fused: bool) -> str:
    """One line for the startup log and /server_info: which path MoE routing takes on a GPU."""
    if fused:
        return "MoE routing: one Triton kernel a layer (TREEVERIFY_FUSED_ROUTING=0: PyTorch ops)"
    return ("MoE routing: PyTorch ops (TREEVERIFY_FUSED_ROUTING=0, no Triton, or expert groups "
            "not a power of two)")  # fmt: skip


def fusable(cfg: DeepseekV3Config) -> bool:
    """The kernel covers this routing: groups of a power-of-two size (or no groups)."""
    grouped = cfg.topk_method != "greedy" and cfg.n_group > 1
    if not grouped:
        return True
    size = cfg.n_routed_experts // cfg.n_group
    return cfg.n_routed_experts % cfg.n_group == 0 and size == _pow2(size)


def route(
    logits: torch.Tensor,  # (T, E) fp32 router logits
    cfg: DeepseekV3Config,
    bias: torch.Tensor | None = None,  # (E,) e_score_correction_bias (noaux_tc)
) -> tuple[torch.Tensor, torch.Tensor]:  # (T, k) int64 expert ids, (T, k) fp32 weights
    """`select_experts` in one kernel launch (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    if not fusable(cfg):
        raise ValueError(f"cfg: routing groups of {cfg.n_routed_experts // cfg.n_group} experts "
                         "are not a power of two; use select_experts")  # fmt: skip
    noaux = cfg.topk_method == "noaux_tc"
    if noaux and bias is None:
        raise ValueError("noaux_tc routing needs e_score_correction_bias")
    t, e = logits.shape
    k = cfg.num_experts_per_tok
    grouped = cfg.topk_method != "greedy" and cfg.n_group > 1
    g = cfg.n_group if grouped else 1
    logits = logits.float().contiguous()
    idx = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    w = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    if t == 0:
        return idx, w
    b = bias.float().contiguous() if noaux else logits  # (unread without noaux)
    _kernel()[(t,)](
        logits, b, idx, w, E=e, EP=_pow2(e), K=k, KP=_pow2(k), G=g, GP=_pow2(g), GS=e // g,
        TOPK_GROUP=cfg.topk_group if grouped else 1, SIGMOID=cfg.scoring_func == "sigmoid",
        NOAUX=noaux, TOP2=noaux, NORM=cfg.norm_topk_prob, scale=float(cfg.routed_scaling_factor),
        num_warps=ROUTE_WARPS if e <= 256 else 4, **pdl.flags(logits),
    )  # fmt: skip
    return idx, w
