"""What the two launched-ahead paths share (engine/round_graphs.py's whole rounds and
engine/decode_ahead.py's plain greedy steps): a launched step's result on its way to the host,
finding this step's sequences among a launched step's, and the bookkeeping of the one step in
flight (its held pages, its counters).

A step launched ahead wrote its K/V at slots in pages held for it (`BlockManager.hold`); when the
engine step goes another way it is discarded: its device work still runs, nothing it wrote is
read, and the hold is all there is to give back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from treeverify.engine.block_manager import BlockManager
from treeverify.engine.sequence import Sequence


@dataclass
class Launched:
    """A launched step: its packed result, copied to the host as soon as the step ends."""

    host: torch.Tensor  # (b, ...) int64, pinned on a GPU
    done: torch.cuda.Event | None  # recorded after the copy (None on the CPU: eager, done)
    # a plain step's (b, F) tapped hidden states for a DFlash drafter (engine/decode_ahead.py),
    # copied right after its replay, before the next one overwrites the graph's output
    hidden: torch.Tensor | None = None
    # or, with the DFlash context's feed ring (engine/feed_ring.py), the id of its first row there
    ring_first: int | None = None

    def rows(self, n: int) -> list:
        if self.done is not None:
            self.done.synchronize()  # this step only: a step launched after it keeps running
        return self.host[:n].tolist()


def positions_in(launched: list[Sequence], seqs: list[Sequence]) -> list[int] | None:
    """Where each of `seqs` is among the sequences of a step launched ahead, when all are, in
    its order (the scheduler keeps arrival order); else None."""
    at = {id(s): i for i, s in enumerate(launched)}
    pick = [at.get(id(s), -1) for s in seqs]
    return pick if seqs and -1 not in pick and pick == sorted(pick) else None


class LaunchAhead:
    """The one step in flight (any object with `seqs`, a row's sequence or None for a hole,
    engine/decode_ahead.py) and its counters; `bm` holds its pages."""

    bm: BlockManager

    def _init_in_flight(self) -> None:
        self._in_flight: Any = None
        self.ahead_used = 0  # steps launched ahead and consumed by the next engine step
        self.ahead_discarded = 0  # ... thrown away (the step went another way)
        self.ahead_partial = 0  # ... consumed by the requests of it still running

    @property
    def in_flight(self) -> Any:
        """The step launched ahead, not yet consumed (None when there is none)."""
        return self._in_flight

    def discard(self) -> None:
        """Throw the step launched ahead away (the engine step went another way): release the
        pages held for it. Its device work still runs; nothing it wrote is read."""
        fl, self._in_flight = self._in_flight, None
        if fl is None:
            return
        self.ahead_discarded += 1
        for seq in fl.seqs:
            if seq is not None:  # (a hole: engine/decode_ahead.py's rows of finished requests)
                self.bm.release_hold(seq)  # (a finished or aborted one was freed whole already)

    def _hold(self, seqs: list[Sequence], upto: list[int], max_pages: int) -> bool:
        """Hold each sequence's pages for positions below upto[i] (where a step launched ahead
        writes, or looks a slot up), all or nothing: False, nothing held, when the free pages or
        a staged page table of `max_pages` rows do not cover them together."""
        bm, need = self.bm, 0
        for seq, u in zip(seqs, upto, strict=True):
            pages = bm.pages_for(u)
            if pages > max_pages:
                return False
            need += max(0, pages - len(seq.block_table))
        if need > bm.num_free_pages:
            return False
        for seq, u in zip(seqs, upto, strict=True):
            bm.hold(seq, u)
        return True

    def _taken(self, fl: Any, pick: list[int]) -> None:
        """Count the step in flight as consumed by `pick` of its sequences; the others' holds
        go back (a finished one was freed whole; one still running but left out of this step,
        by the scheduler's token budget, would keep its page until its next launched step)."""
        self._in_flight = None
        self.ahead_used += 1
        self.ahead_partial += len(pick) < sum(s is not None for s in fl.seqs)
        kept = set(pick)
        for i, seq in enumerate(fl.seqs):
            if i not in kept and seq is not None:
                self.bm.release_hold(seq)
