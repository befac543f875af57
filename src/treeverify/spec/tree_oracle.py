"""Host heap version of DDTree Algorithm 1: the literal algorithm, kept as the test oracle.

It reads the same ``draft_topk`` tables as ``build_tree`` and does the heap's arithmetic in numpy
float32 scalars (each ``+``/``-`` is one correctly rounded fp32 operation, as on the device), so a
comparison with ``build_tree`` isolates the tree search.  Not for production: it syncs and loops in
Python.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch
from torch import Tensor

from .tree import DraftTree, draft_topk

__all__ = ["build_tree_host", "build_tree_host_from_topk"]


def build_tree_host(draft_logits: Tensor, budget: int, root_tokens: Tensor) -> DraftTree:
    """Heap version of ``build_tree`` (same arguments, same result, on the host)."""
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    k = min(budget, draft_logits.shape[-1])
    lp, ids = draft_topk(draft_logits, k)
    return build_tree_host_from_topk(lp, ids, budget, root_tokens)


def build_tree_host_from_topk(
    lp: Tensor, ids: Tensor, budget: int, root_tokens: Tensor
) -> DraftTree:
    """Heap version of ``build_tree_from_topk``: ``lp``/``ids`` are ``(B, L, K)`` tables."""
    bsz, n_depth, k = lp.shape
    lp_np = lp.detach().float().cpu().numpy()
    ids_np = ids.detach().long().cpu().numpy()
    roots = root_tokens.detach().long().cpu().numpy()
    n_slots = budget + 1
    tokens = np.zeros((bsz, n_slots), dtype=np.int64)
    parents = np.full((bsz, n_slots), -1, dtype=np.int64)
    depths = np.zeros((bsz, n_slots), dtype=np.int64)
    scores = np.full((bsz, n_slots), -np.inf, dtype=np.float32)
    num_nodes = np.ones(bsz, dtype=np.int64)
    for b in range(bsz):
        tab = lp_np[b]  # (L, K) float32
        tokens[b, 0] = roots[b]
        scores[b, 0] = 0.0
        # Entries: (-logw, ranks, parent, depth, rank, logw).  Ranks tuples are unique, so the
        # comparison never reaches the later fields; -logw makes heapq's min-heap a max-heap.
        seed = tab[0, 0]
        heap = [(-float(seed), (0,), 0, 1, 0, seed)]
        n = 0
        while heap and n < budget:
            _, ranks, parent, depth, rank, logw = heapq.heappop(heap)
            n += 1
            tokens[b, n] = ids_np[b, depth - 1, rank]
            parents[b, n] = parent
            depths[b, n] = depth
            scores[b, n] = logw
            if rank + 1 < k:
                sib = np.float32(np.float32(logw - tab[depth - 1, rank]) + tab[depth - 1, rank + 1])
                heapq.heappush(
                    heap, (-float(sib), ranks[:-1] + (rank + 1,), parent, depth, rank + 1, sib)
                )
            if depth < n_depth:
                child = np.float32(logw + tab[depth, 0])
                heapq.heappush(heap, (-float(child), ranks + (0,), n, depth + 1, 0, child))
        num_nodes[b] = n + 1
    dev = lp.device
    return DraftTree(
        tokens=torch.from_numpy(tokens).to(dev),
        parents=torch.from_numpy(parents).to(dev),
        depths=torch.from_numpy(depths).to(dev),
        num_nodes=torch.from_numpy(num_nodes).to(dev),
        scores=torch.from_numpy(scores).to(dev),
    )
