"""ModelRunner: turns a scheduled batch into tensors, plans attention, runs the model.

It owns the model, the paged KV cache and the attention plans; the scheduler and block manager
(torch-free) decide what runs and where its KV lives. One forward, `run`, serves every step: its
`StepBatch` (engine/step_batch.py) lays out prefill chunks, decodes and speculative trees alike.
A step whose chunks are all decodes (or all speculative trees of one size) replays a captured
CUDA graph of its bucket when graphs were captured (`capture_graphs`); so does a step that is one
request's prefill chunk of at most 512 tokens, padded to its token bucket (`_run_prefill`), and a
step of up to MAX_PREFILL_REPLAYS such chunks (requests arriving together), one replay each
(`_run_prefills`; TREEVERIFY_PREFILL_REPLAYS); any other step (mixed, longer prefills) runs
eagerly over the same attention seam.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from treeverify import env
from treeverify.engine.cuda_graphs import CudaGraphs
from treeverify.engine.kv_cache import KVCache
from treeverify.engine.paged_attention import PagedAttention
from treeverify.engine.scheduler import ScheduledBatch, ScheduledChunk
from treeverify.engine.step_batch import StepBatch, StepLogits, cached_chain, padded_chain
from treeverify.kernels.staging import to_device

if TYPE_CHECKING:
    from treeverify.engine.speculative import TreeBatch


# A step of this many short prefill chunks at most runs as one (1, n) graph replay per chunk: the
# eager forward of a batch of prefills is host-bound (8 prompts of ~150 tokens, 1200 rows: 5.3 ms
# on the H100 in either engine, forty-first session), a replay is ~0.3 ms of device with its
# staging overlapped; beyond ~16 chunks the replays' device time would pass the eager step's.
MAX_PREFILL_REPLAYS = 8


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
        max_context: int | None = None,
    ):
        self.model, self.cache = model, cache
        self.device = cache.device
        # the most tokens a request holds (the model's positions; None: the whole pool): what
        # the attention plans' split grids and the graph stages' page tables are sized for
        self.max_context = max_context
        self.graphs: CudaGraphs | None = None
        # Batch sizes whose bucket-sized attention plans decode-shaped steps use (set on a GPU
        # to the graph buckets, captured or not); empty: the engine's full-capacity plans.
        self.plan_batch_sizes: list[int] = []
        # Token buckets n of one request's prefill chunk run as a padded chain (1, n) through
        # the bucket's graph or plans (set on a GPU: EngineConfig.prefill_graph_sizes).
        self.prefill_sizes: list[int] = []
        # a step of several such chunks: one padded replay each (TREEVERIFY_PREFILL_REPLAYS)
        self.prefill_replays = env.prefill_replays()
        self.hidden: torch.Tensor | None = None  # (T, F) of the last step, when captured
        self.prompt_logits: dict[str, tuple[int, torch.Tensor]] = {}  # see `run`
        self._moe_layers = [m for m in model.modules() if hasattr(m, "n_experts")]
        self.attention = PagedAttention(
            cache, max_batch=max_num_seqs, max_chunk=max_chunk,
            max_total_q=max_num_batched_tokens,
            context_length=cache.num_pages * cache.page_size, backend=attention_backend,
            split_context=max_context,
        )  # fmt: skip

    def capture_graphs(self, buckets: list[tuple[int, int]]) -> list[dict]:
        """Capture the decode (and tree) forwards per (batch, tokens) bucket (stages as
        `staged_buckets` makes them); GraphCaptureError on failure."""
        self.graphs = self.staged_buckets(buckets)
        moe = self._moe_impl("graph")  # sync-free MoE routing inside the graphs
        try:
            return self.graphs.capture()
        finally:
            self._moe_impl(moe)  # eager steps (prefill) route as before

    def staged_buckets(self, buckets: list[tuple[int, int]]) -> CudaGraphs:
        """The buckets' CudaGraphs, nothing captured yet: each bucket's stage holds the pages a
        request of `max_context` tokens can need (None: the whole pool). (The CPU's eager whole
        rounds use its stages without ever capturing.)"""
        pages = None
        if self.max_context is not None:
            largest = max(n for _, n in buckets)  # a round reserves its tree past the context
            pages = -(-(self.max_context + largest) // self.cache.page_size) + 1
        prefill = tuple(n for n in self.prefill_sizes if (1, n) in buckets)
        return CudaGraphs(self.model, self.attention, buckets=buckets, max_pages=pages,
                          prefill=prefill)  # fmt: skip

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

    def _prefill_sizes(self, batch: ScheduledBatch, tb: TreeBatch | None,
                       prompt_from: dict[str, int] | None) -> list[int] | None:  # fmt: skip
        """Per chunk its token bucket n, for a step whose every chunk is a prefill chunk of
        2..n tokens (no prompt logprobs asked: those need every row; no decodes or trees) and
        that has one chunk, or up to MAX_PREFILL_REPLAYS with `prefill_replays`; else None."""
        chunks = batch.chunks
        if tb is not None or not self.prefill_sizes or not chunks:
            return None
        if len(chunks) > (MAX_PREFILL_REPLAYS if self.prefill_replays else 1):
            return None
        sizes = []
        for c in chunks:
            if c.num_tokens < 2 or (prompt_from and c.seq.request_id in prompt_from):
                return None
            n = next((n for n in self.prefill_sizes if n >= c.num_tokens), None)
            if n is None:
                return None
            sizes.append(n)
        return sizes

    def _run_prefills(self, chunks: list[ScheduledChunk], sizes: list[int]) -> StepLogits:
        """Prefill chunks one padded chain each (`_run_prefill`, in the step's order): each
        replay's logits row and hidden rows copied out before the next replay reuses the graph's
        buffers; `hidden` then holds every chunk's real rows in order, as one forward's would."""
        if len(chunks) == 1:
            return self._run_prefill(chunks[0], sizes[0])
        sampled = sum(c.samples for c in chunks)
        logits = hidden = None  # (sampled, V), (T, F): made at the first replay's shapes
        spans, at = [], 0
        for c, n in zip(chunks, sizes, strict=True):
            out = self._run_prefill(c, n)  # (1, V) logits, or (0, V) for a chunk that samples not
            if logits is None:
                logits = out.logits.new_empty(sampled, out.logits.shape[-1])
            if c.samples:
                logits[len(spans)].copy_(out.logits[0])
                spans.append((len(spans), 1))
            if self.hidden is not None:  # (P, F): a view of the graph's buffer
                if hidden is None:
                    total = sum(x.num_tokens for x in chunks)
                    hidden = self.hidden.new_empty(total, self.hidden.shape[-1])
                hidden[at : at + c.num_tokens].copy_(self.hidden)
                at += c.num_tokens
        self.hidden = hidden
        return StepLogits(logits, spans)

    def _run_prefill(self, c: ScheduledChunk, n: int) -> StepLogits:
        """One request's prefill chunk of P <= n tokens as a chain of n rows, padded (see
        StepStage.write_prefill): its bucket's graph when captured, else eagerly over the same
        bucket plans and padded rows, so graphs on or off give the same numbers. The logits are
        the last real row's; `hidden` the real rows'."""
        p, bucket = c.num_tokens, (1, n)
        graphs, table = self.graphs, c.seq.block_table
        if graphs is not None and graphs.bucket_for(1, n, [table]) == bucket:
            graphs.stages[bucket].write_prefill(c.token_ids, c.start, c.slots, table)
            logits = graphs.replay(bucket, 1)  # (1, V)
        else:
            dev = self.device
            ids, pos, slots, valid = padded_chain(
                c.token_ids, c.start, c.slots, n, self.cache.scratch_slot
            )  # (n,) each
            self.attention.select(bucket)
            self.attention.plan(slots, [table], [c.start], [n], mask=cached_chain(n))
            moe = self._moe_impl("graph" if dev.type == "cuda" else None)
            try:
                logits = self.model(to_device(ids, dev), to_device(pos, dev),
                                    attention=self.attention,
                                    logits_indices=to_device(torch.tensor([p - 1]), dev),
                                    token_valid=to_device(valid, dev))  # fmt: skip
            finally:
                self._moe_impl(moe)
        hidden = getattr(self.model, "captured", None)
        self.hidden = None if hidden is None else hidden[:p]
        return StepLogits(logits if c.samples else logits[:0], [(0, 1)] if c.samples else [])

    def _replay_decodes(self, batch: ScheduledBatch) -> StepLogits | None:
        """A step of plain decodes only (one sampled token per chunk: no prompt logprob rows
        either) that a captured bucket holds: its inputs straight from the scheduler's chunks
        into the bucket's stage, one copy, one replay. None: not such a step."""
        chunks = batch.chunks
        if not chunks or any(c.num_tokens != 1 or not c.samples for c in chunks):
            return None
        tables = [c.seq.block_table for c in chunks]
        bucket = self.graphs.bucket_for(len(chunks), 1, tables)
        if bucket is None:
            return None
        self.graphs.stages[bucket].write_decodes([c.token_ids[0] for c in chunks],
                                                 [c.start for c in chunks],
                                                 [c.slots[0] for c in chunks], tables)  # fmt: skip
        return self._replay(bucket, len(chunks))

    def _replay_round(self, batch: ScheduledBatch, tb: TreeBatch) -> StepLogits | None:
        """A step that is one speculative round for every chunk, in the TreeBatch's order: the
        trees (ids, mask on the device; slots from the host) go straight into the bucket's stage
        (positions = prefix + depth, computed there). None: not such a step."""
        chunks, n = batch.chunks, tb.nodes
        if len(chunks) != len(tb.seqs) or any(c.seq is not s for c, s in
                                              zip(chunks, tb.seqs, strict=True)):  # fmt: skip
            return None
        tables = [c.seq.block_table for c in chunks]
        bucket = self.graphs.bucket_for(len(chunks), n, tables)
        if bucket is None or tb.slots_host is None:
            return None
        stage = self.graphs.stages[bucket]
        stage.write_device_step([c.start for c in chunks], tables, tb.tokens, tb.slots_host,
                                tb.mask, depths=tb.depths)  # fmt: skip
        if tb.slots is None:  # the accept's K/V move reads the staged copy (this round's)
            tb.slots = stage.views["slots"][: len(chunks) * n].view(len(chunks), n)
        return self._replay(bucket, len(chunks))

    def _replay(self, bucket: tuple[int, int], batch: int) -> StepLogits:
        """Replay a bucket whose stage holds this step: `batch` requests of n rows, each row a
        logits row, in order."""
        n = bucket[1]
        logits = self.graphs.replay(bucket, batch)  # (batch * n, V)
        self.hidden = getattr(self.model, "captured", None)
        return StepLogits(logits, [(i * n, n) for i in range(batch)])

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
    def run(
        self,
        batch: ScheduledBatch,
        tb: TreeBatch | None = None,
        prompt_from: dict[str, int] | None = None,
    ) -> StepLogits:
        """One forward over the batch, whatever it mixes: prefill chunks, plain decodes, and the
        speculative trees of `tb` (each in its sequence's decode chunk's place: positions
        P + depth, slots P + i, its ancestor mask; built on the device, never copied to the host).
        A decode-shaped step (every chunk one token, or every chunk a tree of one size) replays
        its bucket's graph when one was captured, else runs eagerly with the bucket's plans.

        Returns the logits rows per sampled sequence (`StepLogits.spans`, batch.sampled order):
        the last token's, or every tree node's; for a step of trees only, `logits` is (B*N, V) in
        `tb` order. `self.hidden` then holds the model's captured layer outputs for every token
        of the step (T, F), or None. `prompt_from` maps a request id to the first prompt position
        whose logits it still needs (prompt logprobs): the rows of its chunk from there that
        predict a prompt token land in `self.prompt_logits` {request id: (first position,
        (M, V) logits)}.
        """
        self.prompt_logits: dict[str, tuple[int, torch.Tensor]] = {}
        sizes = self._prefill_sizes(batch, tb, prompt_from)
        if sizes is not None:
            return self._run_prefills(batch.chunks, sizes)
        if self.graphs is not None:
            staged = self._replay_decodes(batch) if tb is None else self._replay_round(batch, tb)
            if staged is not None:
                return staged
        step = StepBatch.build(batch, tb, self.device, prompt_from)
        qlens, dev = step.query_lens, self.device
        bucket = None
        if step.decode_shaped and self.graphs is not None:  # decodes were staged above: trees
            bucket = self.graphs.bucket_for(len(qlens), qlens[0], step.block_tables)
        if bucket is not None:  # every token is a logits row, in order
            self.graphs.stages[bucket].write_device_step(
                step.prefix_lens, step.block_tables, step.ids, step.slots, step.mask,
                pos=step.positions)  # fmt: skip
            logits = self.graphs.replay(bucket, len(qlens))
            self.hidden = getattr(self.model, "captured", None)
            return StepLogits(logits, step.spans)
        self.attention.select(self._plan_bucket(len(qlens), qlens[0])
                              if step.decode_shaped else None)  # fmt: skip
        self.attention.plan(step.slots, step.block_tables, step.prefix_lens, qlens,
                            mask=step.mask)  # fmt: skip
        # On a GPU an eager decode-shaped step routes MoE as the captured graphs do, so turning
        # graphs off changes no kernel choice but the padding.
        moe = self._moe_impl("graph" if dev.type == "cuda" and step.decode_shaped else None)
        rows = step.logits_rows
        try:
            logits = self.model(
                step.ids,
                step.positions,
                attention=self.attention,  # (T,), (T,)
                logits_indices=None
                if rows is None
                else to_device(torch.tensor(rows, dtype=torch.int64), dev),  # (R,)
            )  # (R, V)
        finally:
            self._moe_impl(moe)
        self.hidden = getattr(self.model, "captured", None)
        self.prompt_logits = {rid: (p, logits[a : a + n]) for rid, p, a, n in step.prompt_spans}
        return StepLogits(logits, step.spans)
