"""A whole greedy speculative round in one CUDA graph replay per (batch bucket, budget).

A round taken piece by piece (engine/speculative.py) is five graph replays with host work between
them: project the context rows, draft, build, stage the trees, verify, accept, gather the
accepted rows' hidden states for the drafter. On a small target that host work, not the GPU,
sets the pace (measured on the H200, tiny-code b=1: 1.7 ms of wall per round for 0.73 ms of GPU
work). Here the round's device work is one graph that reads only fixed buffers:

    draft      DFlash over each request's context ring (engine/draft_context.py) -> (B, L, V)
    build      DDTree's best-`budget` tree (or CHAIN's one path) and its ancestor mask
    stage      the trees' ids, positions (prefix + depth) and mask into the bucket's StepStage
    verify     the bucket's unpack + the target forward (the same as the verify graph's)
    accept     the greedy walk, the accepted K/V moved into place, the result packed
    context    the accepted rows' hidden states -> the drafter's keys/values -> their rings

The host stages two small inputs (the draft's meta, the verify stage: slots, prefix lengths,
page table) in one pinned copy each, replays once, and reads back one (B, 2 + 2K) int64 result:
[accepted length m, bonus, committed tokens K, path node per depth K]. Its commit then only
moves counters: the block manager keeps m - 1 reserved slots, the context ring advances by m.

A step whose decodes are all greedy rounds of DFlash-drafted requests without penalties,
logit_bias or logprobs takes this path (prefill chunks in the same step run their own forward
after the replay); any other round (sampled acceptance, n-gram drafts, a step with a plain or
opted-out decode, reservations that do not fit the free pages together) takes the general one,
whose results it equals (tests/test_round_graphs.py: step by step, through preemption, aborts
and stops). On the CPU the same body runs eagerly (`capture=False`), which is how the tests
check it without a GPU. Measured on the H200: docs/performance.md.
"""

from __future__ import annotations

import logging
import time

import torch

from treeverify.engine.cuda_graphs import CudaGraphs, GraphCaptureError, capturing
from treeverify.engine.draft_context import DraftContextCache
from treeverify.engine.draft_graphs import DraftMeta
from treeverify.engine.sequence import Sequence
from treeverify.spec import accept_greedy

log = logging.getLogger("treeverify.engine")


class RoundGraphs:
    def __init__(self, graphs: CudaGraphs, spec, context: DraftContextCache,
                 batch_sizes: list[int], budgets: list[int], *, capture: bool = True,
                 moe_impl=None):  # fmt: skip
        """`graphs`: the engine's verify buckets (their stages, plans and forward are reused);
        `spec`: the SpeculativeDecoder (algorithm, depths, the K/V move); `moe_impl`: the
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
        self.captured = capture
        self.rounds: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph | None, torch.Tensor]] = {}
        self.pool = None
        self.replays = 0
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
        v["ids"][:rows].copy_(tokens.reshape(-1))
        torch.add(depths, meta[2][:, None], out=v["pos"][:rows].view(b, n))
        v["mask"][:rows].zero_()
        v["mask"][:rows, : mask.shape[1]].copy_(mask)
        graphs._unpack(stage, b, n)
        out = graphs.forward_rows(rows)  # (rows, V)
        hidden = self.model.captured  # (rows, F) the drafter's tapped layers
        acc = accept_greedy(tokens, parents, out.view(b, n, -1).argmax(-1), max_depth=depth)
        slots = v["slots"][:rows].view(b, n)  # (b, n) node i at position P + i
        packed = spec._move_and_pack(tokens, parents, slots, acc.path, acc.length, acc.bonus)
        # The accepted rows (root first) are the next context rows: position P + d of the path.
        k = (packed.shape[1] - 2) // 2
        node = acc.path[:, :k].clamp(min=0)  # (b, k)
        keep = torch.arange(k, device=self.device)[None, :] < acc.length[:, None]  # (b, k)
        feats = hidden.view(b, n, -1).gather(1, node[..., None].expand(-1, -1, hidden.shape[-1]))
        pos = meta[2][:, None] + torch.arange(k, device=self.device)[None, :]  # (b, k)
        kv = ctx.drafter.context_kv(feats.reshape(b * k, -1), pos.reshape(-1))  # (b*k, nl, ..)
        w = ctx.width
        ring = torch.where(keep, meta[3][:, None] * w + pos % w, ctx.scratch_slot * w)  # (b, k)
        ctx.kv.view(-1, *ctx.kv.shape[2:]).index_copy_(0, ring.reshape(-1), kv.to(ctx.kv.dtype))
        return packed

    @torch.inference_mode()
    def _capture(self, b: int, budget: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        n = self.spec.nodes_for(budget)
        try:
            self.graphs.attention.select((b, n))  # the verify bucket's plans (its graph's)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warmup: lazy kernels, cuBLAS handles, allocator
                self._body(b, budget)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, self.pool):
                packed = self._body(b, budget)
            self.pool = graph.pool()
            torch.cuda.synchronize()
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

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], budget: int) -> torch.Tensor | None:
        """Reserve, stage and run one round for `seqs` (greedy, DFlash-drafted); returns the
        (B, 2 + 2K) packed result on the device (a view of the graph's output, valid until the
        next replay), or None when no bucket holds this round (nothing was reserved then)."""
        b = self.bucket_for(seqs, budget)
        if b is None:
            return None
        n = self.spec.nodes_for(budget)
        # projects the rows observed since the last round (a prefill, plain steps) first
        meta = self.meta.stage([s.request_id for s in seqs], [s.last_token_id for s in seqs])
        starts = [s.num_tokens - 1 for s in seqs]  # the roots' positions = the cached tokens
        for seq, end, start in zip(seqs, meta[2][: len(seqs)], starts, strict=True):
            if end != start or seq.num_cached_tokens != start:
                raise RuntimeError(
                    f"dflash context of {seq.request_id}: rows end at position "
                    f"{end}, the cache holds {seq.num_cached_tokens} tokens"
                )
        for seq in seqs:  # after the checks: a failed round leaves nothing reserved
            self.bm.reserve(seq, n - 1)
        slots = self.bm.span_slots(seqs, starts, n)  # (B, n) int64 host
        stage = self.graphs.stages.get((b, n)) or self.graphs.prepare_stage(b, n)
        stage.write_round([s.block_table for s in seqs], starts, slots.numpy())
        if self.captured:
            graph, packed = self.rounds[(b, budget)]
            graph.replay()
        else:
            self.graphs.attention.select((b, n))
            try:
                packed = self._body(b, budget, self.context.eager_rows(meta[2][: len(seqs)]))
            finally:
                self.graphs.attention.select(None)
        self.replays += 1
        return packed[: len(seqs)]

    @property
    def info(self) -> dict:
        return {
            "buckets": sorted([list(k) for k in self.rounds]),
            "captured": self.captured,
            "capture_seconds": round(self.capture_seconds, 3),
            "replays": self.replays,
        }
