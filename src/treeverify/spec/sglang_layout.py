"""Our trees <-> SGLang's target-verify layout (facts from tree-attention.md; our own code).

SGLang verifies ``N`` draft tokens per request (the same ``N`` for all; node 0 is the root/bonus
token, nodes in topological order) with:

* ``custom_mask``: flat uint8; request ``b`` owns a row-major ``[N, P_b + N]`` block starting at
  ``mask_indptr[b]``: prefix columns all 1, the last ``N`` columns the ancestor-or-self mask;
* ``mask_indptr``: int64 ``(B+1,)``, exclusive cumsum of ``N * (P_b + N)`` with a leading 0;
* ``qo_indptr = arange(0, (B+1)*N, N)`` and ``kv_indptr`` = cumsum of prefix lengths with a leading
  0 (both int32);
* ``retrieve_next_token (B, N)`` int64: first child of node ``i`` (``-1`` if none);
  ``retrieve_next_sibling (B, N)``: the next sibling of ``i`` in node order (``-1`` if none).

Everything here is device-only and capture-safe.  The flat mask's length is data-dependent, so
``to_sglang_verify`` takes its capacity (``mask_capacity``, a Python int, e.g. SGLang's
preallocated buffer size); entries past ``mask_indptr[-1]`` are 0.  A caller outside a graph can
pass ``int(N * (prefix_lens.sum() + B * N))`` (one host read, its choice).
Padding nodes of our trees (``parent = -1``, index > 0) have no SGLang counterpart: they map to
rows with only their own bit and no links, and map back to ``-1`` parents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .mask import _rounds, pack_bits, parents_to_tree_mask, unpack_tree_mask

__all__ = [
    "SGLangVerifyLayout",
    "from_sglang_verify",
    "next_token_sibling_to_parents",
    "sglang_mask_to_tree_mask",
    "to_sglang_verify",
]


@dataclass
class SGLangVerifyLayout:
    """SGLang target-verify metadata for ``B`` requests of ``N`` draft tokens each."""

    custom_mask: Tensor  # (mask_capacity,) uint8, flat per-request [N, P_b + N] blocks
    mask_indptr: Tensor  # (B+1,) int64
    qo_indptr: Tensor  # (B+1,) int32
    kv_indptr: Tensor  # (B+1,) int32
    retrieve_next_token: Tensor  # (B, N) int64
    retrieve_next_sibling: Tensor  # (B, N) int64


def _exclusive_cumsum(x: Tensor) -> Tensor:
    """``(B,)`` -> ``(B+1,)`` with a leading 0."""
    return torch.cat([x.new_zeros(1), torch.cumsum(x, dim=0)])


def _first_child_next_sibling(parents: Tensor) -> tuple[Tensor, Tensor]:
    """``(B, N)`` parents -> (first child, next sibling), int64, ``-1`` when none."""
    bsz, n = parents.shape
    dev = parents.device
    idx = torch.arange(n, device=dev).expand(bsz, n)
    has_parent = parents >= 0
    par = parents.long().clamp(min=0)
    first = torch.full((bsz, n), n, dtype=torch.int64, device=dev)
    first.scatter_reduce_(
        1, par, torch.where(has_parent, idx, torch.full_like(idx, n)), reduce="amin"
    )
    first = torch.where(first >= n, torch.full_like(first, -1), first)
    # Sort by (parent, index); a node's next sibling is its successor when it has the same parent.
    group = torch.where(has_parent, par, torch.full_like(par, n))  # orphans after everyone
    order = torch.argsort(group * n + idx, dim=1)  # (B, N)
    sorted_group = group.gather(1, order)
    succ = torch.cat([order[:, 1:], order.new_full((bsz, 1), -1)], dim=1)
    succ_group = torch.cat([sorted_group[:, 1:], sorted_group.new_full((bsz, 1), -2)], dim=1)
    nxt_sorted = torch.where((succ_group == sorted_group) & (sorted_group < n), succ, -1)
    nxt = torch.full((bsz, n), -1, dtype=torch.int64, device=dev)
    nxt.scatter_(1, order, nxt_sorted)
    return first, nxt


def to_sglang_verify(
    parents: Tensor, prefix_lens: Tensor, mask_capacity: int
) -> SGLangVerifyLayout:
    """Build SGLang's verify layout from ``parents (B, N)`` and ``prefix_lens (B,)``.

    ``mask_capacity`` (Python int) is the flat mask's length; it must be at least
    ``sum_b N * (P_b + N)`` (not checked on the device: entries past the capacity are dropped).
    """
    bsz, n = parents.shape
    dev = parents.device
    plen = prefix_lens.to(device=dev, dtype=torch.int64)  # (B,)
    row_len = plen + n  # (B,)
    mask_indptr = _exclusive_cumsum(n * row_len)  # (B+1,) int64
    qo_indptr = torch.arange(0, (bsz + 1) * n, n, dtype=torch.int32, device=dev)
    kv_indptr = _exclusive_cumsum(plen).to(torch.int32)

    dense = unpack_tree_mask(parents_to_tree_mask(parents), n).reshape(bsz, n, n)  # (B, N, N)
    e = torch.arange(mask_capacity, dtype=torch.int64, device=dev)  # flat positions
    b = (torch.searchsorted(mask_indptr, e, right=True) - 1).clamp(0, bsz - 1)  # (E,)
    local = e - mask_indptr[b]
    rl = row_len[b]
    row = local // rl
    col = local % rl
    pl = plen[b]
    in_range = e < mask_indptr[-1]
    tree_col = (col - pl).clamp(min=0)
    tree_bit = dense[b, row.clamp(max=n - 1), tree_col.clamp(max=n - 1)]
    val = torch.where(col < pl, torch.ones_like(tree_bit), tree_bit) & in_range
    first, nxt = _first_child_next_sibling(parents)
    return SGLangVerifyLayout(
        custom_mask=val.to(torch.uint8),
        mask_indptr=mask_indptr,
        qo_indptr=qo_indptr,
        kv_indptr=kv_indptr,
        retrieve_next_token=first,
        retrieve_next_sibling=nxt,
    )


def _sglang_tree_block(
    custom_mask: Tensor, mask_indptr: Tensor, prefix_lens: Tensor, n: int
) -> Tensor:
    """The ``(B, N, N)`` bool ancestor-or-self block of each request's flat mask."""
    dev = custom_mask.device
    bsz = prefix_lens.shape[0]
    plen = prefix_lens.to(device=dev, dtype=torch.int64).view(bsz, 1, 1)
    i = torch.arange(n, device=dev).view(1, n, 1)
    j = torch.arange(n, device=dev).view(1, 1, n)
    start = mask_indptr.to(device=dev, dtype=torch.int64)[:bsz].view(bsz, 1, 1)
    flat = start + i * (plen + n) + plen + j  # (B, N, N)
    return custom_mask.reshape(-1)[flat] != 0


