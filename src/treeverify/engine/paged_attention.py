"""The attention seam of the models, backed by the paged KV cache and tree_attention.

For one step the runner describes each chunk (a prefill chunk or a decode) of the flat batch:
its already-cached prefix length and its pages. Each layer's call writes the chunk's K/V into
the cache and runs `treeverify.kernels.tree_attention` with every chunk as a "tree" that is a
chain (token i sees the prefix and tokens 0..i of its chunk): the same op, masks and kernels a
DDTree verify round uses, so plain decoding exercises the verify path too.
"""

from __future__ import annotations

import math

import torch

from treeverify.engine.kv_cache import KVCache
from treeverify.kernels import tree_attention


def chain_masks(query_lens: list[int], device: torch.device) -> torch.Tensor:
    """(sum(query_lens), W) int32: row i of a chunk sees nodes 0..i of that chunk."""
    words = math.ceil(max(query_lens) / 32)
    rows = []
    for n in query_lens:
        i = torch.arange(n).unsqueeze(1)  # (n, 1)
        j = torch.arange(words * 32).unsqueeze(0)  # (1, W*32)
        rows.append((j <= i).view(n, words, 32).to(torch.int64))
    vis = torch.cat(rows)  # (T, W, 32)
    packed = (vis << torch.arange(32)).sum(-1)  # (T, W)
    return ((packed + 2**31) % 2**32 - 2**31).to(torch.int32).to(device)


class PagedAttention:
    def __init__(
        self,
        cache: KVCache,
        slots: torch.Tensor,  # (T,) int64
        block_tables: list[list[int]],  # per chunk: its page ids
        prefix_lens: list[int],  # per chunk: tokens already cached before this chunk
        query_lens: list[int],  # per chunk: tokens in this step
        backend: str = "torch",
    ):
        dev = cache.device
        self.cache, self.slots, self.backend = cache, slots.to(dev), backend
        width = max(len(t) for t in block_tables)
        table = torch.zeros(len(block_tables), width, dtype=torch.int32)
        for b, pages in enumerate(block_tables):
            table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        self.block_table = table.to(dev)  # (B, max_pages)
        self.prefix_lens = torch.tensor(prefix_lens, dtype=torch.int32, device=dev)  # (B,)
        qo = [0]
        for n in query_lens:
            qo.append(qo[-1] + n)
        self.qo_indptr = torch.tensor(qo, dtype=torch.int32, device=dev)  # (B+1,)
        self.tree_mask = chain_masks(query_lens, dev)  # (T, W)

    def __call__(self, layer, q, k, v, sm_scale, v_head_dim=None):
        kc, vc = self.cache.write(layer, self.slots, k, v)
        return tree_attention(
            q, kc, vc, self.block_table, self.prefix_lens, self.qo_indptr, self.tree_mask,
            sm_scale, v_head_dim=v_head_dim, backend=self.backend,
        )  # fmt: skip
