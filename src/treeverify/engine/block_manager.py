"""KV pages: a free list, per-page reference counts, and speculative rollback (torch-free).

A *slot* is one token's place in the KV pool: ``page_id * page_size + offset``. A sequence's
positions ``0 .. seq.num_slots - 1`` have slots; position p is in page ``block_table[p //
page_size]``. Pages are handed out lowest id first, so every run is deterministic.

Speculation: ``reserve(seq, n)`` gives slots to n draft or tree nodes written after the prefix;
``commit(seq, kept)`` keeps the first ``kept`` of them (the accepted path, already compacted to
the front by the verifier) and returns the pages that only the rejected nodes used.

Holding: ``hold(seq, upto)`` keeps pages for positions below ``upto`` in the block table beyond
its slots, for a speculative round launched before the previous one's result is read (its nodes
land at most that far; engine/round_graphs.py). Slots grown later take the held pages first, so
the positions the early round wrote keep their pages; ``commit`` keeps them, ``release_hold``
and ``free`` give them back.

Sharing: ``fork`` gives a child the parent's full pages (reference counted) and a private copy
of a partly filled last page, so no sequence ever writes into a page another one reads.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from .sequence import Sequence

if TYPE_CHECKING:  # annotations only: this module runs without torch
    import torch


class BlockManager:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages must be an int >= 1, got {num_pages!r}")
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.ref_counts = [0] * num_pages
        self._free: list[int] = list(range(num_pages))  # a min-heap of page ids
        self._owners: set[str] = set()  # request ids that hold an allocation
        self._held: dict[str, int] = {}  # request id -> positions below it keep their pages

    # ---- queries ---------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def owns(self, seq: Sequence) -> bool:
        return seq.request_id in self._owners

    def pages_for(self, num_slots: int) -> int:
        return -(-num_slots // self.page_size)

    def num_pages_needed(self, seq: Sequence, n: int) -> int:
        """New pages ``seq`` needs for ``n`` more slots."""
        return max(0, self.pages_for(seq.num_slots + n) - len(seq.block_table))

    def hold(self, seq: Sequence, upto: int) -> bool:
        """Keep pages for positions ``< upto`` (beyond the slots, no slot given); False, with
        nothing taken, when the free pages do not cover them."""
        self._check_owner(seq, "hold")
        need = self.pages_for(upto) - len(seq.block_table)
        if need > len(self._free):
            return False
        self._take_pages(seq, need)
        self._held[seq.request_id] = max(upto, self._held.get(seq.request_id, 0))
        return True

    def release_hold(self, seq: Sequence) -> list[int]:
        """Give back the held pages past the slots; returns the pages freed."""
        self._held.pop(seq.request_id, None)
        return self._shrink(seq) if self.owns(seq) else []

    def num_held_slots(self, seq: Sequence) -> int:
        return self._held.get(seq.request_id, 0)

    def can_allocate(self, seq: Sequence, n: int | None = None) -> bool:
        """Whether ``n`` more slots (default: all of ``seq``'s tokens without one) fit now."""
        n = seq.num_tokens - seq.num_slots if n is None else n
        return self.num_pages_needed(seq, n) <= len(self._free)

    def slot(self, seq: Sequence, position: int) -> int:
        if not 0 <= position < seq.num_slots:
            raise ValueError(
                f"{seq.request_id!r}: position {position} has no slot (num_slots={seq.num_slots})"
            )
        page = seq.block_table[position // self.page_size]
        return page * self.page_size + position % self.page_size

    def span_slots(self, seqs: list[Sequence], firsts: list[int], n: int) -> torch.Tensor:
        """(B, n) int64 on the host: the slots of positions firsts[b] .. firsts[b] + n - 1 of
        each sequence, equal to `slot` per position; a round's N slots per sequence in a few
        tensor ops instead of B * N Python calls (N reaches 1025)."""
        import numpy as np  # here: the rest of the block manager stays importable without them
        import torch

        ps = self.page_size
        b = len(seqs)
        table = np.zeros((b, (n + ps - 2) // ps + 2), dtype=np.int64)  # (B, pages a span touches)
        for i, (seq, first) in enumerate(zip(seqs, firsts, strict=True)):
            if first < 0 or first + n > seq.num_slots:
                raise ValueError(f"{seq.request_id!r}: positions {first}..{first + n - 1} have "
                                 f"no slots (num_slots={seq.num_slots})")  # fmt: skip
            pages = seq.block_table[first // ps : (first + n - 1) // ps + 1]
            table[i, : len(pages)] = pages
        # offsets from each span's first page; numpy, not torch: ~1 us per op on the host
        # instead of ~5-10 (this runs every round), and plain indexing, not take_along_axis
        off = np.asarray(firsts, dtype=np.int64)[:, None] % ps + np.arange(n, dtype=np.int64)
        slots = table[np.arange(b)[:, None], off // ps] * ps + off % ps  # (B, n)
        return torch.from_numpy(slots)

    # ---- allocation ------------------------------------------------------------------------
    def allocate(self, seq: Sequence, n: int | None = None) -> list[int]:
        """First allocation of a sequence: slots for positions ``0 .. n-1`` (default: all)."""
        if self.owns(seq) or seq.block_table or seq.num_slots:
            raise ValueError(
                f"{seq.request_id!r} already holds pages {seq.block_table}; use append_slots"
            )
        n = seq.num_tokens if n is None else n
        slots = self._grow(seq, n)  # raises before registering if the pages are not there
        self._owners.add(seq.request_id)
        return slots

    def append_slots(self, seq: Sequence, n: int) -> list[int]:
        """Slots for the next ``n`` positions of a sequence that already holds an allocation."""
        self._check_owner(seq, "append_slots")
        if seq.num_reserved_slots:
            raise RuntimeError(
                f"{seq.request_id!r} has {seq.num_reserved_slots} reserved slots; commit first"
            )
        return self._grow(seq, n)

    def reserve(self, seq: Sequence, n: int) -> list[int]:
        """Slots for ``n`` speculative nodes after the current slots; undone by ``commit``."""
        self._check_owner(seq, "reserve")
        if seq.num_reserved_slots:
            raise RuntimeError(
                f"{seq.request_id!r} already has {seq.num_reserved_slots} reserved slots; "
                "commit before reserving again"
            )
        slots = self._grow(seq, n)
        seq.num_reserved_slots = n
        return slots

    def commit(self, seq: Sequence, kept: int) -> list[int]:
        """Keep the first ``kept`` reserved slots, drop the rest; returns the pages freed."""
        self._check_owner(seq, "commit")
        r = seq.num_reserved_slots
        if not isinstance(kept, int) or not 0 <= kept <= r:
            raise ValueError(
                f"{seq.request_id!r}: commit(kept={kept!r}) but only {r} slots are reserved"
            )
        seq.num_slots -= r - kept
        seq.num_reserved_slots = 0
        return self._shrink(seq)

    def _shrink(self, seq: Sequence) -> list[int]:
        """Pop the pages past the slots and the hold; returns those freed."""
        keep = self.pages_for(max(seq.num_slots, self._held.get(seq.request_id, 0)))
        freed = []
        if len(seq.block_table) > keep:
            tail = seq.block_table[keep:]
            # a new list, never a cut in place: a table that lost pages is never the list a
            # staged step recorded (StepStage.table_current compares lists by identity)
            seq.block_table = seq.block_table[:keep]
            for page in reversed(tail):
                if self._release(page):
                    freed.append(page)
        return freed

    def free(self, seq: Sequence) -> None:
        """Give back every page of ``seq`` (pages shared with a fork stay with the fork)."""
        self._check_owner(seq, "free")
        for page in reversed(seq.block_table):
            self._release(page)
        seq.block_table = []
        seq.num_slots = 0
        seq.num_reserved_slots = 0
        self._held.pop(seq.request_id, None)
        self._owners.discard(seq.request_id)

    def can_fork(self, parent: Sequence) -> bool:
        return self._partial_last_page(parent) <= len(self._free)

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]]:
        """Give ``child`` the KV of ``parent``'s slots.

        Full pages are shared (ref count + 1); a partly filled last page is copied into a fresh
        page. Returns the ``(src_page, dst_page)`` copies the model runner must make.
        """
        self._check_owner(parent, "fork")
        if parent.num_reserved_slots:
            raise RuntimeError(f"{parent.request_id!r} has reserved slots; commit before fork")
        if parent.request_id in self._held:
            raise RuntimeError(f"{parent.request_id!r} holds pages; release_hold before fork")
        if self.owns(child) or child.block_table:
            raise ValueError(f"fork target {child.request_id!r} already holds pages")
        if not self.can_fork(parent):
            raise RuntimeError("fork: no free page for the copy of the partly filled last page")
        table = list(parent.block_table)
        copies = []
        if self._partial_last_page(parent):
            dst = heapq.heappop(self._free)
            self.ref_counts[dst] = 1
            copies.append((table[-1], dst))
            table[-1] = dst
        for page in table[: len(table) - len(copies)]:
            self.ref_counts[page] += 1
        child.block_table = table
        child.num_slots = parent.num_slots
        child.mark_cached(min(parent.num_cached_tokens, parent.num_slots, child.num_tokens))
        self._owners.add(child.request_id)
        return copies

    # ---- checking --------------------------------------------------------------------------
    def check(self, seqs: list[Sequence]) -> None:
        """Raise AssertionError unless pages and ``seqs`` (all current owners) agree exactly."""
        count = [0] * self.num_pages
        for s in seqs:
            assert len(set(s.block_table)) == len(s.block_table), f"page twice in {s!r}"
            keep = self.pages_for(max(s.num_slots, self._held.get(s.request_id, 0)))
            assert len(s.block_table) == keep, f"table size of {s!r}"
            for p in s.block_table:
                count[p] += 1
        assert count == self.ref_counts, "ref counts differ from block tables"
        free = set(self._free)
        assert len(free) == len(self._free), "page twice in the free list"
        assert free == {p for p in range(self.num_pages) if count[p] == 0}, "free list wrong"
        assert {s.request_id for s in seqs} == self._owners, "owner set differs"
        assert set(self._held) <= self._owners, "a hold outlived its sequence"

    # ---- internals -------------------------------------------------------------------------
    def _check_owner(self, seq: Sequence, op: str) -> None:
        if not self.owns(seq):
            raise ValueError(
                f"{op}: {seq.request_id!r} holds no allocation (never allocated, or freed already)"
            )

    def _partial_last_page(self, seq: Sequence) -> int:
        return 1 if seq.num_slots % self.page_size else 0

    def _grow(self, seq: Sequence, n: int) -> list[int]:
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"{seq.request_id!r}: slot count must be an int >= 0, got {n!r}")
        need = self.num_pages_needed(seq, n)
        if need > len(self._free):
            raise RuntimeError(
                f"{seq.request_id!r}: {n} slots need {need} new pages, only "
                f"{len(self._free)} free (check can_allocate first)"
            )
        if n and seq.block_table and self._partial_last_page(seq):
            last = seq.block_table[seq.num_slots // self.page_size]  # (held pages follow it)
            if self.ref_counts[last] > 1:  # cannot happen through fork(); guard anyway
                raise RuntimeError(f"{seq.request_id!r}: would write into shared page {last}")
        self._take_pages(seq, need)
        start = seq.num_slots
        seq.num_slots += n
        ps, table = self.page_size, seq.block_table  # `slot` per position, without its checks
        return [table[p // ps] * ps + p % ps for p in range(start, start + n)]

    def _take_pages(self, seq: Sequence, need: int) -> None:
        """Append `need` free pages (lowest ids first) to seq's table."""
        for _ in range(need):
            page = heapq.heappop(self._free)
            self.ref_counts[page] = 1
            seq.block_table.append(page)

    def _release(self, page: int) -> bool:
        if self.ref_counts[page] <= 0:
            raise RuntimeError(f"page {page} released with ref count {self.ref_counts[page]}")
        self.ref_counts[page] -= 1
        if self.ref_counts[page] == 0:
            heapq.heappush(self._free, page)
            return True
        return False
