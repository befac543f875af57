"""Building blocks shared by the model families: RMSNorm, SwiGLU MLP, RoPE, and the attention seam.

The attention seam: a model calls `attention(layer, q, k, v, sm_scale, v_head_dim)` once per layer
on the flat batch (tensors below). The default `TorchAttention` attends within the tokens of this
call (causal, or a given mask, per request); the engine swaps in a callable that writes k/v into
its paged cache and runs `treeverify.kernels.tree_attention` over it. MLA passes `v=None` and
`v_head_dim=kv_lora_rank`: V is the first `v_head_dim` columns of K, as the kernels take it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from treeverify.models.config import RopeConfig
from treeverify.models.gemv import Linear, down_of_silu, linear


class Attention(Protocol):
    def __call__(
        self,
        layer: int,
        q: torch.Tensor,  # (T, Hq, Dqk)
        k: torch.Tensor,  # (T, Hkv, Dqk)
        v: torch.Tensor | None,  # (T, Hkv, Dv), or None for MLA: V = k[..., :v_head_dim]
        sm_scale: float,
        v_head_dim: int | None = None,
    ) -> torch.Tensor: ...  # (T, Hq, Dv)


def check_flat_batch(input_ids: torch.Tensor, positions: torch.Tensor) -> None:
    """A model forward's inputs: matching (T,) token ids and positions (ValueError otherwise)."""
    if input_ids.dim() != 1 or positions.shape != input_ids.shape:
        raise ValueError(
            f"input_ids/positions: expected matching (T,) tensors, got "
            f"{tuple(input_ids.shape)} and {tuple(positions.shape)}"
        )


