"""The DFlash drafter's per-request context: keys/values of committed tokens, computed once, kept
in one device store that a captured draft reads directly.

A DFlash draft attends from its block to the target's hidden states of the context. Everything a
context row contributes (fc -> hidden_norm -> each layer's k_proj/k_norm/rope and v_proj) depends
on that row alone, so it is computed when the row is first needed and kept: a round projects only
the rows committed since the last round (1 + accepted length), not the whole window again.

The rows live in one store, a ring per request:

    kv   (slots + 1, W, n_layers, 2, Hkv, D)   request r's row for position p at kv[slot_r, p % W];
                                               the last slot is scratch (padding requests write
                                               and read it); W = window + SLACK

and per request, on the host: its slot, `end` (one past the last projected position) and `count`
(rows held: positions end - count .. end - 1, count <= W). Keys carry their rotary position, so
the order of rows does not matter to the attention: a draft reads the whole ring of its request
(`kv[slot]`, in place, no per-request copy) and masks rows by age (spec.dflash.ring_valid): the
newest `window` rows. A captured whole round (engine/round_graphs.py) writes its accepted rows
straight into the ring and the host only advances `end` and `count` (`advance`).

`observe` only appends to a pending list (a plain decode step, e.g. at adaptive budget 0, costs a
list append) and projects a request's rows once they fill the largest captured projection bucket
(`flush_rows`; on the CPU every MAX_PENDING chunks), and every request's that holds a ring once
the rows pending across requests fill CHUNKED_REPLAYS - 1 buckets (replays, never an eager
call): what a batch keeps pending, and the step copies of its hidden states those rows hold
alive, stays bounded (per request alone, a batch of 64 at a largest bucket of 64 x 16 rows held
~1000 steps' copies, GBs at a large model's width); `project` turns every pending row of a set of
requests into keys/values in ONE drafter call (rows are independent: one flat (R, F) batch over all
requests; captured: up to CHUNKED_REPLAYS replays of the largest bucket, a longer run eagerly) and
scatters them into the rings; pending feed-ring ids (plain steps launched ahead) go instead to
one replay per chunk that gathers them inside the graph (engine/ring_projection.py,
TREEVERIFY_RING_PROJECTION). Lazy (TREEVERIFY_CONTEXT_LAZY, the default): feed-ring ids are
not projected by those flushes at all, only when a round reads them or when a ring write would
reach them (`_ring_pressure`): on text where no round pays, the adaptive budget's plain steps
never pay for a projection, and a request that finishes before any round drops its rows
unprojected (H100, b=8 prose sampled at T=1: the flush steps, ~0.6-0.9 ms each, 2-3 a pass,
were 4% of the pass); the flushes still bound the rows held as copies (prompts, steps read
first). Rows older than W are never projected. SLACK rows beyond the window
let a few rejected or recomputed rows at the end be dropped and still leave a full window.

The store grows by slots while requests come (CPU, before capture); `fix` sizes it once for
captured graphs (their addresses are baked in), after which a new request takes the slot of the
least recently used one when none is free (a request that waited long enough to lose its slot,
a preempted one, is recomputed from its prompt anyway).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from treeverify import env
from treeverify.engine.feed_ring import FeedRing
from treeverify.engine.ring_projection import RingProjection, buckets_up_to, project_from_ring
from treeverify.kernels.staging import to_device


@dataclass
class _Context:
    slot: int | None = None  # ring in the store; None: evicted (holds nothing)
    end: int = 0  # one past the last projected position
    count: int = 0  # projected rows held: positions end - count .. end - 1
    # in order: (rows_i, F) copies, or runs of row ids in the feed ring (engine/feed_ring.py)
    pending: list[torch.Tensor | list[int]] = field(default_factory=list)
    pending_rows: int = 0  # sum of the pending chunks' rows (read every step: kept, not summed)
    copied_rows: int = 0  # ... of those held as copies (tensors), not as feed-ring ids
    evicted: bool = False  # lost its ring (and rows): the next chunk may start anywhere

    @property
    def observed_end(self) -> int:
        """One past the last observed position."""
        return self.end + self.pending_rows

    def set_pending(self, chunks: list[torch.Tensor | list[int]]) -> None:
        self.pending = chunks
        self.pending_rows = sum(len(c) for c in chunks)  # a tensor's len: its rows
        self.copied_rows = _copied_rows(chunks)


def _copied_rows(pieces: list) -> int:
    """Rows of the pending pieces held as copies (tensors), not as feed-ring ids."""
    return sum(p.shape[0] for p in pieces if isinstance(p, torch.Tensor))


def _head(pieces: list, keep: int) -> list:
    """The first `keep` rows of pending pieces (tensors sliced, id runs cut)."""
    out = []
    for p in pieces:
        if keep <= 0:
            break
        out.append(p[:keep])
        keep -= len(out[-1])
    return out


def _tail(pieces: list, skip: int) -> list:
    """Pending pieces without their first `skip` rows."""
    out = []
    for p in pieces:
        if skip >= len(p):
            skip -= len(p)
            continue
        out.append(p[skip:])
        skip = 0
    return out


class DraftContextCache:
    MAX_PENDING = 64  # uncaptured (the CPU): observed chunks kept before they are projected
    CHUNKED_REPLAYS = 4  # a captured projection replays at most this many pieces, else eager
    # The largest captured projection bucket is at least this many rows, however small the
    # batch: pending rows are projected once they fill it, and a projection's host cost is
    # per call, not per row (at b=1 on an H100 the DFlash engine's plain steps were a median
    # 180 us but a mean 204: a 16-row projection every 16 steps, thirty-sixth session), and a
    # prompt of up to CHUNKED_REPLAYS x this many rows is projected by replays, not eagerly.
    # 256 (64 until the thirty-seventh session): a flush cost ~0.25 ms of host alone and 0.7-0.9
    # ms inside a step on the H100, every 64th plain step at b=1 (~9 us a step, half the DFlash
    # plain step's excess over plain decoding's); at 256 a probe's round, every ~64 steps on
    # text no drafter predicts, projects the rows first anyway. What stays pending is bounded by
    # the batch flush: (CHUNKED_REPLAYS - 1) x 256 rows, 768 x F x 2 bytes (1.2 MB at
    # tiny-code's F = 768; ~33 MB at F = 3 x 7168), plus what a request without a ring holds
    # (under `flush` rows each, in a fixed store), each row in its own step's copy of the
    # decodes' rows (engine/drafter_feed.py: a decode's row shares no copy with a prefill's).
    MIN_FLUSH_ROWS = 256
    # Rows kept beyond the window, so that dropping rejected or recomputed rows (a few at the
    # end) still leaves a full window to draft from.
    SLACK = 64

    def __init__(self, drafter, window: int):
        if window < 1:
            raise ValueError(f"window: expected >= 1, got {window}")
        self.drafter = drafter
        self.window = window
        self.width = window + self.SLACK  # W: ring rows per request
        self._ctx: OrderedDict[str, _Context] = OrderedDict()  # least recently used first
        self.kv: torch.Tensor | None = None  # (slots + 1, W, n_layers, 2, Hkv, D)
        self._free: list[int] = []
        self.fixed = False  # sized for captured graphs: never reallocated
        self.evictions = 0
        self._captured = None  # CapturedFn of drafter.context_kv by row count, on a GPU
        self._pending_total = 0  # rows pending across requests (`_set_pending` keeps it)
        self._copied_total = 0  # ... of them held as copies (lazy: what the batch flush counts)
        # rows the last batch flush left pending (requests without a ring in a fixed store):
        # the next batch flush waits for as many new rows again, not for one more row
        self._pending_left = 0
        # plain steps launched ahead copy their tapped rows into this ring (`ring_write`) and
        # hand over row ids (`observe_ring`); None until `enable_ring`
        self._ring: FeedRing | None = None
        self._ring_batch = 0  # the largest write `enable_ring` sized the ring for
        self._ring_floor = 0  # <= every ring id still pending (spilled before a write reaches it)
        self.ring_spills = 0
        # pending ring ids projected by a replay that gathers them in the graph
        # (engine/ring_projection.py; TREEVERIFY_RING_PROJECTION), else by the general path
        self.ring_projection = env.ring_projection()
        self._ring_proj: RingProjection | None = None  # its graphs (a GPU, after capture)
        self.ring_projected = 0  # rows projected that way (the rest by the general path)
        # lazy (TREEVERIFY_CONTEXT_LAZY): feed-ring rows stay pending until a round needs them
        # or a ring write would reach them (then projected, not copied out): on text where no
        # round pays, a request's plain steps are never projected (`_ring_pressure`)
        self.lazy = env.context_lazy()
        self.ring_pressure_projections = 0

    # ---- the store -----------------------------------------------------------------------------
    @property
    def slots(self) -> int:
        return 0 if self.kv is None else self.kv.shape[0] - 1

    @property
    def scratch_slot(self) -> int:
        return self.slots

    def _row_shape(self) -> tuple[int, ...]:
        cfg = self.drafter.config
        return (cfg.num_hidden_layers, 2, cfg.num_key_value_heads, cfg.head_dim)

    def _allocate(self, slots: int, device: torch.device) -> None:
        """A store of `slots` rings (+ scratch), the held rings copied over. Zeroed: rows never
        written are finite, and masked out by age anyway."""
        dtype = self.drafter.fc.weight.dtype
        kv = torch.zeros((slots + 1, self.width, *self._row_shape()), dtype=dtype, device=device)
        old = self.slots
        if self.kv is not None and old:
            kv[:old] = self.kv[:old]
        self._free += list(range(slots - 1, old - 1, -1))  # popped from the end: lowest first
        self.kv = kv

    def fix(self, slots: int, device: torch.device, window: int | None = None) -> None:
        """Size the store once, for captured graphs (`slots` rings; `window` clips the drafted
        context, e.g. to the target's max context). Only before any request is held."""
        if self._ctx:
            raise RuntimeError("DraftContextCache.fix: requests are held; fix before serving")
        if window is not None:
            self.window = max(1, min(self.window, window))
            self.width = self.window + self.SLACK
        self.kv, self._free = None, []
        self._allocate(slots, device)
        self.fixed = True

    def _acquire(self, ctx: _Context, device: torch.device, keep: set[str]) -> None:
        if not self._free:
            if not self.fixed:
                self._allocate(max(4, 2 * self.slots), device)
            else:  # the least recently used request outside `keep` gives its ring up
                victim = next((c for r, c in self._ctx.items()
                               if r not in keep and c.slot is not None), None)  # fmt: skip
                if victim is None:
                    raise RuntimeError("DraftContextCache: no ring free and none to evict")
                self._free.append(victim.slot)
                victim.slot, victim.count, victim.evicted = None, 0, True
                self._set_pending(victim, [])
                self.evictions += 1
        ctx.slot = self._free.pop()

    def capture_projection(self, device: torch.device, max_rows: int) -> None:
        """Capture `context_kv` per row-count bucket (16, 32, .. up to `max_rows`: a round's
        committed rows, at most batch x (depth + 1); and at least MIN_FLUSH_ROWS): rows are
        independent, so padded rows change nothing; a projection of more rows (a prefill, a
        long run of plain steps) runs eagerly. ~25 small launches per projection become one
        replay."""
        from treeverify.engine.captured_fn import CapturedFn

        buckets, r = [], 16
        while r < 2 * max(max_rows, self.MIN_FLUSH_ROWS):
            buckets.append(r)
            r *= 2
        cfg = self.drafter.config
        dtype = self.drafter.fc.weight.dtype

        def example(rows: int):
            return (torch.zeros(rows, cfg.context_features, dtype=dtype, device=device),
                    torch.zeros(rows, dtype=torch.int64, device=device))  # fmt: skip

        with torch.no_grad():  # no autograd records in the graph (plain tensors, not inference)
            self._captured = CapturedFn(lambda f, p: (self.drafter.context_kv(f, p),), example,
                                        buckets, rows_per_item=(1,))  # fmt: skip

    # ---- requests ------------------------------------------------------------------------------
    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ctx

    def __len__(self) -> int:
        return len(self._ctx)

    def end(self, request_id: str) -> int:
        """One past the last position observed for the request (0 if none)."""
        ctx = self._ctx.get(request_id)
        return 0 if ctx is None else ctx.observed_end

    def observe(self, request_id: str, start: int, hidden: torch.Tensor) -> None:
        """The target's hidden states (rows, F) of positions start.. . Rows already held at or
        past `start` were recomputed or rejected: they are dropped first. `hidden` must not be
        overwritten later (the engine copies graph outputs once per step)."""
        ctx = self._context_at(request_id, start)
        ctx.pending.append(hidden)
        ctx.pending_rows += hidden.shape[0]
        ctx.copied_rows += hidden.shape[0]
        self._pending_total += hidden.shape[0]
        self._copied_total += hidden.shape[0]
        flush = self.flush_rows
        rows = ctx.copied_rows if self.lazy else ctx.pending_rows  # lazy: copies only
        full = rows >= flush if flush else len(ctx.pending) >= self.MAX_PENDING
        if full:  # captured: a bucket's rows; the CPU: MAX_PENDING chunks
            self.project([request_id])
        self._flush_batch()

    def _context_at(self, request_id: str, start: int) -> _Context:
        """The request's context (made on its first rows, the most recently used now), its
        observed rows cut back to `start` (rows at or past it were recomputed or rejected).
        RuntimeError when `start` leaves a gap."""
        ctx = self._ctx.get(request_id)
        if ctx is None:
            ctx = self._ctx[request_id] = _Context()
        else:
            self._ctx.move_to_end(request_id)
        if ctx.evicted:  # holds nothing: starts over here
            ctx.end, ctx.evicted = start, False
        end = ctx.observed_end
        if start > end:
            raise RuntimeError(f"dflash context of {request_id}: {end} rows, "
                               f"chunk starts at {start}")  # fmt: skip
        if start < end:
            self._truncate(ctx, start)
        return ctx

    def observe_ring(self, items: list[tuple[str, int, int]]) -> None:
        """One row per (request, position, id in the feed ring) of a plain step launched ahead
        (`ring_write`), as `observe` would take each row: a step's rows in one call, each kept
        as an integer until a projection gathers them."""
        flush = self.flush_rows
        for request_id, start, row_id in items:
            ctx = self._context_at(request_id, start)
            self._ring_floor = min(self._ring_floor, row_id)
            last = ctx.pending[-1] if ctx.pending else None
            if isinstance(last, list):
                last.append(row_id)
            else:
                ctx.pending.append([row_id])
            ctx.pending_rows += 1
            self._pending_total += 1
            if self.lazy:  # held by the ring until a round or a ring write needs them
                continue
            if ctx.pending_rows >= (flush or self.MAX_PENDING):  # the CPU: rows, not chunks
                self.project([request_id])
        if not self.lazy:
            self._flush_batch()

    def _flush_batch(self) -> None:
        """Project the batch's pending rows once they fill CHUNKED_REPLAYS - 1 buckets (replays,
        never one eager call: a request's own rows past a bucket were projected already), and
        only those of requests that hold a ring (a fixed store would lend one by evicting a
        request outside this flush, maybe a running one; a preempted request's rows stay
        pending)."""
        flush = self.flush_rows
        total = self._batch_pending()
        if flush and total - self._pending_left >= (self.CHUNKED_REPLAYS - 1) * flush:
            self.project([r for r, c in self._ctx.items()
                          if c.pending and (c.slot is not None or not self.fixed)])  # fmt: skip
            # what it could not take (ringless requests' rows, each below `flush`): without
            # this every later observe flushed again, a replay a step (a helper's review)
            self._pending_left = self._batch_pending()

    def _batch_pending(self) -> int:
        """Rows pending across requests that the batch flush counts: every row, or lazy, the
        copies' rows only (ring ids wait for a round or for the ring's pressure)."""
        return self._copied_total if self.lazy else self._pending_total

    @property
    def info(self) -> dict:
        """For /server_info: the projection rule and how rows reached the store."""
        return {"lazy": self.lazy, "ring": self._ring is not None,
                "ring_rows": None if self._ring is None else self._ring.rows,
                "rows_projected_from_ring": self.ring_projected,
                "ring_pressure_projections": self.ring_pressure_projections,
                "ring_spills": self.ring_spills, "evictions": self.evictions}  # fmt: skip

    # ---- the feed ring (engine/feed_ring.py) ---------------------------------------------------
    def enable_ring(self, max_batch: int) -> None:
        """Plain steps of up to `max_batch` rows will write through `ring_write` (the ring is
        made at the first write, on the rows' device and dtype, and sized then)."""
        if self._ring is not None and max_batch > self._ring_batch:
            raise RuntimeError(f"DraftContextCache.enable_ring: the ring is sized for writes "
                               f"of {self._ring_batch} rows, asked for {max_batch}")  # fmt: skip
        self._ring_batch = max(self._ring_batch, max_batch)

    def capture_ring_projection(self, features: int, dtype: torch.dtype,
                                device: torch.device) -> dict:  # fmt: skip
        """Make the feed ring now (rows of `features` in `dtype`: the tapped rows' width and
        type) and capture its projection graphs (engine/ring_projection.py) over the fixed
        store; after `enable_ring` and `fix`. Returns what was captured."""
        if not (self.fixed and self._ring_batch):
            raise RuntimeError("DraftContextCache.capture_ring_projection: fix the store and "
                               "enable the ring first")  # fmt: skip
        self._make_ring(features, dtype, device)
        w = self.width
        store = self.kv.view(-1, *self.kv.shape[2:])
        scratch = range(self.scratch_slot * w, (self.scratch_slot + 1) * w)
        self._ring_proj = RingProjection(self.drafter, self._ring.buf, store, scratch,
                                         buckets_up_to(self._ring.rows))  # fmt: skip
        return {"ring_rows": self._ring.rows, "buckets": self._ring_proj.buckets}

    def _make_ring(self, features: int, dtype: torch.dtype, device: torch.device) -> FeedRing:
        """The feed ring, made on first use (before capture, or at the first write) and sized
        then (`_ring_rows`)."""
        if self._ring is None:
            self._ring = FeedRing(self._ring_rows(), features, dtype, device)
        return self._ring

    def _ring_rows(self) -> int:
        """The ring's size: what the batch flush lets pend (CHUNKED_REPLAYS buckets) plus four
        of the largest writes (a step launched ahead is written before the one before it is
        observed); requests without a ring, or the CPU's chunk-counted flushes, may hold more:
        the guard spills those."""
        bucket = self.flush_rows or self.MAX_PENDING
        return self.CHUNKED_REPLAYS * bucket + 4 * self._ring_batch

    def ring_for_graphs(self, features: int, dtype: torch.dtype,
                        device: torch.device) -> FeedRing:  # fmt: skip
        """The feed ring made now (after `enable_ring`), for step graphs that write their rows
        into it themselves (engine/ring_put.py, TREEVERIFY_RING_IN_GRAPH); each launch of one
        then calls `ring_reserve` first."""
        if not self._ring_batch:
            raise RuntimeError("DraftContextCache.ring_for_graphs: enable the ring first")
        ring = self._make_ring(features, dtype, device)
        ring.written_by_graphs()
        return ring

    def ring_write(self, hidden: torch.Tensor) -> int:
        """Copy a plain step's (n, F) tapped rows into the feed ring; returns the first row's
        id. Pending ids the write would overwrite are copied out first (`_spill_ring`)."""
        n = hidden.shape[0]
        ring = self._make_ring(hidden.shape[1], hidden.dtype, hidden.device)
        if hidden.dtype != ring.buf.dtype or hidden.shape[1] != ring.buf.shape[1]:
            raise RuntimeError(f"DraftContextCache.ring_write: rows {tuple(hidden.shape)} "
                               f"{hidden.dtype}, the ring holds (, {ring.buf.shape[1]}) "
                               f"{ring.buf.dtype}")  # fmt: skip
        return ring.write(hidden, self._make_room(n, "ring_write"))

    def ring_reserve(self, n: int) -> int:
        """The ids of a plain step's n rows that its graph is about to write into the feed
        ring (ring_put), as `ring_write` would give them; called before the replay, so the
        spills and projections that make room are queued before the graph overwrites rows."""
        return self._ring.advance(n, self._make_room(n, "ring_reserve"))

    def _make_room(self, n: int, caller: str) -> int:
        """The first id of a write of n rows, pending ids it would overwrite projected (lazy)
        or copied out first."""
        if n > self._ring_batch:
            raise RuntimeError(f"DraftContextCache.{caller}: {n} rows, enabled for "
                               f"{self._ring_batch}")  # fmt: skip
        ring = self._ring
        first = ring.start_of(n)
        if first + n - self._ring_floor > ring.rows:
            # the floor only falls as ids are observed: raise it to the oldest id still pending
            # (a run's ids ascend) before spilling anything; without this every lap spilled
            # (a helper's review; tests/test_feed_ring.py's steady b=8 run: 7 spills in 1000
            # steps, none needed). Ids written but not
            # yet observed lower it again when they are, as after a spill.
            self._raise_floor()
            if self.lazy and first + n - self._ring_floor > ring.rows:
                self._ring_pressure()
            if first + n - self._ring_floor > ring.rows:
                self._spill_ring()
        return first

    def _raise_floor(self) -> None:
        """The floor raised to the oldest ring id still pending (a run's ids ascend)."""
        self._ring_floor = min((p[0] for c in self._ctx.values() for p in c.pending
                                if isinstance(p, list) and p), default=self._ring.head)  # fmt: skip

    def _ring_pressure(self) -> None:
        """Lazy: a ring write would reach pending ids: every request holding ring ids (and a ring
        of its own in the store, as the batch flush asks) has them projected now, queued before
        the write; what is left (ringless requests' ids) is spilled by the caller."""
        self.project([r for r, c in self._ctx.items()
                      if any(isinstance(p, list) for p in c.pending)
                      and (c.slot is not None or not self.fixed)])  # fmt: skip
        self.ring_pressure_projections += 1
        self._raise_floor()

    def _spill_ring(self) -> None:
        """Every pending run of ring ids copied out of the ring (rare: the batch flush projects
        rows long before the ring laps; requests without a ring hold theirs, and on the CPU
        pending rows flush by request only)."""
        for ctx in self._ctx.values():
            if any(isinstance(p, list) for p in ctx.pending):
                self._set_pending(ctx, [self._materialize(ctx.pending)])
        self._ring_floor = self._ring.head
        self.ring_spills += 1

    def _materialize(self, pieces: list) -> torch.Tensor:
        """(rows, F): pending pieces in order, each run of ring ids (adjacent runs merged, across
        requests too) in one gather."""
        parts, run = [], []
        for p in pieces:
            if isinstance(p, list):
                run += p
                continue
            if run:
                parts.append(self._ring.gather(run))
                run = []
            parts.append(p)
        if run:
            parts.append(self._ring.gather(run))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _set_pending(self, ctx: _Context, chunks: list) -> None:
        """A request's pending chunks replaced (the total across requests kept)."""
        self._pending_total -= ctx.pending_rows
        self._copied_total -= ctx.copied_rows
        ctx.set_pending(chunks)
        self._pending_total += ctx.pending_rows
        self._copied_total += ctx.copied_rows
        # (in the batch flush's own units: lazy, copies only; a review found the two mixed)
        self._pending_left = min(self._pending_left, self._batch_pending())

    @property
    def flush_rows(self) -> int | None:
        """A request's pending rows projected as soon as it has as many (every request's at
        CHUNKED_REPLAYS - 1 times as many across requests): the largest captured projection
        bucket (a run of plain steps then projects by graph replays, never eagerly: an eager
        64-row projection's GEMMs took ~0.7 ms of host time each under cProfile on the H200,
        thirty-third session); None when nothing is captured (the CPU: a request's every
        MAX_PENDING chunks)."""
        return None if self._captured is None else self._captured.batch_sizes[-1]

    def _truncate(self, ctx: _Context, start: int) -> None:
        if start >= ctx.end:  # only pending rows go
            kept = _head(ctx.pending, start - ctx.end)
            if len(kept) > 1 and all(isinstance(p, torch.Tensor) for p in kept):
                kept = [torch.cat(kept)]  # one chunk, as before the ring (the CPU counts chunks)
            self._set_pending(ctx, kept)
        else:  # projected rows past `start` go (before everything held: all of it)
            ctx.count = max(0, ctx.count - (ctx.end - start))
            ctx.end = start
            self._set_pending(ctx, [])

    def project(self, request_ids: list[str]) -> None:
        """Keys/values of every pending row of these requests, in one drafter call, scattered
        into their rings (nothing pending: returns before any torch call)."""
        todo = [(rid, ctx) for rid in request_ids
                if (ctx := self._ctx.get(rid)) is not None and ctx.pending]  # fmt: skip
        if todo:
            self._project(todo)

    @torch.inference_mode()
    def _project(self, todo: list[tuple[str, _Context]]) -> None:
        """Every pending row of `todo`'s requests into their rings: runs of feed-ring ids by
        `_project_ring` when it is on (gathered inside the graph), the rest (chunks of copied
        rows: prompts, steps read first) by one general projection."""
        by_ring = self.ring_projection and self._ring is not None
        keep = {rid for rid, _ in todo}
        pieces, positions, dests = [], [], []  # the general path's rows, in order
        ring_ids, ring_pos, ring_dest = [], [], []  # feed-ring rows gathered in the graph
        spans = []
        for _, ctx in todo:
            if ctx.slot is None:
                first = ctx.pending[0]
                self._acquire(ctx, first.device if isinstance(first, torch.Tensor)
                              else self._ring.buf.device, keep)  # fmt: skip
            begin, rows = ctx.end, ctx.pending_rows
            skip = max(0, rows - self.width)  # older than any ring keeps
            begin, rows = begin + skip, rows - skip
            spans.append((begin, rows))
            at, base = begin, ctx.slot * self.width
            for piece in _tail(ctx.pending, skip) if skip else ctx.pending:
                n = len(piece) if isinstance(piece, list) else piece.shape[0]
                pos = np.arange(at, at + n, dtype=np.int64)  # (n,)
                if by_ring and isinstance(piece, list):
                    ring_ids.append(piece)
                    ring_pos.append(pos)
                    ring_dest.append(base + pos % self.width)
                else:
                    pieces.append(piece)
                    positions.append(pos)
                    dests.append(base + pos % self.width)
                at += n
        if ring_ids:
            self._project_ring(np.concatenate(ring_ids), np.concatenate(ring_pos),
                               np.concatenate(ring_dest))  # fmt: skip
        if pieces:
            self._project_general(pieces, np.concatenate(positions), np.concatenate(dests))
        for (_, ctx), (begin, n) in zip(todo, spans, strict=True):
            self._set_pending(ctx, [])
            held = ctx.count if begin == ctx.end else 0  # rows skipped: the ring starts over
            ctx.end, ctx.count = begin + n, min(self.width, held + n)

    def _project_ring(self, ids: np.ndarray, pos: np.ndarray, dest: np.ndarray) -> None:
        """Feed-ring rows (ids, their positions and flat store rows, each (R,)) projected by a
        replay that gathers them in the graph (engine/ring_projection.py); uncaptured (the CPU),
        the same gather, projection and scatter eagerly. RuntimeError on an overwritten id."""
        ring = self._ring
        rows = ring.rows_of(ids)  # (R,) rows of the ring's buffer
        self.ring_projected += len(rows)
        if self._ring_proj is not None:
            self._ring_proj(rows, pos, dest)
            return
        store = self.kv.view(-1, *self.kv.shape[2:])
        block = to_device(torch.from_numpy(np.stack([rows, pos, dest])), ring.buf.device)  # (3, R)
        project_from_ring(self.drafter, ring.buf, store, block)

    def _project_general(self, pieces: list, pos_host: np.ndarray, dest: np.ndarray) -> None:
        """Pending pieces (copied chunks, or ring ids when the ring projection is off) with
        their positions and flat store rows ((R,) each): the rows gathered on the host side,
        projected by the captured projection's replays (or eagerly: nothing captured, or a
        long run such as a prompt's) and scattered into the store."""
        feats = self._materialize(pieces)  # (R, F): every request's rows, in order
        dev = feats.device
        pos = to_device(torch.from_numpy(pos_host), dev)  # (R,) pinned, non-blocking: no sync
        flat = to_device(torch.from_numpy(dest), dev)  # (R,) rows of the flat store
        store = self.kv.view(-1, *self.kv.shape[2:])
        bucket, total = self.flush_rows, feats.shape[0]  # bucket: None when nothing is captured
        if bucket is not None and total <= self.CHUNKED_REPLAYS * bucket:
            for a in range(0, total, bucket):  # replays: each output (a view of the graph's)
                # is scattered before the next replay overwrites it
                kv = self._captured(feats[a : a + bucket], pos[a : a + bucket])[0]
                store.index_copy_(0, flat[a : a + bucket], kv.to(self.kv.dtype))
        else:  # eager: nothing captured, or a long run (a prefill's rows): ~25 launches for all
            kv = self.drafter.context_kv(feats, pos)  # (R, n_layers, 2, Hkv, D)
            store.index_copy_(0, flat, kv.to(self.kv.dtype))

    def prepare(self, seqs: list, device: torch.device) -> None:
        """Nothing to write before a round is staged: rows arrive by `observe` and `draft_meta`
        projects what is pending (engine/ngram_rings.py writes its tokens here)."""

    def write_rows(self, rows: torch.Tensor, pos: torch.Tensor, ring: torch.Tensor,
                   tokens: torch.Tensor, hidden: torch.Tensor) -> None:  # fmt: skip
        """A captured round's accepted rows into the rings, at the indices RoundState.path_rows
        made: the target's tapped hidden states' flat rows `rows` (path node d, root first)
        projected at positions `pos` (end + d) into ring rows `ring` (the scratch ring's past
        the path's end). rows, pos, ring (R,) int64; hidden (b * n, F)."""
        kv = self.drafter.context_kv(hidden.index_select(0, rows), pos)  # (R, nl, 2, Hkv, D)
        self.kv.view(-1, *self.kv.shape[2:]).index_copy_(0, ring, kv.to(self.kv.dtype))

    def advance(self, request_id: str, rows: int) -> None:
        """`rows` positions from `end` on were written into the ring on the device (a captured
        round's accepted rows); nothing may be pending."""
        ctx = self._ctx[request_id]
        if ctx.pending:
            raise RuntimeError(f"dflash context of {request_id}: advance with rows pending")
        ctx.end += rows
        ctx.count = min(self.width, ctx.count + rows)
        self._ctx.move_to_end(request_id)

    def has_pending(self, request_ids: list[str]) -> bool:
        """Whether any of these requests has rows observed but not yet projected."""
        return any((c := self._ctx.get(r)) is not None and c.pending_rows for r in request_ids)

    def ring(self, request_id: str) -> tuple[int, int, int] | None:
        """(slot, rows a draft reads (the newest, at most `window`), end) after projecting what
        is pending; None when the request holds no rows."""
        self.project([request_id])
        return self._held(request_id)

    def _held(self, request_id: str) -> tuple[int, int, int] | None:
        """`ring` without projecting first."""
        ctx = self._ctx.get(request_id)
        if ctx is None or ctx.count == 0 or ctx.slot is None:
            return None
        return ctx.slot, min(ctx.count, self.window), ctx.end

    def draft_meta(self, request_ids: list[str], last_tokens: list[int],
                   batch: int | None = None) -> list[list[int]]:  # fmt: skip
        """The (4, batch) rows a draft from the rings reads: rows read per request, its root
        token, its end (the block's first position), its slot; padding requests (up to `batch`):
        nothing read, the mask token, the scratch ring. RuntimeError naming a request without
        rows."""
        self.project(request_ids)  # one call for all (a no-op when nothing is pending)
        counts, ends, slots = [], [], []
        for rid in request_ids:
            held = self._held(rid)
            if held is None:
                raise RuntimeError(f"dflash: no target hidden states for {rid}")
            slots.append(held[0])
            counts.append(held[1])
            ends.append(held[2])
        pad = (batch or len(request_ids)) - len(request_ids)
        return [counts + [0] * pad, list(last_tokens) + [self.drafter.mask_token_id] * pad,
                ends + [0] * pad, slots + [self.scratch_slot] * pad]  # fmt: skip

    def draft(self, meta: torch.Tensor, depth: int, rows: int | None = None) -> torch.Tensor:
        """(B, L, V) draft logits from the rings: meta (4, B) int64 on the device (`draft_meta`);
        the first `rows` ring rows are read (default all W: what a captured draft reads; fewer
        when no ring has wrapped past them). Capture-safe: the rings are read in place
        (DFlashDrafter.propose_from_ring: fused kernels on a GPU, a gather and a mask elsewhere)."""
        rows = self.width if rows is None else rows
        return self.drafter.propose_from_ring(self.kv, meta, rows, depth)

    def eager_rows(self, ends: list[int]) -> int:
        """Ring rows an eager draft must read: up to the largest end while no ring wrapped."""
        top = max(ends)
        return self.width if top > self.width else max(1, top)

    def keys_values(self, request_id: str) -> tuple[torch.Tensor, int] | None:
        """(the newest `window` projected rows in position order (C, n_layers, 2, Hkv, D),
        position of row 0), after projecting what is pending; None when the request has no
        rows. (A copy: the drafts read the rings in place.)"""
        held = self.ring(request_id)
        if held is None:
            return None
        slot, c, end = held
        idx = torch.arange(end - c, end, device=self.kv.device) % self.width  # (C,)
        return self.kv[slot].index_select(0, idx), end - c

    def forget(self, request_id: str) -> None:
        ctx = self._ctx.pop(request_id, None)
        if ctx is not None:
            self._set_pending(ctx, [])
        if ctx is not None and ctx.slot is not None:
            self._free.append(ctx.slot)
