"""ModelRunner: turns a scheduled batch into tensors, plans attention, runs the model, samples.

It owns the model, the paged KV cache and the attention plans; the scheduler and block manager
(torch-free) decide what runs and where its KV lives. A step whose chunks are all decodes (or all
speculative trees of one size) replays a captured CUDA graph of its bucket when graphs were
captured (`capture_graphs`); any other step (prefill, mixed) runs eagerly over the same
attention seam.
"""

from __future__ import annotations

import torch

from treeverify.engine.cuda_graphs import CudaGraphs
from treeverify.engine.kv_cache import KVCache
from treeverify.engine.paged_attention import PagedAttention
from treeverify.engine.scheduler import ScheduledBatch
from treeverify.engine.speculative import SpecTree
from treeverify.kernels.staging import to_device


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
        self.graphs: CudaGraphs | None = None
        # Batch sizes whose bucket-sized attention plans decode-shaped steps use (set on a GPU
        # to the graph buckets, captured or not); empty: the engine's full-capacity plans.
        self.plan_batch_sizes: list[int] = []
        self.hidden: torch.Tensor | None = None  # (T, F) of the last step, when captured
        self.prompt_logits: dict[str, tuple[int, torch.Tensor]] = {}  # see `run`
        self._moe_layers = [m for m in model.modules() if hasattr(m, "n_experts")]
        self.attention = PagedAttention(
            cache, max_batch=max_num_seqs, max_chunk=max_chunk,
            max_total_q=max_num_batched_tokens,
            context_length=cache.num_pages * cache.page_size, backend=attention_backend,
        )  # fmt: skip

    def capture_graphs(self, buckets: list[tuple[int, int]]) -> list[dict]:
        """Capture the decode (and tree) forwards per (batch, tokens) bucket; GraphCaptureError
        on failure."""
        self.graphs = CudaGraphs(self.model, self.attention, buckets=buckets)
        moe = self._moe_impl("graph")  # sync-free MoE routing inside the graphs
        try:
            return self.graphs.capture()
        finally:
            self._moe_impl(moe)  # eager steps (prefill) route as before

    @torch.inference_mode()
    def prepare_plans(self, buckets: list[tuple[int, int]]) -> None:
        """Without graphs: make every bucket's plans now (one dummy forward each), so no request
        pays for kernel loading or plan allocation."""
        moe = self._moe_impl("graph")
        try:
            for b, n in buckets:
                self.attention.select((b, n))
                self.attention.plan_scratch(b, n)
                zeros = torch.zeros(b * n, dtype=torch.int64, device=self.device)
                self.model(zeros, zeros, attention=self.attention, token_valid=zeros.bool())
        finally:
            self._moe_impl(moe)
            self.attention.select(None)

    def _plan_bucket(self, batch: int, n: int) -> tuple[int, int] | None:
        """The attention plan an eager decode-shaped step uses: the graph bucket's own (same
        split-KV layout, so graphs on and off give the same numbers), when one would hold it."""
        b = next((s for s in self.plan_batch_sizes if s >= batch), None)
        if b is None or b * n > self.attention.max_total_q or n > self.attention.max_chunk:
            return None
        return (b, n)

    @staticmethod
    def _decode_shaped(batch: ScheduledBatch, qlens: list[int], trees) -> bool:
        """Every chunk one sampled decode, or every chunk a tree of the same size."""
        if not batch.chunks or any(q != qlens[0] for q in qlens):
            return False
        if not all(c.samples for c in batch.chunks):
            return False
        return qlens[0] == 1 or len(trees) == len(batch.chunks)

    def _bucket(self, batch: ScheduledBatch, qlens: list[int], trees) -> tuple[int, int] | None:
        """A captured bucket for this step, or None (eager)."""
        if self.graphs is None or not self._decode_shaped(batch, qlens, trees):
            return None
        return self.graphs.bucket_for(len(batch.chunks), qlens[0])

    def _moe_impl(self, impl: str | None) -> str | None:
        """Set the MoE layers' impl (None: leave it); returns the previous one to restore."""
        layers = self._moe_layers
        if impl is None or not layers:
            return None
        before = layers[0].impl
        for m in layers:
            m.impl = impl
        return before

    @torch.inference_mode()
    def run_trees(self, batch: ScheduledBatch, tb) -> torch.Tensor:
        """A step whose every chunk is a speculating sequence's tree (`TreeBatch`, device
        tensors): no host copy of the trees. Returns logits (B*N, V) for every node."""
        b, n = tb.tokens.shape
        starts = [c.start for c in batch.chunks]
        pos = (to_device(torch.tensor(starts), self.device)[:, None] + tb.depths).reshape(
            -1
        )  # (B*N,)
        ids = tb.tokens.reshape(-1)  # (B*N,)
        bucket = None if self.graphs is None else self.graphs.bucket_for(b, n)
        self.attention.select(bucket or self._plan_bucket(b, n))
        self.attention.plan(tb.slots.reshape(-1), [c.seq.block_table for c in batch.chunks],
                            starts, [n] * b, mask=tb.mask)  # fmt: skip
        if bucket is not None:
            logits = self.graphs.replay(bucket, ids, pos)
        else:
            moe = self._moe_impl("graph" if self.device.type == "cuda" else None)
            try:
                logits = self.model(ids, pos, attention=self.attention)  # (B*N, V)
            finally:
                self._moe_impl(moe)
        self.hidden = getattr(self.model, "captured", None)
        return logits

    @torch.inference_mode()
    def run(
        self,
        batch: ScheduledBatch,
        trees: dict[str, SpecTree] | None = None,
        prompt_from: dict[str, int] | None = None,
    ) -> list[torch.Tensor]:
        """One forward over the batch. A decode chunk whose sequence has a speculative tree runs
        the tree's nodes instead (positions P + depth, slots P + i, its ancestor mask).

        Returns per sampled sequence (batch.sampled order) its logits rows: the last token's
        (1, V), or every tree node's (T, V). `self.hidden` then holds the model's captured layer
        outputs for every token of the step (T, F), or None. `prompt_from` maps a request id to
        the first prompt position whose logits it still needs (prompt logprobs): the rows of its
        chunk from there that predict a prompt token land in `self.prompt_logits`
        {request id: (first position, (M, V) logits)}.
        """
        trees = trees or {}
        prompt_from = prompt_from or {}
        self.prompt_logits: dict[str, tuple[int, torch.Tensor]] = {}
        ids, pos, slots, qlens, masks, rows = [], [], [], [], [], []
        spans = []  # (first logits row, rows) per sampled sequence
        prompt_spans = []  # (request id, first position, first logits row, rows)
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
                rid = c.seq.request_id
                if rid in prompt_from:  # position p predicts prompt token p + 1
                    lo = max(c.start, prompt_from[rid])
                    hi = min(c.start + c.num_tokens, c.seq.num_prompt_tokens - 1)
                    if hi > lo:
                        prompt_spans.append((rid, lo, len(rows), hi - lo))
                        rows += range(base + lo - c.start, base + hi - c.start)
            else:
                n = len(tree.tokens)
                ids += tree.tokens
                pos += [c.start + d for d in tree.depths]
                slots += tree.slots
                qlens.append(n)
                masks.append(tree.mask)
                spans.append((len(rows), n))
                rows += range(base, base + n)
        bucket = self._bucket(batch, qlens, trees)
        decode = self._decode_shaped(batch, qlens, trees)
        self.attention.select(bucket or (self._plan_bucket(len(qlens), qlens[0]) if decode
                                         else None))  # fmt: skip
        self.attention.plan(
            torch.tensor(slots, dtype=torch.int64),
            [c.seq.block_table for c in batch.chunks],
            [c.start for c in batch.chunks],
            qlens,
            masks,
        )
        dev = self.device
        if bucket is not None:  # every token is a logits row, in order (decodes: no prompt rows)
            logits = self.graphs.replay(bucket, to_device(torch.tensor(ids), dev),
                                        to_device(torch.tensor(pos), dev))  # fmt: skip
            self.hidden = getattr(self.model, "captured", None)
            return [logits[a : a + n] for a, n in spans]
        # On a GPU an eager decode routes MoE as the captured graphs do, so turning graphs off
        # changes no kernel choice but the padding.
        moe = self._moe_impl("graph" if dev.type == "cuda" and self._decode_shaped(
            batch, qlens, trees) else None)  # fmt: skip
        try:
            logits = self.model(
                to_device(torch.tensor(ids, dtype=torch.int64), dev),  # (T,)
                to_device(torch.tensor(pos, dtype=torch.int64), dev),  # (T,)
                attention=self.attention,
                logits_indices=to_device(torch.tensor(rows, dtype=torch.int64), dev),  # (N,)
            )  # (N, V)
        finally:
            self._moe_impl(moe)
        self.hidden = getattr(self.model, "captured", None)
        self.prompt_logits = {rid: (p, logits[a : a + n]) for rid, p, a, n in prompt_spans}
        return [logits[a : a + n] for a, n in spans]
