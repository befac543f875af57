"""What both GPU backends' eager entries need before launching: the call's bucket and buffers.

An eager call (no plan) sizes its grid from the arguments themselves, so it reads the largest tree
and the longest key range to the host (a sync, fine outside capture), and allocates `out` (when
not given) and the split-KV workspace for this one call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

V = TypeVar("V")
MAX_CACHED_LAUNCHERS = 64  # eager calls key launchers by their sizes: keep the recent ones only


def cached(cache: OrderedDict, key: tuple, make: Callable[[], V]) -> V:
    """`cache[key]`, made on a miss; least recently used entries beyond the limit are dropped
    (eager sizes vary call to call, so an unbounded dict would grow for the process's life)."""
    value = cache.get(key)
    if value is None:
        value = cache[key] = make()
        if len(cache) > MAX_CACHED_LAUNCHERS:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return value


@dataclass(frozen=True)
class EagerBucket:
    mla: bool
    dv: int
    batch: int
    max_tree: int  # largest T_b
    max_kv: int  # largest P_b + T_b
    total_q: int


def eager_bucket(
    q: torch.Tensor,  # (total_q, Hq, Dqk)
    v_cache: torch.Tensor | None,
    v_head_dim: int | None,
    prefix_lens: torch.Tensor,  # (B,)
    qo_indptr: torch.Tensor,  # (B+1,)
) -> EagerBucket:
    mla = v_cache is None
    tree = (qo_indptr[1:] - qo_indptr[:-1]).to(torch.int64)  # (B,)
    return EagerBucket(
        mla=mla,
        dv=v_head_dim if mla else v_cache.shape[-1],
        batch=prefix_lens.shape[0],
        max_tree=int(tree.max().item()),
        max_kv=int((prefix_lens.to(torch.int64) + tree).max().item()),
        total_q=q.shape[0],
    )


def eager_out(q: torch.Tensor, dv: int, out: torch.Tensor | None) -> torch.Tensor:
    """`out` as given, or new (total_q, Hq, Dv) in q's dtype."""
    if out is None:
        out = torch.empty(q.shape[0], q.shape[1], dv, dtype=q.dtype, device=q.device)
    return out


def eager_buffers(
    q: torch.Tensor, dv: int, out: torch.Tensor | None, workspace_shapes: tuple[tuple, tuple]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, partial O, partial LSE): `out` as `eager_out` gives it, new fp32 partials."""
    out = eager_out(q, dv, out)
    o_shape, lse_shape = workspace_shapes
    part_o = torch.empty(o_shape, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    return out, part_o, part_lse
