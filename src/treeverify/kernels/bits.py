"""The packed visibility-mask layout every tree_attention backend reads: bit j of word j // 32.

The one place booleans become those int32 words (bit 31 is the sign bit) and back, for the
reference, spec/ (trees), the engine (prefill chunks as chains) and the SGLang drop-in.
"""

from __future__ import annotations

import torch
from torch import Tensor


def pack_bits(dense: Tensor) -> Tensor:
    """Pack a boolean ``(..., T)`` tensor into ``(..., ceil(T/32))`` int32 words (bit j of word
    j//32), two's complement for bit 31."""
    t = dense.shape[-1]
    w = (t + 31) // 32
    pad = w * 32 - t
    d = torch.nn.functional.pad(dense.to(torch.int64), (0, pad))  # (..., W*32)
    d = d.reshape(*dense.shape[:-1], w, 32)
    weights = torch.ones(32, dtype=torch.int64, device=dense.device) << torch.arange(
        32, device=dense.device
    )
    words = (d * weights).sum(dim=-1)  # (..., W) in [0, 2^32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_tree_mask(mask: Tensor, t: int) -> Tensor:
    """Inverse of ``pack_bits``: ``(..., W)`` int32 -> ``(..., t)`` bool ([..., j]: node j seen)."""
    node = torch.arange(t, device=mask.device)
    words = mask[..., node // 32].long()  # (..., t)
    return ((words >> (node % 32)) & 1).bool()


def chain_bits(n: int, device: torch.device | str = "cpu") -> Tensor:
    """(n, ceil(n/32)) int32: row i sees nodes 0..i (a causal chain, e.g. a prefill chunk)."""
    i = torch.arange(n, device=device)
    return pack_bits(i.unsqueeze(0) <= i.unsqueeze(1))  # (n, n) lower triangle -> words
