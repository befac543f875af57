"""ModelRunner: turns a scheduled batch into tensors, plans attention, runs the model, samples.

It owns the model, the paged KV cache and the attention plans; the scheduler and block manager
(torch-free) decide what runs and where its KV lives. Eager for now: CUDA-graph capture of decode
steps will replay `forward` over the same fixed plan buffers.
"""

from __future__ import annotations

import torch

from treeverify.engine.kv_cache import KVCache
from treeverify.engine.paged_attention import PagedAttention
from treeverify.engine.sampler import TokenLogprobs, sample
from treeverify.engine.scheduler import ScheduledBatch


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
    def run(self, batch: ScheduledBatch) -> tuple[list[int], list[TokenLogprobs | None]]:
        """One forward over the batch's chunks: a token (and logprobs) per sampled sequence."""
        chunks = batch.chunks
        self.attention.plan(
            torch.tensor(batch.slot_mapping, dtype=torch.int64),
            [c.seq.block_table for c in chunks],
            [c.start for c in chunks],
            batch.query_lens,
        )
        ids = torch.tensor(batch.input_ids, dtype=torch.int64, device=self.device)  # (T,)
        pos = torch.tensor(batch.positions, dtype=torch.int64, device=self.device)  # (T,)
        rows = torch.tensor(batch.sample_indices, dtype=torch.int64, device=self.device)  # (N,)
        logits = self.model(ids, pos, attention=self.attention, logits_indices=rows)  # (N, V)
        return sample(logits, batch.sampled)
