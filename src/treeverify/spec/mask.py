"""Compile a tree: ancestor-or-self bit masks, depths and positions from parent arrays.

The packed mask is the kernels' ``tree_mask`` layout (docs: tree-attention.md): for a batch of
trees with ``T`` node slots each, row ``b*T + i`` has ``W = ceil(T/32)`` int32 words and bit
``j % 32`` of word ``j // 32`` is set iff node ``j`` is an ancestor of node ``i`` or ``i`` itself.
Bit 31 is the sign bit of the int32 word (node 31 of a word makes the word negative).

Trees are topological: ``parents[b, 0] = -1`` (the root), ``parents[b, i] < i`` for real nodes.
A node ``i > 0`` with ``parents[b, i] = -1`` is unused padding (``DraftTree`` puts them after the
real nodes): it gets only its own bit, depth 0 and position ``start``; no real node may have a
padding node as parent.

Everything is capture-safe: pointer jumping ("log doubling") with a fixed number of rounds,
``ceil(log2(T))``, known from the shape; no host reads.
"""

from __future__ import annotations

import torch
from torch import Tensor

from treeverify.kernels.bits import pack_bits, unpack_tree_mask  # the kernels' layout

__all__ = [
    "bit_values",
    "depths_from_parents",
    "pack_bits",
    "parents_to_tree_mask",
    "tree_positions",
    "unpack_tree_mask",
]


def _rounds(t: int) -> int:
    """Pointer-jumping rounds that cover any path of ``t - 1`` edges: ``ceil(log2(t))``."""
    return max(0, (t - 1).bit_length())


def bit_values(device: torch.device | str | None = None) -> Tensor:
    """``(32,)`` int32 with ``1 << k`` as a two's complement int32 (entry 31 is ``-2**31``)."""
    v = torch.ones(32, dtype=torch.int64, device=device) << torch.arange(32, device=device)
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def _self_bits(t: int, device: torch.device) -> Tensor:
    """``(T, W)`` int32: row ``i`` has only bit ``i`` set."""
    w = (t + 31) // 32
    node = torch.arange(t, device=device)
    word = torch.arange(w, device=device)
    vals = bit_values(device)[node % 32]  # (T,)
    hit = word.unsqueeze(0) == (node // 32).unsqueeze(1)  # (T, W)
    return torch.where(hit, vals.unsqueeze(1), torch.zeros_like(vals).unsqueeze(1))


def _jump_pointers(parents: Tensor) -> Tensor:
    """``(B, T)`` int64 parent pointers with the root and padding pointing at themselves."""
    t = parents.shape[1]
    idx = torch.arange(t, device=parents.device).expand_as(parents)
    return torch.where(parents < 0, idx, parents.long())


def parents_to_tree_mask(parents: Tensor, max_depth: int | None = None) -> Tensor:
    """Ancestor-or-self masks of a batch of trees, packed for the kernels.

    Args:
        parents: ``(B, T)`` integer parent indices (see the module notes).
        max_depth: optional bound on the tree depth; only saves doubling rounds
            (``ceil(log2(max_depth + 1))`` instead of ``ceil(log2(T))``).

    Returns:
        ``(B*T, W)`` int32, ``W = ceil(T / 32)``.
    """
    if parents.dim() != 2:
        raise ValueError(f"parents must be (B, T), got shape {tuple(parents.shape)}")
    bsz, t = parents.shape
    w = (t + 31) // 32
    ptr = _jump_pointers(parents)  # (B, T): 2^k-th ancestor after round k (clamped at the root)
    bits = _self_bits(t, parents.device).expand(bsz, t, w).clone()  # (B, T, W) distance 0
    rounds = _rounds(t if max_depth is None else min(t, max_depth + 1))
    for _ in range(rounds):
        # Invariant: bits[i] holds the ancestors at distance < 2^k, ptr[i] the one at 2^k.
        bits = bits | bits.gather(1, ptr.unsqueeze(-1).expand(bsz, t, w))
        ptr = ptr.gather(1, ptr)
    return bits.reshape(bsz * t, w)


def depths_from_parents(parents: Tensor) -> Tensor:
    """``(B, T)`` int64 depth of every node (root and padding: 0), by pointer-jumping ranking."""
    ptr = _jump_pointers(parents)
    t = parents.shape[1]
    idx = torch.arange(t, device=parents.device).expand_as(ptr)
    dist = (ptr != idx).long()  # distance from i to ptr[i]
    for _ in range(_rounds(t)):
        dist = dist + dist.gather(1, ptr)
        ptr = ptr.gather(1, ptr)
    return dist


def tree_positions(depths: Tensor, start: Tensor) -> Tensor:
    """RoPE positions ``start[b] + depths[b, i]``: ``(B, T)`` int64 (``start`` is ``(B,)``,
    the position of the root, i.e. the number of tokens before it).  Padding nodes get ``start``.
    Use ``depths_from_parents`` when only parents are at hand."""
    return start.long().unsqueeze(1) + depths.long()
