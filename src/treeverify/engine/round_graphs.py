"""A whole speculative round (greedy, or sampled) in one CUDA graph replay per (batch bucket,
budget).

A round taken piece by piece (engine/speculative.py) is five graph replays with host work between
them: project the context rows, draft, build, stage the trees, verify, accept, gather the
accepted rows' hidden states for the drafter. On a small target that host work, not the GPU,
sets the pace (measured on the H200, tiny-code b=1: 1.7 ms of wall per round for 0.73 ms of GPU
work). Here the round's device work is one graph that reads only fixed buffers:

    draft      DFlash over each request's context ring (engine/draft_context.py) -> (B, L, V)
    build      DDTree's best-`budget` tree (or CHAIN's one path) and its ancestor mask
    stage      the trees' ids, positions (prefix + depth) and mask into the bucket's StepStage
    verify     the bucket's unpack + the target forward (the same as the verify graph's)
    accept     each node's token (its argmax; a sampled request's node: plain decoding's draw
               for the position after it, hashed in the pick kernel from the request's staged
               temperature and key, engine/pick_kernels.py), the walk, the accepted K/V moved
               into place, the result packed
    context    the accepted rows' hidden states -> the drafter's keys/values -> their rings

The host stages two small inputs (the draft's meta, the verify stage: prefix lengths, page
table; the graph finds the nodes' slots in it, engine/round_state.py) in one pinned copy each,
replays once, and reads back one (B, 2 + 2K) int64 result:
[accepted length m, bonus, committed tokens K, path node per depth K]. Its commit then only
moves counters: the block manager keeps m - 1 reserved slots, the context ring advances by m.

Lookahead (`lookahead=True`, on by default where rounds are captured): the round graph ends by
advancing its own inputs to the next round's (each request's root = its bonus, prefix and ring
end + accepted length m, context rows read, the nodes' slots from the staged page table). So the
host launches round k+1 right after round k, before reading k's result, and commits k (block
manager, stops, detokenizing, the controller, the next schedule) while k+1 runs: the GPU no longer
idles through the host's part of a round. Round k+1's nodes land at most L + 1 positions further,
so the block manager holds pages that far ahead (`BlockManager.hold`) and the page table is
restaged alone. Round k+1 runs at the budget the adaptive controller chose for the next step
when k+1 was launched (another budget's bucket: its stage written whole, its prefix lengths
copied on the device from round k's advanced ones), so a switch or a probe keeps the overlap.
The next step consumes round k+1 when it schedules the same requests at that budget at the
positions round k's commit predicted; otherwise k+1 is discarded: its K/V went to
held slots past every committed position and its context rows past each ring's end, which the
next round overwrites or masks (the rings' SLACK), so there is nothing to undo but the hold. A
request that finished at round k wastes one round of GPU work.

A step whose decodes are all rounds of DFlash-drafted requests without penalties, logit_bias or
logprobs, greedy or (with the fused pick: TREEVERIFY_FUSED_DECODE_STEP=1, the default, on a
GPU; always on the CPU's eager body) sampled without top-p / top-k, takes this path (prefill
chunks in the same step run their own forward after the replay); so do n-gram-drafted ones
(`EngineConfig.ngram_whole_rounds`; the context is then engine/ngram_rings.py: the requests' newest
tokens, drafted by the device matcher; the round writes its accepted tokens where DFlash's writes
keys/values). Any other round (top-p / top-k sampling, a step with a plain or opted-out decode,
reservations that do not fit the free pages together) takes the general one, whose results it equals
(tests/test_round_graphs.py and tests/test_ngram_rounds.py: step by step, through preemption, aborts
and stops). On the CPU the same body runs eagerly (`capture=False`), which is how the tests check it
without a GPU.
Measured on the H200: docs/performance.md.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from treeverify import env
from treeverify.engine import mapped_readback
from treeverify.engine.cuda_graphs import CudaGraphs, GraphCaptureError, capturing
from treeverify.engine.draft_context import DraftContextCache
from treeverify.engine.draft_graphs import DraftMeta
from treeverify.engine.launch_ahead import LaunchAhead, Launched, positions_in
from treeverify.engine.pick_kernels import fused_picks, pick_tokens, pick_tokens_torch
from treeverify.engine.round_state import RoundState
from treeverify.engine.sampler import drawable, staged_draws
from treeverify.engine.sequence import Sequence

log = logging.getLogger("treeverify.engine")


@dataclass
class _InFlight:
    """A round launched ahead: for these sequences, at this budget, rooted at `starts`."""

    seqs: list[Sequence]
    budget: int
    batch: int  # its bucket
    starts: list[int]  # each root's position, as the previous round's commit predicts
    launched: Launched


class RoundGraphs(LaunchAhead):
    def __init__(self, graphs: CudaGraphs, spec, context: DraftContextCache,
                 batch_sizes: list[int], budgets: list[int], *, capture: bool = True,
                 lookahead: bool = False, moe_impl=None):  # fmt: skip
        """`graphs`: the engine's verify buckets (their stages, plans and forward are reused);
        `spec`: the SpeculativeDecoder (algorithm, depths, the K/V move); `lookahead`: launch
        each round's successor before reading it (see the module docstring); `moe_impl`: the
        runner's MoE-impl setter (sync-free routing while capturing)."""
        self.graphs, self.spec, self.context = graphs, spec, context
        self.model = graphs.model
        self.bm = spec.bm
        dev = graphs.attention.cache.device
        self.device = dev
        self.batch_sizes = sorted(set(batch_sizes))
        self.budgets = sorted(set(budgets))
        mb = self.batch_sizes[-1]
        self.meta = DraftMeta(context, mb, dev)  # (4, max_bucket) on the device
        self.state = RoundState(dev, self.bm.page_size)
        self.captured = capture
        self.lookahead = lookahead
        # sampled rounds too (each node drawn on the device by its request's staged temperature
        # and key, engine/pick_kernels.py): captured with the fused pick (Triton,
        # TREEVERIFY_FUSED_DECODE_STEP), or eagerly on the CPU; else greedy rounds only
        self.sampling = not capture or fused_picks()
        self._sampled_now = False  # (eager: whether this launch's requests sample)
        self.rounds: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph | None, torch.Tensor]] = {}
        # per bucket, two pinned result buffers + events, alternating: a round launched ahead
        # copies into the one its predecessor's read has already released
        self._readback: dict[tuple[int, int], list[tuple[torch.Tensor, torch.cuda.Event]]] = {}
        self._flip = 0
        # TREEVERIFY_MAPPED_READBACK: per bucket the graph's last kernel writes the packed
        # result into pinned host rows (engine/mapped_readback.py), no copy after the replay
        self.use_mapped = capture and fused_picks() and env.mapped_readback()
        self.mapped: dict[tuple[int, int], mapped_readback.MappedRows] = {}
        self._init_in_flight()  # the round launched ahead (an _InFlight) and its counters
        self.pool = None
        self.replays = 0
        self.ahead_switched = 0  # ... launched at another budget than the round before it
        # the last step ran overlapped: it took a round launched ahead and launched the next
        # (with lookahead, the cost a budget has when the controller stays on it)
        self.steady = not lookahead
        self.report: list[dict] = []
        t_all = time.perf_counter()
        previous = moe_impl("graph") if moe_impl is not None else None
        try:
            for budget in self.budgets:
                n = spec.nodes_for(budget)
                for b in reversed(self.batch_sizes):
                    if capture and (b, n) not in graphs.stages:
                        continue  # no verify bucket of this shape (not captured)
                    t0 = time.perf_counter()
                    self.rounds[(b, budget)] = self._capture(b, budget) if capture else (None, None)
                    if capture:
                        packed = self.rounds[(b, budget)][1]
                        self._readback[(b, budget)] = [
                            (torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True),
                             torch.cuda.Event()) for _ in range(2)]  # fmt: skip
                    self.report.append({"batch": b, "budget": budget,
                                        "seconds": round(time.perf_counter() - t0, 4)})  # fmt: skip
        finally:
            if moe_impl is not None:
                moe_impl(previous)
            graphs.attention.select(None)
        self.capture_seconds = time.perf_counter() - t_all
        if capture:
            log.info("whole-round graphs: captured %d (batch %s x budget %s) in %.2f s",
                     len(self.rounds), self.batch_sizes, self.budgets,
                     self.capture_seconds)  # fmt: skip

    # ---- the round's device work ---------------------------------------------------------------
    def _body(self, b: int, budget: int, rows_read: int | None = None) -> torch.Tensor:
        """One round for a bucket of b requests: every input from fixed buffers (the draft meta,
        the verify stage), the packed (b, 2 + 2K) result out. Capture-safe. `rows_read`: ring
        rows the draft reads (captured: all of them; eager: those in use)."""
        spec, graphs, ctx = self.spec, self.graphs, self.context
        n = spec.nodes_for(budget)
        depth = spec.draft_depth(budget)  # L: drafted positions, the mask's and walk's depth
        rows = b * n
        meta = self.meta.dev[:, :b]  # (4, b): rows read, roots, ends (= prefix), ring slots
        logits = ctx.draft(meta, depth, rows_read)  # (b, L, V)
        tokens, parents, depths, mask = spec.trees(logits, meta[1], budget)  # (b, n).., (rows, w)
        stage = graphs.stages[(b, n)]
        v = stage.views
        # ids, positions, mask and node slots (from the staged prefix + pages)
        self.state.stage_trees(v, b, n, stage.scratch_slot, meta, tokens, depths, mask)
        graphs._unpack(stage, b, n)
        out = graphs.forward_rows(rows)  # (rows, V)
        hidden = getattr(self.model, "captured", None)  # (rows, F) DFlash's tapped layers
        post = self._posterior(out, v, rows).view(b, n)  # each node's token: argmax or draw
        slots = v["slots"][:rows].view(b, n)  # (b, n) node i at position P + i
        packed = spec.accept_move_pack(tokens, parents, post, slots, depth)  # (b, 2 + 2k)
        # The accepted rows (root first) are the next context rows: position P + d of the path;
        # their indices, then the next round's inputs (what a round launched ahead replays
        # with; a round the host stages overwrites them)
        idx = self.state.path_rows(self.meta.dev, b, n, packed, ctx.width,
                                   ctx.scratch_slot * ctx.width, v, ctx.window)  # fmt: skip
        ctx.write_rows(*idx, tokens, hidden)  # DFlash: their keys/values; n-gram: their ids
        return packed

    def _posterior(self, out: torch.Tensor, v: dict[str, torch.Tensor], rows: int) -> torch.Tensor:
        """(rows,) each node's token from the verify logits (rows, V): greedy rows their argmax,
        sampled rows (staged temperature > 0) the draw plain decoding makes for the position
        after the node (so the walk commits plain sampled decoding's tokens: sampler.draw_nodes)."""
        if not self.sampling or (not self.captured and not self._sampled_now):
            return out.argmax(-1)
        pick = pick_tokens if self.captured else pick_tokens_torch
        return pick(out, v["temp"][:rows], v["key"][:rows], v["pos"][:rows], pos_offset=1)

    def takes(self, seqs: list[Sequence]) -> bool:
        """Whether these requests' rounds can run here as to their sampling (sampler.drawable)."""
        return drawable(seqs, self.sampling)

    def _sampling_rows(self, seqs: list[Sequence]) -> tuple[list[float] | None, list[int] | None]:
        """The requests' temperatures and draw keys for their stage (sampler.staged_draws), and
        whether an eager launch of them draws."""
        temps, keys = staged_draws(seqs)
        self._sampled_now = keys is not None
        return temps, keys

    @torch.inference_mode()
    def _capture(self, b: int, budget: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        n = self.spec.nodes_for(budget)
        try:
            self.graphs.attention.select((b, n))  # the verify bucket's plans (its graph's)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            rows = None
            with torch.cuda.stream(side):  # warmup: lazy kernels, cuBLAS handles, allocator
                warm = self._body(b, budget)
                if self.use_mapped:  # (its kernel compiled before the capture)
                    rows = mapped_readback.MappedRows(tuple(warm.shape), warm.device)
                    rows.write(warm)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, self.pool):
                packed = self._body(b, budget)
                if rows is not None:  # the graph's last node: the result to the host rows
                    rows.write(packed)
            self.pool = graph.pool()
            torch.cuda.synchronize()
            if rows is not None:
                rows.reset()
                self.mapped[(b, budget)] = rows
        except Exception as exc:
            raise GraphCaptureError(f"CUDA graph capture failed for the whole-round bucket "
                                    f"batch={b} budget={budget}: {type(exc).__name__}: {exc}"
                                    ) from exc  # fmt: skip
        return graph, packed

    # ---- a round -------------------------------------------------------------------------------
    def bucket_for(self, seqs: list[Sequence], budget: int) -> int | None:
        """The batch bucket a round of these sequences at `budget` replays, when one was made
        and the reservations fit: all of them together in the free pages, each in the staged
        page table. (Else the general path reserves for those that fit and decodes the rest.)"""
        b = next((s for s in self.batch_sizes if s >= len(seqs)), None)
        if b is None or (b, budget) not in self.rounds:
            return None
        n, ps = self.spec.nodes_for(budget), self.bm.page_size
        need = 0  # new pages for every reservation together (each alone may fit, all not)
        for seq in seqs:
            need += self.bm.num_pages_needed(seq, n - 1)
            if -(-(seq.num_slots + n - 1) // ps) > self.graphs.max_pages:
                return None
        return b if need <= self.bm.num_free_pages else None

    def ahead_budget(self, seqs: list[Sequence]) -> int | None:
        """The budget of the round launched ahead when it holds these sequences' rounds."""
        fl = self._in_flight
        return fl.budget if fl is not None and positions_in(fl.seqs, seqs) is not None else None

    def _take(self, seqs: list[Sequence], budget: int) -> tuple[_InFlight, list[int]] | None:
        """The round in flight and where each of `seqs` is in it, if it is this step's: the
        same budget, `seqs` its requests in order or those of them still running (the others
        finished, were aborted or preempted: their rows are dropped, not their neighbours'),
        each rooted where it now ends, nothing new for the drafter. Else None, discarding it."""
        fl = self._in_flight
        if fl is None:
            return None
        pick = positions_in(fl.seqs, seqs)
        ok = (
            fl.budget == budget
            and pick is not None
            and all(
                s.num_tokens - 1 == fl.starts[i] == s.num_cached_tokens
                for s, i in zip(seqs, pick, strict=True)
            )
            and not self.context.has_pending([s.request_id for s in seqs])
        )
        if not ok:
            self.discard()
            return None
        self._taken(fl, pick)
        return fl, pick

    @torch.inference_mode()
    def step(self, seqs: list[Sequence], budget: int, *, ahead: bool = False,
             next_budget: int | None = None) -> list[list[int]] | None:  # fmt: skip
        """This step's round for `seqs` (greedy, DFlash-drafted): the one launched ahead by the
        previous step when it matches, else reserved, staged and launched now; with `ahead` (and
        `lookahead`), the next round is launched before this one is read, at `next_budget`
        (default: this budget; another one when its bucket was made, its stage then written
        whole and its prefix lengths copied on the device from this round's advanced ones).
        Returns each sequence's packed row [m, bonus, committed K, path K] as host lists, or
        None when no bucket holds this round (nothing was reserved or launched then)."""
        n = self.spec.nodes_for(budget)
        nb = budget if next_budget is None else next_budget
        taken = self._take(seqs, budget)
        self.steady = not self.lookahead  # (set below once it launched ahead of a taken round)
        if taken is None:
            b = self.bucket_for(seqs, budget)
            if b is None:
                return None
            # DFlash: projects the rows observed since the last round (a prefill, plain steps);
            # n-gram: writes the tokens committed since (engine/ngram_rings.py)
            self.context.prepare(seqs, self.device)
            meta = self.meta.stage([s.request_id for s in seqs], [s.last_token_id for s in seqs])
            starts = [s.num_tokens - 1 for s in seqs]  # the roots' positions = the cached tokens
            for seq, end, start in zip(seqs, meta[2][: len(seqs)], starts, strict=True):
                if end != start or seq.num_cached_tokens != start:
                    raise RuntimeError(
                        f"draft context of {seq.request_id}: rows end at position "
                        f"{end}, the cache holds {seq.num_cached_tokens} tokens"
                    )
            for seq in seqs:  # after the checks: a failed round leaves nothing reserved
                self.bm.reserve(seq, n - 1)
            held = ahead and self._hold_next(seqs, starts, b, budget, nb)
            tables = [s.block_table for s in seqs]
            temps, keys = self._sampling_rows(seqs)
            self._stage(b, budget).write_round(tables, starts, temps, keys)  # it finds the slots
            now = self._launch(b, budget, self.context.eager_rows(meta[2][: len(seqs)]))
        else:
            fl, pick = taken
            b, now = fl.batch, fl.launched
            starts = [fl.starts[i] for i in pick]
            if len(pick) < len(fl.seqs):  # its device state still has the dropped requests'
                ahead = False  # rows: the next round is staged by the host (read first)
            for seq in seqs:  # the slots it wrote: in pages held for it, no new page
                if self.bm.num_pages_needed(seq, n - 1):
                    raise RuntimeError(f"round launched ahead for {seq.request_id}: its pages "
                                       "were not held")  # fmt: skip
                self.bm.reserve(seq, n - 1)
            held = ahead and self._hold_next(seqs, starts, b, budget, nb)
            stage, tables = self.graphs.stages[(b, n)], [s.block_table for s in seqs]
            if held and nb == budget and not stage.table_current(tables):  # a page was added:
                stage.write_table(tables)  # queued after `now`, which read the table it had
        if not held:  # nothing launched ahead: pages held for this round are in its slots now
            for seq in seqs:
                self.bm.release_hold(seq)
            if taken is None:
                return now.rows(len(seqs))
            rows = now.rows(len(taken[0].seqs))
            return [rows[i] for i in taken[1]]
        self.steady = taken is not None
        if nb != budget:  # the other bucket's stage: this layout, `now`'s advanced prefixes
            stage = self._stage(b, nb)
            temps, keys = self._sampling_rows(seqs)
            stage.write_round(
                [s.block_table for s in seqs], starts, temps, keys
            )  # prefixes replaced below fmt: skip
            stage.views["prefix"][:b].copy_(self._stage(b, budget).views["prefix"][:b])
        nxt = self._launch(b, nb, None) if self.captured else None  # before reading `now`
        rows = now.rows(len(seqs))  # on a GPU: waits for this round, not the next
        nxt_starts = [p + r[0] for p, r in zip(starts, rows, strict=True)]
        if nxt is None:  # eager: `now` is done; the next draft reads the rows its ends need
            nxt = self._launch(b, nb, self.context.eager_rows(nxt_starts))
        self._in_flight = _InFlight(list(seqs), nb, b, nxt_starts, nxt)
        self.ahead_switched += nb != budget
        return rows

    def _stage(self, b: int, budget: int):
        """The verify stage a round at `budget` of bucket b reads (made on first use eagerly)."""
        n = self.spec.nodes_for(budget)
        return self.graphs.stages.get((b, n)) or self.graphs.prepare_stage(b, n)

    def _hold_next(self, seqs: list[Sequence], starts: list[int], b: int, budget: int,
                   nb: int) -> bool:  # fmt: skip
        """Hold pages for the next round's nodes, at budget `nb` after this one's `budget`
        (rooted at most L + 1 positions further): True when lookahead is on, a round at `nb`
        was made for bucket b, and every sequence's pages fit the free pages and the staged
        page table."""
        if not self.lookahead or (nb != budget and (nb <= 0 or (b, nb) not in self.rounds)):
            return False
        reach = self.spec.draft_depth(nb) + 1 + self.spec.nodes_for(nb)
        return self._hold(seqs, [p + reach for p in starts], self.graphs.max_pages)

    def _launch(self, b: int, budget: int, rows_read: int | None) -> Launched:
        """Replay (GPU) or run (CPU) the staged round; its result is queued for the host."""
        self.replays += 1
        if self.captured:
            graph, packed = self.rounds[(b, budget)]
            graph.replay()
            host, done = self._readback[(b, budget)][self._flip]
            self._flip ^= 1
            rows = self.mapped.get((b, budget))
            if rows is not None:  # the graph wrote it: the row of this launch's parity
                host = rows.launched()
            else:
                host.copy_(packed, non_blocking=True)
            done.record()
            return Launched(host, done)
        n = self.spec.nodes_for(budget)
        self.graphs.attention.select((b, n))
        try:
            packed = self._body(b, budget, rows_read)
        finally:
            self.graphs.attention.select(None)
        return Launched(packed.clone(), None)

    @property
    def info(self) -> dict:
        return {
            "buckets": sorted([list(k) for k in self.rounds]),
            "captured": self.captured,
            "capture_seconds": round(self.capture_seconds, 3),
            "replays": self.replays,
            "lookahead": self.lookahead,
            "ahead_used": self.ahead_used,
            "ahead_discarded": self.ahead_discarded,
            "ahead_partial": self.ahead_partial,
            "ahead_switched": self.ahead_switched,
            "mapped_readback": bool(self.mapped),
        }
