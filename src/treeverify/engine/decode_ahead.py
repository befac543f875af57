"""Plain decoding (greedy, or sampled with the fused step end) with each step launched before
the previous one is read (overlap).

A plain decode step on a GPU is one graph replay, but the host's part of it does not overlap the
GPU: it schedules (~25 us), stages the inputs (~40-65 us) and launches (~10 us) before the
replay, reads the tokens and does the bookkeeping after it. Measured on the H200 that is the
whole gap between the engine step and the forward (docs/performance.md). Here, per batch bucket
b, one graph runs a whole greedy step:

    unpack   the staged inputs (ids, positions, slots, prefix lengths, page table) into place
    forward  the decode bucket's forward -> (b, V) logits
    argmax   the tokens (b,), copied to a pinned host buffer once the step ends
    advance  the stage's device twin to the next step: ids = the tokens, positions and prefix
             lengths + 1, the new position's slot from the staged page table (valid rows only)

So the host launches step k+1 right after step k, before reading k's tokens, and does k's
bookkeeping (stops, detokenizing, the next schedule) while k+1 runs. Before a step at position q
is launched, the page of position q + 1 is held (`BlockManager.hold`) and in the staged page
table, since the step's advance looks its slot up there; the table is restaged alone when a hold
added a page (queued after the steps already launched, which read the table they had). The next
engine step takes the step launched ahead when it schedules the same requests, in order, at the
positions predicted, as plain greedy decodes (prefill chunks of an arrival in the same step run
their own forward after it); otherwise the launched step is discarded. It wrote
the K/V of the token greedy decoding puts there (or of a request that has finished) at a held
slot past every committed position, which the next step overwrites or nothing reads; stream order
puts it before any later step's writes, so there is nothing to undo but the hold. A request that
finished at step k wastes one step of GPU work; when some requests of the launched step are still
running, their rows are taken. What the next step does then:

- holes (TREEVERIFY_AHEAD_HOLES=1; off by default: on the H100 tiny-code's staggered batch ran
  1-6% faster with them and the 1B shape's 2.6% slower, unexplained, docs/performance.md,
  forty-second session): while the requests left still need the same bucket, the
  dropped rows become holes of it: their rows in the stage's device twin are marked invalid (no
  advance), their K/V goes to the scratch slot and their prefix length is 0 (their attention
  reads one key of page 0), three small fills queued after the step in flight (and the page
  table restaged once, one non-blocking copy, the holes' columns empty); the next step is
  launched ahead at once over the same rows, the holes' outputs ignored. Requests finishing one
  by one (rounds left them at different lengths; EOS in real traffic) then cost their rows'
  idle work (the bucket's M rows through every GEMM; a MoE's hole rows routed to experts too)
  where each finish cost one step staged and read first (the GPU idle while the host stages
  it). Once the requests left fit a smaller bucket, the next step is staged compact into it
  (read first) instead. An arrival or any other schedule discards the step as before;
- otherwise (0): the next step is staged by the host (read first), as a whole round's partial
  take is (engine/round_graphs.py, whose lookahead this mirrors).

Eligible steps (the engine decides, `LLM._plain_ahead`): only plain decodes without logprobs,
penalties or logit_bias, all greedy or, where the step's end is the fused Triton pick
(TREEVERIFY_FUSED_DECODE_STEP=1, the default; the CPU's eager body always), sampled without
top-p / top-k:
each row's draw is hashed on the device from its staged temperature and key and the token's
position (engine/sample_noise.py), the same draw the sampler makes, so the tokens are the read-
first path's. A DFlash drafter conditions on the target's hidden states of
every committed token, plain steps' too: each launch copies the graph's tapped rows right after
its replay (stream order puts the copy before the next step overwrites them), and the engine
hands them to the drafter once the step is read (`hidden`), as the read-first path does. With
the context's feed ring the copy goes into the ring and the drafter gets ids (`hidden_ids`);
with TREEVERIFY_RING_IN_GRAPH the graph itself writes them there (engine/ring_put.py), the ids
taken before each replay.
On by default where graphs are captured (`EngineConfig.decode_lookahead`, --decode-lookahead,
TREEVERIFY_DECODE_LOOKAHEAD). On the CPU the same body runs eagerly over stages made for it when
asked (nothing overlaps there; the tests check the bookkeeping that way). Measured on the H200
(bench engine decode, b=1): engine step 1.04 -> 0.95 ms on random:mla-moe, 1.25 -> 1.15 ms on the
1B shape, 0.29 -> 0.20 ms on tiny-code, each now within ~5-11% of its forward alone
(docs/performance.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from treeverify import env
from treeverify.engine import mapped_readback
from treeverify.engine.block_manager import BlockManager
from treeverify.engine.cuda_graphs import CudaGraphs, GraphCaptureError, capturing
from treeverify.engine.decode_step_end import end_step, end_step_torch
from treeverify.engine.feed_ring import FeedRing
from treeverify.engine.launch_ahead import LaunchAhead, Launched, positions_in
from treeverify.engine.pick_kernels import fused_picks
from treeverify.engine.ring_put import ring_put
from treeverify.engine.round_state import RoundState
from treeverify.engine.sampler import drawable, staged_draws
from treeverify.engine.scheduler import ScheduledChunk
from treeverify.engine.sequence import Sequence
from treeverify.kernels.staging import take_rows

log = logging.getLogger("treeverify.engine")


@dataclass
class _InFlight:
    """A step launched ahead: these sequences' next tokens, at positions `starts`."""

    seqs: list[Sequence | None]  # its rows in order; None: a hole (a request that finished)
    batch: int  # its bucket
    starts: list[int]  # each row's token position, as the previous step predicts (holes: -1)
    launched: Launched