class TorchAttention:
    """Attention within this call's tokens, per request, fp32 accumulation.

    qo_lens: tokens per request in the flat batch (default: all one request).
    masks: per request a (n, n) bool tensor, True = key visible to query (default: causal).
    """

    def __init__(
        self,
        qo_lens: Sequence[int] | None = None,
        masks: Sequence[torch.Tensor] | None = None,
    ):
        self.qo_lens = None if qo_lens is None else [int(n) for n in qo_lens]
        self.masks = masks
        if masks is not None and self.qo_lens is not None and len(masks) != len(self.qo_lens):
            raise ValueError(f"masks: expected {len(self.qo_lens)} masks, got {len(masks)}")

    def __call__(self, layer, q, k, v, sm_scale, v_head_dim=None):
        t, hq, _ = q.shape
        hkv = k.shape[1]
        if v is None:
            if v_head_dim is None:
                raise ValueError("v_head_dim: required when v is None (MLA)")
            v = k[..., :v_head_dim]
        lens = self.qo_lens if self.qo_lens is not None else [t]
        if sum(lens) != t:
            raise ValueError(f"qo_lens: sum {sum(lens)} != tokens in the batch {t}")
        out = q.new_empty(t, hq, v.shape[-1])
        start = 0
        for r, n in enumerate(lens):
            sl = slice(start, start + n)
            qr = q[sl].float().transpose(0, 1)  # (Hq, n, D)
            kr = k[sl].float().transpose(0, 1).repeat_interleave(hq // hkv, dim=0)  # (Hq, n, D)
            vr = v[sl].float().transpose(0, 1).repeat_interleave(hq // hkv, dim=0)  # (Hq, n, Dv)
            scores = torch.matmul(qr, kr.transpose(1, 2)) * sm_scale  # (Hq, n, n)
            if self.masks is not None:
                visible = self.masks[r].to(device=q.device, dtype=torch.bool)
            else:
                visible = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~visible, float("-inf"))
            out[sl] = torch.matmul(scores.softmax(-1), vr).transpose(0, 1).to(q.dtype)
            start += n
        return out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x * rsqrt(mean(x^2) + eps) * weight: one fused kernel accumulating in fp32. (Hugging
        # Face rounds to x's dtype before the weight; in fp32 the two are the same, in bf16 this
        # rounds once instead of twice.)
        if x.dtype == self.weight.dtype:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * xf.to(x.dtype)


def fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One (sum out, in) weight (and bias) for several Linears over the same input; the Linears'
    parameters become views into it, so nothing is stored twice and loading still works."""
    weight = torch.cat([m.weight.detach() for m in linears])  # (sum out, in)
    has_bias = linears[0].bias is not None
    bias = torch.cat([m.bias.detach() for m in linears]) if has_bias else None
    row = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(weight[row : row + n], requires_grad=False)
        if has_bias:
            m.bias = nn.Parameter(bias[row : row + n], requires_grad=False)
        row += n
    return weight, bias


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); after `fuse()` gate and up are one GEMM."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=bias)
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None

    @torch.no_grad()
    def fuse(self) -> None:
        if self.gate_up is None:
            self.gate_up = fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        # (T, 2I) -> (T, H): silu(gate) * up, then down (in one kernel where it applies)
        return down_of_silu(linear(x, *self.gate_up), self.down_proj.weight, self.down_proj.bias)


def rope_inv_freq(cfg: RopeConfig, dim: int) -> torch.Tensor:
    """Inverse frequencies (dim/2,) fp32 for a rotary dim `dim` under cfg's scaling."""
    exps = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv = 1.0 / (cfg.theta**exps)  # (dim/2,)
    if cfg.type == "linear":
        return inv / cfg.factor
    if cfg.type == "llama3":
        # Long wavelengths (beyond original_max / low_freq_factor) are divided by `factor`,
        # short ones (below original_max / high_freq_factor) kept, the band between blended.
        orig = cfg.original_max_position_embeddings
        wavelen = 2 * math.pi / inv
        smooth = (orig / wavelen - cfg.low_freq_factor) / (
            cfg.high_freq_factor - cfg.low_freq_factor
        )
        blended = (1 - smooth) * inv / cfg.factor + smooth * inv
        out = torch.where(wavelen > orig / cfg.low_freq_factor, inv / cfg.factor, blended)
        return torch.where(wavelen < orig / cfg.high_freq_factor, inv, out)
    if cfg.type == "yarn":
        # Dimensions that rotate fewer than beta_slow times over the original context are
        # interpolated (divided by factor), more than beta_fast times extrapolated (kept),
        # a linear ramp between.
        orig = cfg.original_max_position_embeddings

        def dim_for(rotations: float) -> float:
            return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(cfg.theta))

        lo, hi = dim_for(cfg.beta_fast), dim_for(cfg.beta_slow)
        if cfg.truncate:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
        keep = 1 - ramp  # 1 = extrapolate (high frequency), 0 = interpolate
        return (inv / cfg.factor) * (1 - keep) + inv * keep
    return inv


# Positions a tabulated Rope covers past the model's context: a verified tree's deepest node
# (<= 1024 below its root) and a drafter's block (<= 64 rows) sit past the last committed one.
ROPE_TABLE_SLACK = 2048


class Rope(nn.Module):
    """cos/sin (T, dim/2) for positions; YaRN's cos/sin factor folded in."""

    def __init__(self, cfg: RopeConfig, dim: int):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(cfg, dim), persistent=False)
        self.scale = cfg.yarn_cos_sin_factor()
        # (cos2, sin2) (L, dim) for positions 0..L-1 (`tabulate`; not module state: no state
        # dict entry, and a move of the module leaves them behind, where they are not used)
        self.tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def tabulate(self, positions: int, dtype: torch.dtype, device: torch.device | str) -> None:
        """Precompute `rotate_half_tables` for positions 0..positions-1 on a GPU, so a forward
        reads its rows (fused_ops.rope_rows: one kernel) instead of computing them (~10 small
        kernels: the positions' cast, the products, cos, sin, the scale, cats, negation, casts;
        ~10 us a forward inside a graph). The same ops over all positions: rows bit-equal to the
        per-forward ones. The engine sizes it past every position it can ask (ROPE_TABLE_SLACK);
        a position past it would read the last row. Off the GPU, or with
        TREEVERIFY_ROPE_TABLE=0, nothing is kept."""
        from treeverify import env

        if torch.device(device).type != "cuda" or not env.rope_table():
            self.tables = None
            return
        dim = 2 * self.inv_freq.shape[0]
        cos2 = torch.empty(positions, dim, dtype=dtype, device=device)  # (L, dim)
        sin2 = torch.empty(positions, dim, dtype=dtype, device=device)
        step = 16384  # in pieces: the fp32 temporaries stay small at long contexts
        for start in range(0, positions, step):
            idx = torch.arange(start, min(start + step, positions), device=device)
            c, s = self._compute_tables(idx, dtype)  # (n, dim) each
            cos2[start : start + step], sin2[start : start + step] = c, s
        self.tables = (cos2, sin2)

    def _compute_tables(self, positions: torch.Tensor,
                        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        cos, sin = self(positions)  # (T, dim/2) each
        return torch.cat((cos, cos), -1).to(dtype), torch.cat((-sin, sin), -1).to(dtype)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (T, dim/2)
        return freqs.cos() * self.scale, freqs.sin() * self.scale

    def rotate_half_tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos|cos, -sin|sin) (T, dim) in `dtype`, once per forward, for `apply_rope_tables`:
        the rows of `tabulate`'s tables where they are kept on the positions' GPU, in `dtype`;
        else computed."""
        tables = self.tables
        if (tables is not None and positions.is_cuda and tables[0].dtype == dtype
                and tables[0].device == positions.device):  # fmt: skip
            from treeverify.models.fused_ops import rope_rows

            return rope_rows(tables[0], tables[1], positions)
        return self._compute_tables(positions, dtype)


def apply_rope_tables(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
    """apply_rope (rotate-half layout) with `Rope.rotate_half_tables`: x*cos + swap(x)*sin, where
    swap(x) = (x2, x1); bit-identical to apply_rope, four kernels instead of seven."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)  # (T, H, dim)
    return x * cos2[:, None, :] + swapped * sin2[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool = False):
    """Rotate x (T, H, dim) by cos/sin (T, dim/2).

    interleave=False pairs dim i with i + dim/2 (Llama/Qwen "rotate half"); True pairs (2i, 2i+1)
    (DeepSeek's checkpoint layout) and keeps that layout in the output.
    """
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
