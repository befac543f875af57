"""ModelRunner: turns a scheduled batch into tensors, plans attention, runs the model, samples.

It owns the model, the paged KV cache and the attention plans; the scheduler and block manager
(torch-free) decide what runs and where its KV lives. Eager for now: CUDA-graph capture of decode
steps will replay `forward` over the same fixed plan buffers.
"""

from __future__ import annotations

import torch

from treeverify.engine import faults
from treeverify.engine.kv_cache import KVCache
from treeverify.engine.paged_attention import PagedAttention
from treeverify.engine.scheduler import ScheduledBatch
from treeverify.engine.speculative import SpecTree


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        cache: KVCache,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_chunk: int,
        attention_backend: str = "torch",
    ):
        self.model, self.cache = model, cache
        self.device = cache.device
        self.attention = PagedAttention(
            cache, max_batch=max_num_seqs, max_chunk=max_chunk,
            max_total_q=max_num_batched_tokens,
            context_length=cache.num_pages * cache.page_size, backend=attention_backend,
        )  # fmt: skip

    @torch.inference_mode()
    def run(
        self, batch: ScheduledBatch, trees: dict[str, SpecTree] | None = None
    ) -> list[torch.Tensor]:
        """One forward over the batch. A decode chunk whose sequence has a speculative tree runs
        the tree's nodes instead (positions P + depth, slots P + i, its ancestor mask).

        Returns per sampled sequence (batch.sampled order) its logits rows: the last token's
        (1, V), or every tree node's (T, V).
        """
        trees = trees or {}
        ids, pos, slots, qlens, masks, rows = [], [], [], [], [], []
        spans = []  # (first logits row, rows) per sampled sequence
        for c in batch.chunks:
            tree = trees.get(c.seq.request_id)
            base = len(ids)
            if tree is None:
                ids += c.token_ids
                pos += list(range(c.start, c.start + c.num_tokens))
                slots += c.slots
                qlens.append(c.num_tokens)
                masks.append(None)
                if c.samples:
                    spans.append((len(rows), 1))
                    rows.append(base + c.num_tokens - 1)
            else:
                n = len(tree.tokens)
                ids += tree.tokens
                pos += [c.start + d for d in tree.depths]
                slots += tree.slots
                qlens.append(n)
                masks.append(tree.mask)
                spans.append((len(rows), n))
                rows += range(base, base + n)
        self.attention.plan(
            torch.tensor(slots, dtype=torch.int64),
            [c.seq.block_table for c in batch.chunks],
            [c.start for c in batch.chunks],
            qlens,
            masks,
        )
        dev = self.device
        logits = self.model(
            torch.tensor(ids, dtype=torch.int64, device=dev),  # (T,)
            torch.tensor(pos, dtype=torch.int64, device=dev),  # (T,)
            attention=self.attention,
            logits_indices=torch.tensor(rows, dtype=torch.int64, device=dev),  # (N,)
        )  # (N, V)
        logits = faults.corrupt_logits(logits, len(batch.chunks))  # no-op unless planted
        return [logits[a : a + n] for a, n in spans]
