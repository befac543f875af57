"""One request's host-side state: tokens, KV progress, pages, finish (torch-free).

KV progress is a single number, ``num_cached_tokens``: the first that many tokens of
``all_token_ids`` have their keys and values in the pool. Everything after it still has to go
through the model ("prefill"); a sequence in decode has exactly one such token, the one it sampled
last. A preempted sequence drops its pages and sets the number back to 0, so resuming it is a
prefill of prompt + generated tokens (recompute-style preemption).

One writer: ``num_cached_tokens`` is read-only; ``mark_cached`` is the only way to change it, and
only the scheduler calls it (what a step computed, a round's accepted nodes, a preemption) and
the block manager's ``fork`` (a child starts with its parent's KV). tests/test_engine_ownership.py
fails on any other write.
"""

from __future__ import annotations

import enum

from .sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, never admitted
    RUNNING = "running"  # admitted: owns pages, scheduled each step
    PREEMPTED = "preempted"  # pages taken back; queued again to re-prefill
    FINISHED = "finished"


FINISH_REASONS = ("stop", "length", "abort")


class Sequence:
    """A request's tokens and its place in the engine.

    ``block_table`` lists the page ids holding this sequence's KV, position p lives in page
    ``block_table[p // page_size]`` at offset ``p % page_size``. ``num_slots`` counts the positions
    the block manager has given a slot (>= ``num_cached_tokens``: the extra are slots scheduled
    this step, or ``num_reserved_slots`` speculative slots awaiting ``commit``). Both are written by
    the block manager only.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        arrival: int = 0,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: prompt_token_ids must not be empty")
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.arrival = arrival  # FIFO rank, assigned by the scheduler on add()
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None  # 'stop' | 'length' | 'abort'
        self._num_cached_tokens = 0  # see num_cached_tokens / mark_cached
        self.block_table: list[int] = []  # page ids, on cpu
        self.num_slots = 0
        self.num_reserved_slots = 0
        self.num_preemptions = 0
        # Set when the sequence stops: the stop token that ended it, or the stop string, its
        # index in the untruncated output text, and the output text with the stop string cut.
        self.stop_token_id: int | None = None
        self.stop_string: str | None = None
        self.stop_text_index: int | None = None
        self.output_text: str | None = None
        # Stop strings are searched only in text not yet searched (plus an overlap of the
        # longest stop minus one): the output text before this many chars held no stop.
        self.stop_scanned_chars = 0

    # ---- token counts ---------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tail_token_ids(self, n: int) -> list[int]:
        """The last `n` of ``all_token_ids`` without building the whole list (a drafter's
        window over a long prompt, every round)."""
        out, prompt = self.output_token_ids, self.prompt_token_ids
        if len(out) >= n:
            return out[len(out) - n :]
        return prompt[max(0, len(prompt) - (n - len(out))) :] + out

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_cached_tokens(self) -> int:
        """Tokens at the front of ``all_token_ids`` whose K/V are in the pool."""
        return self._num_cached_tokens

    def mark_cached(self, n: int) -> None:
        """Set ``num_cached_tokens`` (its only writer; callers: the scheduler, BlockManager.fork).
        ValueError unless 0 <= n <= the tokens known and the slots held."""
        if not isinstance(n, int) or not 0 <= n <= min(self.num_tokens, self.num_slots):
            raise ValueError(f"{self.request_id!r}: num_cached_tokens {n!r} outside 0.."
                             f"{min(self.num_tokens, self.num_slots)} (tokens {self.num_tokens}, "
                             f"slots {self.num_slots})")  # fmt: skip
        self._num_cached_tokens = n

    @property
    def num_uncached_tokens(self) -> int:
        """Tokens still to prefill: those whose KV is not in the pool (1 while decoding)."""
        return self.num_tokens - self.num_cached_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def finish(self, reason: str) -> None:
        if reason not in FINISH_REASONS:
            raise ValueError(f"finish reason must be one of {FINISH_REASONS}, got {reason!r}")
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, cached={self.num_cached_tokens}, "
            f"pages={self.block_table})"
        )
