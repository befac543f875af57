"""A device ring of the target's tapped hidden rows, written by plain decode steps launched
ahead, read back by the DFlash context's projections (engine/draft_context.py).

A plain step's tapped rows (b, F) must outlive the next replay, which overwrites the graph's
output, and stay until the drafter projects them (every `flush_rows` rows, or before a round).
Before this ring each step kept them as its own copy (a clone), split into one (1, F) view per
request, each handed to the context in its own `observe` call: ~57 us of host a step at b=8 on
the GPU lease's host (clone 11, split 10, eight observes 36; thirty-seventh session), on a step
that is host-bound there. Here a step's rows are copied into the ring (one copy, no allocation)
and named by integers: row id i lives at `buf[i % rows]`; a request's pending rows are ids,
handed over in one call for the whole step, and a flush gathers them in one `index_select`.

Ids grow without bound; a write of b rows that would cross the ring's end starts at the next
lap instead (rows stay contiguous: one copy). The ring overwrites a row `rows` ids later; the
context keeps a floor under every id it still holds and spills (copies out) what is pending
before a write would reach it (`DraftContextCache.ring_write`).

With TREEVERIFY_RING_IN_GRAPH the step graphs write the rows themselves (engine/ring_put.py):
the ring then keeps its head on the device as well (`device_head`), moved by each replay by the
rule `start_of` gives, and the host only advances its own (`advance`) before each replay.
"""

from __future__ import annotations

import numpy as np
import torch

from treeverify.kernels.staging import to_device


class FeedRing:
    def __init__(self, rows: int, features: int, dtype: torch.dtype, device: torch.device):
        if rows < 1:
            raise ValueError(f"rows: expected >= 1, got {rows}")
        self.rows = rows
        # zeroed: a captured projection's padding rows read row 0, maybe before any write
        # (the capture's warm-up): garbage there became the scratch ring's keys (a review)
        self.buf = torch.zeros((rows, features), dtype=dtype, device=device)  # (rows, F)
        self.head = 0  # ids handed out so far: the next write starts here (or at the next lap)
        self.writes = 0
        # (1,) int64 on the device, the same head, when step graphs write the rows (ring_put)
        self.device_head: torch.Tensor | None = None

    def start_of(self, n: int) -> int:
        """The first id a write of n rows would take (contiguous in `buf`)."""
        if n > self.rows:
            raise ValueError(f"FeedRing: a write of {n} rows, the ring holds {self.rows}")
        at = self.head % self.rows
        return self.head if at + n <= self.rows else self.head + self.rows - at

    def write(self, hidden: torch.Tensor, first: int | None = None) -> int:
        """Copy (n, F) rows in (queued on the current stream: after the step that made them);
        returns the first row's id (row j is id + j). `first`: `start_of(n)`, when known."""
        if self.device_head is not None:  # the device's head would fall behind the host's
            raise RuntimeError("FeedRing.write: step graphs write this ring (ring_put)")
        first = self.advance(hidden.shape[0], first)
        at = first % self.rows
        self.buf[at : at + hidden.shape[0]].copy_(hidden)
        return first

    def advance(self, n: int, first: int | None = None) -> int:
        """The host's head moved past a write of n rows, without copying (a step graph's
        ring_put writes them, by the same rule); returns their first id."""
        if first is None:
            first = self.start_of(n)
        self.head = first + n
        self.writes += 1
        return first

    def written_by_graphs(self) -> torch.Tensor:
        """The device head step graphs' ring_put reads and moves ((1,) int64, made now at the
        host's head); from then on only `advance`, never `write`."""
        if self.device_head is None:
            self.device_head = torch.full((1,), self.head, dtype=torch.int64,
                                          device=self.buf.device)  # fmt: skip
        return self.device_head

    def graphs_captured(self) -> None:
        """After the step graphs' warm-ups and captures (each ran ring_put once): their rows
        zeroed (no id names them; a projection's padding rows read row 0) and the device head
        put back at the host's."""
        self.buf.zero_()
        self.device_head.fill_(self.head)

    def live(self, row_id: int) -> bool:
        """Whether a row is still in the ring (not yet overwritten)."""
        return 0 <= row_id < self.head and self.head - row_id <= self.rows

    def rows_of(self, ids) -> np.ndarray:
        """(n,) int64: where ids (a list or an array) live in `buf`. RuntimeError when one was
        overwritten or not yet written (the context's floor failed: a bug)."""
        ids = np.asarray(ids, dtype=np.int64)
        lo, hi = int(ids.min()), int(ids.max())
        if not self.live(lo) or hi >= self.head:
            raise RuntimeError(f"FeedRing: row {lo} requested, the ring holds ids "
                               f"{max(0, self.head - self.rows)}..{self.head - 1}")  # fmt: skip
        return ids % self.rows

    def gather(self, ids: list[int]) -> torch.Tensor:
        """(len(ids), F): a copy of those rows, in order (one pinned upload, no sync);
        RuntimeError as `rows_of`."""
        index = torch.from_numpy(self.rows_of(ids))  # (n,)
        return self.buf.index_select(0, to_device(index, self.buf.device))
