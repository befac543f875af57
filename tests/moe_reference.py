"""What models/fused_moe.py's kernels must equal: moe.py's grouped-GEMM PyTorch ops (shared by
tests/test_fused_moe_interpret.py and tests/test_fused_moe_gpu.py)."""

from __future__ import annotations

import torch


def dispatch_reference(x: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor | None, e: int):
    """(xs, pos, counts, valid_counts, offs, order) as the PyTorch path makes them."""
    k = idx.shape[1]
    flat = idx.reshape(-1)
    order = flat.argsort(stable=True)  # what moe.py's _grouped_mm sorts by
    counts = torch.zeros(e, dtype=torch.int64, device=x.device).index_add_(
        0, flat, torch.ones_like(flat)
    )
    valid_counts = counts
    if valid is not None:
        valid_counts = torch.zeros_like(counts).index_add_(
            0, flat, valid.to(torch.int64).repeat_interleave(k)
        )
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=x.device)
    return x[order // k], pos, counts, valid_counts, counts.cumsum(0).to(torch.int32), order


def combine_reference(y: torch.Tensor, order: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(T, hidden) fp32: the outputs put back in pair order, weighted, summed over k."""
    t, k = w.shape
    back = torch.empty_like(y)
    back[order] = y
    return (back.view(t, k, -1).float() * w[..., None]).sum(1)


def routed_reference(x, idx, w, w_gate_up, w_down) -> torch.Tensor:
    """(T, hidden) fp32: each (token, expert) pair's expert MLP in fp32 with the activation
    rounded to x's dtype (as fused_ops.silu_mul rounds), weighted and summed over k."""
    t, k = idx.shape
    inter = w_down.shape[2]
    out = torch.zeros(t, w_down.shape[1], dtype=torch.float32)
    for ti in range(t):
        for i in range(k):
            e = int(idx[ti, i])
            h = (w_gate_up[e].float() @ x[ti].float()).to(x.dtype).float()  # (2I,), rounded
            g, u = h[:inter], h[inter:]
            a = torch.nn.functional.silu(g).to(x.dtype).float()
            act = (a * u).to(x.dtype).float()
            y = (w_down[e].float() @ act).to(x.dtype).float()  # (H,), rounded as the GEMV's
            out[ti] += w[ti, i] * y
    return out