def sglang_mask_to_tree_mask(
    custom_mask: Tensor, mask_indptr: Tensor, prefix_lens: Tensor, n: int
) -> Tensor:
    """SGLang's flat mask -> our packed ``(B*N, ceil(N/32))`` int32 ``tree_mask``."""
    block = _sglang_tree_block(custom_mask, mask_indptr, prefix_lens, n)  # (B, N, N)
    return pack_bits(block).reshape(-1, (n + 31) // 32)


def from_sglang_verify(
    custom_mask: Tensor, mask_indptr: Tensor, prefix_lens: Tensor, n: int
) -> Tensor:
    """SGLang's flat mask -> ``parents (B, N)`` int64.

    In topological order a node's ancestors have smaller indices and its parent is the deepest, so
    the parent is the largest ``j < i`` set in row ``i`` (``-1`` if none).
    """
    block = _sglang_tree_block(custom_mask, mask_indptr, prefix_lens, n)  # (B, N, N)
    j = torch.arange(n, device=block.device)
    below = j.view(1, n) < j.view(n, 1)  # (N, N): column j < row i
    cand = torch.where(block & below, j.view(1, 1, n), torch.full_like(j, -1).view(1, 1, n))
    return cand.max(dim=-1).values


def next_token_sibling_to_parents(
    retrieve_next_token: Tensor, retrieve_next_sibling: Tensor
) -> Tensor:
    """``retrieve_next_token``/``retrieve_next_sibling (B, N)`` -> ``parents (B, N)`` int64.

    A first child's parent is the node pointing at it; a later sibling inherits the parent of the
    first child of its sibling chain, found by pointer jumping along previous-sibling links.
    """
    bsz, n = retrieve_next_token.shape
    dev = retrieve_next_token.device
    idx = torch.arange(n, device=dev).expand(bsz, n)
    nt = retrieve_next_token.long()
    ns = retrieve_next_sibling.long()
    spare = n  # scatter target for "-1" links (column n, dropped)
    parent_of_first = torch.full((bsz, n + 1), -1, dtype=torch.int64, device=dev)
    parent_of_first.scatter_(1, torch.where(nt >= 0, nt, spare), idx)
    prev = torch.full((bsz, n + 1), -1, dtype=torch.int64, device=dev)
    prev.scatter_(1, torch.where(ns >= 0, ns, spare), idx)
    prev = prev[:, :n]
    head = torch.where(prev >= 0, prev, idx)  # pointer to the previous sibling (or self)
    for _ in range(_rounds(n)):
        head = head.gather(1, head)
    return parent_of_first[:, :n].gather(1, head)
