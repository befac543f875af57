"""Continuous batching: which sequences run this step, with how many tokens (torch-free).

One step is ``batch = schedule()``, the model runs ``batch``, ``postprocess(batch, tokens)``.

Policy (deterministic; priority is arrival order, FIFO, everywhere):
1. **Decode first.** Every running sequence with one token left (a decode) gets a slot, oldest
   first, one token of budget each: decodes keep inter-token latency flat.
2. **Prefills in progress** (chunked prefill) then take chunks of up to ``chunked_prefill_size``
   tokens from what is left of the ``max_num_batched_tokens`` budget, oldest first.
3. **Admission**: waiting sequences (new, or preempted and waiting to re-prefill) are admitted in
   arrival order while ``max_num_seqs``, the budget and the free pages allow; the first that does
   not fit stops admission (no overtaking). Admission never preempts.
4. **Preemption** (recompute): when a running sequence needs a page and none is free, the newest
   running sequence is preempted (its pages freed, its slot in this batch dropped, status
   PREEMPTED, back to the waiting queue in arrival order, which puts it ahead of every new
   request); if the one in need is itself the newest, it is the one preempted. An older sequence
   is never preempted for a newer one, so the oldest always progresses: no livelock. A sequence
   whose prompt + max_tokens exceeds the whole pool is refused at ``add``.

A chunk of n tokens covers positions ``[num_cached_tokens, num_cached_tokens + n)``; when it
reaches the end of the sequence, the model's last logits sample the next token (``samples``).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first position of the chunk
    num_tokens: int
    slots: list[int]  # KV slot of each position, on cpu
    # Whether the chunk reaches the sequence's last known token, so a token is sampled after it
    # (fixed when scheduled: postprocess appends tokens afterwards).
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_tokens == self.seq.num_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.seq.all_token_ids[self.start : self.start + self.num_tokens]


@dataclass
class ScheduledBatch:
    decodes: list[ScheduledChunk] = field(default_factory=list)
    prefills: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.decodes) + sum(c.num_tokens for c in self.prefills)

    @property
    def sampled(self) -> list[Sequence]:
        """Sequences that get a new token this step, in the order ``postprocess`` expects."""
        return [c.seq for c in self.chunks if c.samples]

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills

    # ---- flat views for the model runner (chunk order: decodes, then prefills) ----------------
    @property
    def input_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]

    @property
    def positions(self) -> list[int]:
        return [p for c in self.chunks for p in range(c.start, c.start + c.num_tokens)]

    @property
    def slot_mapping(self) -> list[int]:
        return [s for c in self.chunks for s in c.slots]

    @property
    def query_lens(self) -> list[int]:
        return [c.num_tokens for c in self.chunks]

    @property
    def context_lens(self) -> list[int]:
        """KV length each chunk attends to (its own tokens included)."""
        return [c.start + c.num_tokens for c in self.chunks]

    @property
    def sample_indices(self) -> list[int]:
        """Index in the flat token list of each sampled chunk's last token (its logits row)."""
        out, end = [], 0
        for c in self.chunks:
            end += c.num_tokens
            if c.samples:
                out.append(end - 1)
        return out

    def _drop(self, seq: Sequence) -> None:
        self.decodes = [c for c in self.decodes if c.seq is not seq]
        self.prefills = [c for c in self.prefills if c.seq is not seq]


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        chunked_prefill_size: int | None = None,
        eos_token_id: int | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
        eos_token_ids: Iterable[int] = (),  # every EOS id (config + generation_config)
    ) -> None:
        for name, v in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
        ):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if chunked_prefill_size is not None and (
            not isinstance(chunked_prefill_size, int) or chunked_prefill_size < 1
        ):
            raise ValueError(
                f"chunked_prefill_size must be None or an int >= 1, got {chunked_prefill_size!r}"
            )
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill_size = chunked_prefill_size or max_num_batched_tokens
        self.eos_token_ids = frozenset(eos_token_ids) | (
            frozenset() if eos_token_id is None else {eos_token_id}
        )
        self.detokenize = detokenize
        self.waiting: list[Sequence] = []  # sorted by arrival
        self.running: list[Sequence] = []  # sorted by arrival
        self._by_id: dict[str, Sequence] = {}
        self._next_arrival = 0
        self._in_flight: ScheduledBatch | None = None

    # ---- requests --------------------------------------------------------------------------
    def add(self, seq: Sequence) -> Sequence:
        if seq.request_id in self._by_id:
            raise ValueError(f"request id {seq.request_id!r} is already in the scheduler")
        if seq.status is not SequenceStatus.WAITING or seq.output_token_ids:
            raise ValueError(f"{seq.request_id!r}: only a fresh WAITING sequence can be added")
        sp = seq.sampling_params
        if sp.stop and self.detokenize is None:
            raise ValueError(
                f"{seq.request_id!r}: stop strings {sp.stop!r} need the scheduler's detokenize"
            )
        need = seq.num_prompt_tokens + sp.max_tokens - 1  # the last token never needs KV
        cap = self.block_manager.capacity_tokens
        if need > cap:
            raise ValueError(
                f"{seq.request_id!r}: prompt ({seq.num_prompt_tokens}) + max_tokens "
                f"({sp.max_tokens}) needs {need} KV slots, the pool has {cap}"
            )
        seq.arrival = self._next_arrival
        self._next_arrival += 1
        self._by_id[seq.request_id] = seq
        self.waiting.append(seq)
        return seq

    def get(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def may_admit(self) -> bool:
        """Whether the next step may admit a waiting request (one waits and a running slot is
        free; pages permitting): a step launched ahead of it would likely be discarded."""
        return bool(self.waiting) and len(self.running) < self.max_num_seqs

    def abort(self, request_id: str) -> bool:
        """Finish a request with reason 'abort' and free its pages; False if not in flight."""
        seq = self._by_id.pop(request_id, None)
        if seq is None:
            return False
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if self.block_manager.owns(seq):
            self.block_manager.free(seq)
        seq.finish("abort")
        return True

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        if self._in_flight is not None:
            raise RuntimeError("schedule() called again before postprocess() of the last batch")
        batch = self._in_flight = ScheduledBatch()
        bm = self.block_manager
        # the token budget left, kept as chunks are added (recounted after a preemption, which
        # may drop a chunk already scheduled): not re-summed per sequence, O(n^2) a step
        budget = self.max_num_batched_tokens
        # 1. decodes, oldest first
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or seq.num_uncached_tokens != 1:
                continue
            if budget < 1:
                break
            preempted = len(batch.preempted)
            if self._make_room(seq, 1, batch):
                batch.decodes.append(self._chunk(seq, 1))
            budget = self._budget(batch) if len(batch.preempted) != preempted else budget - 1
        # 2. prefills in progress, oldest first
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or seq.num_uncached_tokens <= 1:
                continue
            n = min(seq.num_uncached_tokens, self.chunked_prefill_size, self._budget(batch))
            if n < 1:
                break
            if self._make_room(seq, n, batch):
                batch.prefills.append(self._chunk(seq, n))
        # 3. admission, FIFO, no overtaking, no preemption
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq in batch.preempted:
                break
            n = min(seq.num_uncached_tokens, self.chunked_prefill_size, self._budget(batch))
            if n < 1 or not bm.can_allocate(seq, n):
                break
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_arrival)
            batch.prefills.append(ScheduledChunk(seq, 0, n, bm.allocate(seq, n)))
        return batch

    def discard_in_flight(self) -> None:
        """Drop the batch `schedule()` handed out when the model run for it failed."""
        self._in_flight = None

    def postprocess(
        self,
        batch: ScheduledBatch,
        new_tokens: Iterable[int | list[int]],
        kv_ahead: Iterable[int] | None = None,
    ) -> list[Sequence]:
        """Record the step: KV written, sampled tokens appended, stops applied.

        ``new_tokens`` has one entry per ``batch.sampled`` sequence, in that order: a token id, or
        a list of them (a speculative round's accepted tokens). ``kv_ahead`` (default all 0), in
        the same order: how many of those new tokens already have their K/V in the pool (a
        round's accepted nodes, moved in place: len(tokens) - 1; the bonus never has). Returns
        the sequences that finished in this step (their pages are freed).

        With ``_preempt``, the only place ``num_cached_tokens`` changes (``Sequence.mark_cached``).
        """
        if batch is not self._in_flight:
            raise ValueError("postprocess: this batch is not the one schedule() last returned")
        new_tokens = list(new_tokens)
        sampled = batch.sampled
        if len(new_tokens) != len(sampled):
            raise ValueError(
                f"postprocess: {len(new_tokens)} token entries for {len(sampled)} sampled sequences"
            )
        ahead = [0] * len(sampled) if kv_ahead is None else list(kv_ahead)
        if len(ahead) != len(sampled):
            raise ValueError(f"postprocess: kv_ahead has {len(ahead)} entries for "
                             f"{len(sampled)} sampled sequences")  # fmt: skip
        self._in_flight = None
        for c in batch.chunks:
            if c.seq.status is SequenceStatus.RUNNING:  # skip sequences aborted meanwhile
                c.seq.mark_cached(c.start + c.num_tokens)
        finished = []
        for seq, toks, kv in zip(sampled, new_tokens, ahead, strict=True):
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if seq.sampling_params.max_tokens == 0:  # the prompt only (its logprobs): keep none
                seq.output_text = ""
                seq.finish("length")
            for tok in [] if seq.is_finished else [toks] if isinstance(toks, int) else list(toks):
                seq.output_token_ids.append(tok)
                if self._check_stop(seq, tok):
                    break
            if seq.is_finished:
                self.running.remove(seq)
                self.block_manager.free(seq)
                del self._by_id[seq.request_id]
                finished.append(seq)
            elif kv:
                seq.mark_cached(seq.num_cached_tokens + kv)
        return finished

    # ---- internals -------------------------------------------------------------------------
    def _budget(self, batch: ScheduledBatch) -> int:
        return self.max_num_batched_tokens - batch.num_tokens

    def _chunk(self, seq: Sequence, n: int) -> ScheduledChunk:
        return ScheduledChunk(
            seq, seq.num_cached_tokens, n, self.block_manager.append_slots(seq, n)
        )

    def _make_room(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Preempt newer sequences until ``seq`` fits n more slots; False if ``seq`` itself went."""
        while not self.block_manager.can_allocate(seq, n):
            victim = self.running[-1]
            self._preempt(victim, batch)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        batch._drop(seq)
        self.block_manager.free(seq)
        self.running.remove(seq)
        seq.mark_cached(0)
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=_arrival)
        batch.preempted.append(seq)

    def _check_stop(self, seq: Sequence, tok: int) -> bool:
        """Finish ``seq`` if its newest token ``tok`` ends it; True if it did."""
        sp = seq.sampling_params
        if tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self.eos_token_ids):
            seq.stop_token_id = tok
            if self.detokenize is not None:
                seq.output_text = self.detokenize(seq.output_token_ids[:-1])
            seq.finish("stop")
            return True
        if sp.stop:
            text = self.detokenize(seq.output_token_ids)
            # Only the new tail: a stop ending in the new text starts at most longest-1 chars
            # before it. A trailing U+FFFD (a character still incomplete) is searched again.
            start = max(0, seq.stop_scanned_chars - max(map(len, sp.stop)) + 1)
            seq.stop_scanned_chars = len(text.rstrip("\ufffd"))
            hits = [(i, s) for s in sp.stop if (i := text.find(s, start)) >= 0]
            if hits:
                seq.stop_text_index, seq.stop_string = min(hits)
                seq.output_text = text[: seq.stop_text_index]
                seq.finish("stop")
                return True
        if seq.num_output_tokens >= sp.max_tokens:
            if self.detokenize is not None:
                seq.output_text = self.detokenize(seq.output_token_ids)
            seq.finish("length")
            return True
        return False


def _arrival(seq: Sequence) -> int:
    return seq.arrival