HOLE: list[int] = []  # a hole's page list in a staged table: one object, so table_current holds


class DecodeAhead(LaunchAhead):
    def __init__(self, graphs: CudaGraphs, bm: BlockManager, batch_sizes: list[int], *,
                 capture: bool = True, moe_impl=None, ring: FeedRing | None = None,
                 reserve: Callable[[int], int] | None = None):  # fmt: skip
        """`graphs`: the engine's decode buckets (b, 1) (their stages, plans and forward are
        reused; on the CPU staged buckets, never captured); `moe_impl`: the runner's MoE-impl
        setter (sync-free routing while capturing); `ring` and `reserve`: a DFlash context's
        feed ring that the captured steps write their tapped rows into themselves
        (engine/ring_put.py) and what gives each launch its rows' ids first
        (DraftContextCache.ring_reserve)."""
        if capture and ring is not None and reserve is None:
            raise ValueError("reserve: required with a ring the step graphs write")
        self.graphs, self.bm = graphs, bm
        self.device = graphs.attention.cache.device
        self.state = RoundState(self.device, bm.page_size, glue=False)  # (no round glue here)
        # the step's end (argmax + advance) in two Triton launches (engine/decode_step_end.py)
        self.fused_end = capture and fused_picks()
        self.captured = capture
        # sampled rows too (each drawn on the device by its staged temperature and key): with
        # the fused end, or eagerly on the CPU; a captured PyTorch end takes greedy steps only
        self.sampling = self.fused_end or not capture
        self._sampled_now = False  # (eager: whether the staged requests sample)
        self.batch_sizes = self.sizes_made(graphs, batch_sizes, capture)
        # per bucket: the graph, its (b,) tokens and its (b, F) tapped hidden states (or None)
        self.steps: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]] = {}
        # per bucket two pinned token buffers + events, alternating: a step launched ahead
        # copies into the one its predecessor's read has already released
        self._readback: dict[int, list[tuple[torch.Tensor, torch.cuda.Event]]] = {}
        self._flip = 0
        # TREEVERIFY_MAPPED_READBACK: per bucket the graph's last kernel writes its tokens into
        # pinned host rows (engine/mapped_readback.py) instead of a copy queued after the replay
        self.use_mapped = capture and self.fused_end and env.mapped_readback()
        self.mapped: dict[int, mapped_readback.MappedRows] = {}
        self._init_in_flight()  # the step launched ahead (an _InFlight) and its counters
        self.pool = None
        self.replays = 0
        self.steady = False  # the last step took a step launched ahead and launched the next
        self.hidden: torch.Tensor | None = None  # the last step's (n, F) tapped rows, its order
        # with a feed ring (`sink`: DraftContextCache.ring_write): those rows' ids there instead
        self.sink = None
        self.hidden_ids: list[int] | None = None
        # TREEVERIFY_RING_IN_GRAPH: the graphs write the rows into `ring` (ring_put), and each
        # launch first takes their ids from `reserve` (DraftContextCache.ring_reserve)
        self.ring = ring if capture else None
        self.reserve = reserve
        self.holes = env.ahead_holes()  # finished rows become holes (module docstring)
        self.holed_rows = 0  # rows made holes so far
        t0 = time.perf_counter()
        if capture:
            previous = moe_impl("graph") if moe_impl is not None else None
            try:
                for b in reversed(self.batch_sizes):
                    self.steps[b] = self._capture(b)
                    self._readback[b] = [(torch.empty(b, dtype=torch.int64, pin_memory=True),
                                          torch.cuda.Event()) for _ in range(2)]  # fmt: skip
            finally:
                if moe_impl is not None:
                    moe_impl(previous)
                graphs.attention.select(None)
            if self.ring is not None:  # the warm-ups' and captures' writes undone
                self.ring.graphs_captured()
            log.info("greedy decode steps launched ahead: captured batch %s in %.2f s",
                     self.batch_sizes, time.perf_counter() - t0)  # fmt: skip
        self.capture_seconds = time.perf_counter() - t0

    @staticmethod
    def sizes_made(graphs: CudaGraphs, batch_sizes: list[int], capture: bool) -> list[int]:
        """The batch buckets a DecodeAhead over `graphs` makes steps for: captured, those
        whose decode bucket (b, 1) was captured; eager, all."""
        return sorted(b for b in set(batch_sizes) if not capture or (b, 1) in graphs.steps)

    # ---- the step's device work ----------------------------------------------------------------
    def _body(self, b: int) -> torch.Tensor:
        """One decode step of bucket b from its stage's twin (greedy rows their argmax, sampled
        rows the hashed draw), the twin advanced to the next step; returns the (b,) tokens.
        Capture-safe."""
        graphs = self.graphs
        stage = graphs.stages[(b, 1)]
        v = stage.views
        graphs._unpack(stage, b, 1)
        logits = graphs.forward_rows(b)  # (b, V) fp32
        # eager: hash only when a staged request samples; a captured graph's greedy rows skip
        # it in the kernel
        sampled = self.sampling if self.captured else self._sampled_now
        if self.fused_end:
            return end_step(logits, v, b, stage.scratch_slot, self.bm.page_size, sampled=sampled)
        return end_step_torch(logits, v, b, stage.scratch_slot, self.state, sampled=sampled)

    @torch.inference_mode()
    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]:
        try:
            self.graphs.attention.select((b, 1))  # the decode bucket's plans (its graph's)
            stage = self.graphs.stages[(b, 1)]
            saved = stage.dev.clone()  # the warmup and capture advance the twin: put it back
            rows = mapped_readback.MappedRows((b,), self.device) if self.use_mapped else None
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warmup: lazy kernels, cuBLAS handles, allocator
                warm = self._body(b)
                self._put_in_ring(b)  # (its kernel compiled before the capture)
                if rows is not None:
                    rows.write(warm)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, self.pool):
                tokens = self._body(b)
                self._put_in_ring(b)
                if rows is not None:  # the graph's last node: the tokens to the host rows
                    rows.write(tokens)
            self.pool = graph.pool()
            hidden = getattr(self.graphs.model, "captured", None)  # (b, F) written by a replay
            stage.dev.copy_(saved)
            torch.cuda.synchronize()
            if rows is not None:
                rows.reset()
                self.mapped[b] = rows
        except Exception as exc:
            raise GraphCaptureError(f"CUDA graph capture failed for the greedy decode step "
                                    f"launched ahead, batch={b}: {type(exc).__name__}: {exc}"
                                    ) from exc  # fmt: skip
        return graph, tokens, hidden

    def _put_in_ring(self, b: int) -> None:
        """With a ring: the step's (b, F) tapped rows into it at the device head (ring_put)."""
        if self.ring is not None:
            ring_put(self.graphs.model.captured, self.ring.buf, self.ring.device_head)

    # ---- a step --------------------------------------------------------------------------------
    def _take(self, chunks: list[ScheduledChunk]) -> tuple[_InFlight, list[int]] | None:
        """The step in flight and where each chunk's sequence is in it, when it is this step's:
        the chunks' sequences its own in order (or those of them still running), each at the
        position predicted. Else None, discarding it."""
        fl = self._in_flight
        if fl is None:
            return None
        pick = positions_in(fl.seqs, [c.seq for c in chunks])
        if pick is None or any(c.start != fl.starts[i] for c, i in zip(chunks, pick,
                                                                         strict=True)):  # fmt: skip
            self.discard()
            return None
        self._taken(fl, pick)
        return fl, pick

    def _bucket(self, n: int) -> int | None:
        """The smallest batch bucket made that holds n requests (None: none does)."""
        return next((s for s in self.batch_sizes if s >= n), None)

    def bucket_for(self, chunks: list[ScheduledChunk]) -> int | None:
        """The batch bucket a step of these decodes replays, when one was made and the staged
        page table holds their pages (those held for the next step too)."""
        b = self._bucket(len(chunks))
        if b is None:
            return None
        if any(self.bm.pages_for(c.start + 3) > self.graphs.max_pages for c in chunks):
            return None
        return b

    @torch.inference_mode()
    def step(self, chunks: list[ScheduledChunk], *, ahead: bool) -> list[int] | None:
        """This step's greedy tokens for `chunks` (one plain decode each, at position q): the
        step launched ahead by the previous engine step when it matches, else staged and
        launched now; with `ahead`, the next step is launched before this one is read. None
        when no bucket holds this step (nothing was launched then)."""
        seqs = [c.seq for c in chunks]
        starts = [c.start for c in chunks]
        taken = self._take(chunks)
        self.steady = False
        if taken is None:
            b = self.bucket_for(chunks)
            if b is None:
                return None
            # this step's advance looks up the slot of q + 1: that page staged with the rest
            ahead = ahead and self._hold(seqs, [q + 2 for q in starts], self.graphs.max_pages)
            if not ahead:
                for seq in seqs:
                    self.bm.release_hold(seq)
            temps, keys = staged_draws(seqs)
            self._sampled_now = keys is not None
            self._stage(b).write_decodes([c.token_ids[0] for c in chunks], starts,
                                         [c.slots[0] for c in chunks],
                                         [s.block_table for s in seqs], temps,
                                         keys)  # fmt: skip
            now, width, pick = self._launch(b), len(seqs), None
        else:
            fl, pick = taken
            b, now, width = fl.batch, fl.launched, len(fl.seqs)
        # the next step's rows: this step's sequences where `now` has them, holes elsewhere
        rows: list[Sequence | None] = seqs
        next_starts, dropped = [q + 1 for q in starts], []
        if taken is not None and len(pick) < width:  # some of `now`'s rows are holes or dropped
            rows, next_starts = [None] * width, [-1] * width
            for seq, q, i in zip(seqs, starts, pick, strict=True):
                rows[i], next_starts[i] = seq, q + 1
            dropped = [i for i, s in enumerate(fl.seqs) if s is not None and rows[i] is None]
        if dropped and (not self.holes or self._bucket(len(seqs)) < b):
            # its twin still has the dropped rows: the next step is staged (read first), into
            # the smaller bucket the requests left now fit when holes are on (a hole would keep
            # b rows through every GEMM for every step left, a MoE's routed to experts too)
            ahead = False
        if ahead:  # the next step's advance looks up q + 2: hold that page, restage the table
            ahead = self._hold(seqs, [q + 3 for q in starts], self.graphs.max_pages)
            tables = [HOLE if s is None else s.block_table for s in rows]
            if ahead and not self._stage(b).table_current(tables):  # a page was added
                self._stage(b).write_table(tables)  # after `now`
        if not ahead:  # nothing launched ahead: held pages without a slot go back
            for seq in seqs:
                self.bm.release_hold(seq)
            return self._read(now, width, pick)
        if dropped:
            self._make_holes(b, dropped)  # after `now`, whose advance wrote the twin
        nxt = self._launch(b) if self.captured else None  # before reading `now`
        tokens = self._read(now, width, pick)
        if nxt is None:  # eager: `now` ran, its advance staged the next step
            nxt = self._launch(b)
        self._in_flight = _InFlight(rows, b, next_starts, nxt)
        self.steady = taken is not None
        return tokens

    def _make_holes(self, b: int, dropped: list[int]) -> None:
        """Bucket b's twin rows `dropped` made holes for the steps launched from it: invalid
        (the step's end leaves them as they are), K/V to the scratch slot, no prefix to read.
        Three fills a row, queued on the stream (no upload, no sync)."""
        stage = self._stage(b)
        v = stage.views
        for i in dropped:
            v["valid"][i : i + 1].fill_(0)
            v["slots"][i : i + 1].fill_(stage.scratch_slot)
            v["prefix"][i : i + 1].fill_(0)
        self.holed_rows += len(dropped)

    def _read(self, launched: Launched, width: int, pick: list[int] | None) -> list[int]:
        """The step's tokens (waits for that step only), those of `pick` when some of its
        requests are gone; its tapped hidden rows, the same ones, in `hidden`."""
        tokens = launched.rows(width)
        rows = range(width) if pick is None else pick  # the bucket's padding rows dropped
        self.hidden = None if launched.hidden is None else take_rows(launched.hidden, rows)
        first = launched.ring_first
        self.hidden_ids = None if first is None else [first + r for r in rows]
        return tokens if pick is None else [tokens[i] for i in pick]

    def _stage(self, b: int):
        """Bucket b's decode stage (on the CPU made on first use, eagerly)."""
        return self.graphs.stages.get((b, 1)) or self.graphs.prepare_stage(b, 1)

    def _launch(self, b: int) -> Launched:
        """Replay (GPU) or run (CPU) the staged step; its tokens are queued for the host."""
        self.replays += 1
        if self.captured:
            graph, tokens, hidden = self.steps[b]
            # the rows' ids taken before the replay writes them into the ring: what makes room
            # (spills, projections of rows it would overwrite) is queued ahead of it
            first = None if self.ring is None else self.reserve(b)
            graph.replay()
            rows = self.mapped.get(b)
            # the graph turned its flip: mirrored at once, so a raise below (the feed ring's
            # copy may project or spill) cannot part host and device (a review)
            written = rows.launched() if rows is not None else None
            kept = None
            if first is None:
                kept, first = self._keep(hidden)  # before the next replay's
            host, done = self._readback[b][self._flip]
            self._flip ^= 1
            if written is not None:  # the graph wrote them: the row of this launch's parity
                host = written
            else:
                host.copy_(tokens, non_blocking=True)
            done.record()
            return Launched(host, done, kept, first)
        self.graphs.attention.select((b, 1))
        try:
            tokens = self._body(b)
        finally:
            self.graphs.attention.select(None)
        kept, first = self._keep(getattr(self.graphs.model, "captured", None))  # (b, F)
        return Launched(tokens.clone(), None, kept, first)

    def _keep(self, hidden: torch.Tensor | None) -> tuple[torch.Tensor | None, int | None]:
        """A step's tapped rows kept past the next replay: into the feed ring (their first
        id), or as a clone."""
        if hidden is None:
            return None, None
        if self.sink is not None:
            return None, self.sink(hidden)
        return hidden.clone(), None

    def takes(self, seqs: list[Sequence]) -> bool:
        """Whether a step of these requests' plain decodes can run here as to their sampling
        (sampler.drawable)."""
        return drawable(seqs, self.sampling)

    @property
    def info(self) -> dict:
        return {
            "batch_sizes": self.batch_sizes,
            "captured": self.captured,
            "capture_seconds": round(self.capture_seconds, 3),
            "replays": self.replays,
            "ahead_used": self.ahead_used,
            "ahead_discarded": self.ahead_discarded,
            "ahead_partial": self.ahead_partial,
            "holes": self.holes,
            "holed_rows": self.holed_rows,
            "fused_step_end": self.fused_end,
            "sampled_steps": self.sampling,
            "mapped_readback": bool(self.mapped),
            "ring_in_graph": self.ring is not None,
        }
