"""Captured forwards: one CUDA graph per bucket (B requests padded, n tokens each).

A decode step is the bucket (B, 1); a speculative verify step over trees of n nodes is (B, n);
one request's prefill chunk of up to n tokens is (1, n), a chain padded to n rows whose logits
are its last valid row's.
Each graph replays the whole model forward over fixed input buffers (token ids, positions, the
valid-row mask, KV slots) and the bucket's own `TreeAttentionPlan`s. A step's inputs are staged
in the bucket's `StepStage` (engine/step_stage.py: one pinned buffer, one copy) and the graph's
first nodes unpack them into those buffers, so a replayed step costs the host a few numpy writes,
one copy and one launch. Padding requests are empty trees to the kernels, their K/V rows go to the
cache's scratch slot, and they are left out of the MoE counters.

Capture happens once at startup, largest bucket first, into one shared memory pool; a failure
raises `GraphCaptureError` naming the bucket (the server refuses to start; there is no silent
fallback to eager). Nothing inside a replay syncs with the host or allocates.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import dataclass

import torch

from treeverify.engine.paged_attention import PagedAttention
from treeverify.engine.stage_unpack import kernel_unpacks, unpack_stage
from treeverify.engine.step_stage import StepStage
from treeverify.progress import progress

log = logging.getLogger("treeverify.engine")


class GraphCaptureError(RuntimeError):
    """A bucket's forward could not be captured; the message names the bucket."""


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool=None):
    """`torch.cuda.graph(graph, pool=pool)` with Python's garbage collector held off: a
    collection during capture that frees an earlier engine's pinned buffers or events makes CUDA
    calls a capture forbids, and the capture fails ("operation failed due to a previous error
    during capture"; seen on the H200 when a test built engines back to back). The garbage waits
    for the next collection after the capture (no collection forced here: startup captures ~100
    graphs)."""
    was = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    finally:
        if was:
            gc.enable()


def batch_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_bs (max_bs itself always included)."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs: expected >= 1, got {max_bs}")
    out = [b for b in (1, 2, 4) if b < max_bs]
    out += list(range(8, max_bs, 8))
    return sorted({*out, max_bs})


@dataclass
class CapturedStep:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # (B*n, V) fp32, written by every replay
    hidden: torch.Tensor | None  # (B*n, F) the model's captured layer outputs (a drafter's)
    seconds: float  # capture time (warmup included)


class CudaGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        attention: PagedAttention,
        buckets: list[tuple[int, int]],  # (B, n): n = 1 plain decode, budget+1 a DDTree round
        max_pages: int | None = None,  # pages a request can hold (default: the whole pool)
        prefill: tuple[int, ...] = (),  # n of buckets (1, n) that run one request's prefill
    ):
        if not buckets:
            raise ValueError("buckets: expected at least one (batch, tokens) bucket")
        self.model, self.attention = model, attention
        self.buckets = sorted(set(buckets), key=lambda bn: (bn[1], bn[0]))
        dev = attention.cache.device
        rows = max(b * n for b, n in self.buckets)
        self.ids = torch.zeros(rows, dtype=torch.int64, device=dev)  # (rows,)
        self.pos = torch.zeros(rows, dtype=torch.int64, device=dev)  # (rows,)
        self.valid = torch.zeros(rows, dtype=torch.bool, device=dev)  # (rows,)
        self.max_pages = min(max_pages or attention.max_pages, attention.max_pages)
        self.prefill = {(1, n) for n in prefill}  # their logits: the last valid row only
        self.steps: dict[tuple[int, int], CapturedStep] = {}
        self.stages: dict[tuple[int, int], StepStage] = {}
        self.pool = None
        self.replays = 0

    # ---- capture -------------------------------------------------------------------------------
    def forward_rows(self, rows: int, last_row: bool = False) -> torch.Tensor:
        """The model over the first `rows` input rows: (rows, V) logits, or with `last_row` (a
        prefill bucket: the valid rows are a prefix) the last valid row's (1, V)."""
        last = None
        if last_row:  # computed in the graph from the staged valid rows
            last = self.valid[:rows].sum(dtype=torch.int64).sub(1).clamp(min=0).view(1)  # (1,)
        return self.model(self.ids[:rows], self.pos[:rows], attention=self.attention,
                          logits_indices=last, token_valid=self.valid[:rows])  # fmt: skip

    def capture(self) -> list[dict]:
        """Capture every bucket, largest first (the pool then fits the smaller ones). The
        caller sets the model's sync-free MoE routing for the duration (ModelRunner does)."""
        report = []
        try:
            order = sorted(self.buckets, key=lambda bn: -bn[0] * bn[1])
            for b, n in progress(order, "capturing CUDA graphs", unit="bucket"):
                step = self._capture_one(b, n)
                report.append({"batch": b, "tokens_per_request": n,
                               "seconds": round(step.seconds, 4)})  # fmt: skip
        finally:
            self.attention.select(None)
        total = sum(r["seconds"] for r in report)
        log.info("CUDA graphs: captured %d buckets %s in %.2f s", len(report), self.buckets,
                 total)  # fmt: skip
        return report

    @torch.inference_mode()
    def prepare_stage(self, batch: int, n: int) -> StepStage:
        """A bucket's plans (made by one forward over the scratch page) and stage, nothing
        captured: the CPU's eager whole rounds (engine/round_graphs.py) run the captured body
        over them."""
        rows = batch * n
        try:
            self.attention.select((batch, n))
            self.attention.plan_scratch(batch, n)
            self.valid[:rows].fill_(False)
            self.forward_rows(rows, (batch, n) in self.prefill)
            return self._stage(batch, n)
        finally:
            self.attention.select(None)

    @torch.inference_mode()
    def _capture_one(self, batch: int, n: int) -> CapturedStep:
        t0 = time.perf_counter()
        rows = batch * n
        try:
            self.attention.select((batch, n))
            self.attention.plan_scratch(batch, n)
            self.ids[:rows].zero_()
            self.pos[:rows].zero_()
            self.valid[:rows].fill_(False)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            last_row = (batch, n) in self.prefill
            with torch.cuda.stream(side):  # warmup: plans, kernels, cuBLAS handles made here
                self.forward_rows(rows, last_row)
            torch.cuda.current_stream().wait_stream(side)
            stage = self._stage(batch, n)  # holds the scratch plan just made
            if kernel_unpacks():  # the same values again: the unpack kernel compiled here,
                self._unpack(stage, batch, n)  # outside stream capture
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, self.pool):
                self._unpack(stage, batch, n)
                logits = self.forward_rows(rows, last_row)  # (rows, V), or (1, V)
            self.pool = graph.pool()
            torch.cuda.synchronize()
        except Exception as exc:
            raise GraphCaptureError(
                f"CUDA graph capture failed for bucket batch={batch} tokens_per_request={n}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        hidden = getattr(self.model, "captured", None)
        step = CapturedStep(graph, logits, hidden, time.perf_counter() - t0)
        self.steps[(batch, n)] = step
        log.info("CUDA graph: bucket batch=%d tokens=%d captured in %.3f s", batch, n,
                 step.seconds)  # fmt: skip
        return step

    def _targets(self, batch: int, n: int) -> list[tuple[str, torch.Tensor]]:
        """(stage field, the fixed buffer it fills) for one bucket: the graphs' inputs, the KV
        slots and every attention plan's metadata (the table transposed, as staged)."""
        rows = batch * n
        out = [("ids", self.ids[:rows]), ("pos", self.pos[:rows]), ("valid", self.valid[:rows]),
               ("slots", self.attention.slots[:rows])]  # fmt: skip
        for p in self.attention.plans_for((batch, n)):
            out += [("prefix", p.prefix_lens), ("qo", p.qo_indptr),
                    ("mask", p.tree_mask[:rows]),
                    ("table", p.block_table[:, : self.max_pages].t())]  # fmt: skip
        return out

    def _stage(self, batch: int, n: int) -> StepStage:
        """The bucket's stage, its device twin loaded with the buffers' current contents."""
        plans = self.attention.plans_for((batch, n))
        words = plans[0].words if plans else 1
        stage = StepStage(batch, n, words, self.max_pages, self.attention.cache.scratch_slot,
                          self.attention.cache.device)  # fmt: skip
        for field, buf in self._targets(batch, n):
            stage.views[field].copy_(buf)
        self.stages[(batch, n)] = stage
        return stage

    def _unpack(self, stage: StepStage, batch: int, n: int) -> None:
        """Captured at the start of the bucket's graph: the staged inputs into their buffers,
        by one kernel (engine/stage_unpack.py, TREEVERIFY_STAGE_UNPACK, on a GPU) or a copy
        per buffer."""
        targets = self._targets(batch, n)
        if stage.dev.is_cuda and kernel_unpacks():
            common = dict(targets[:4])  # ids, pos, valid, slots; the plans' fields follow
            unpack_stage(stage.views, common, self.attention.plans_for((batch, n)),
                         self.max_pages)  # fmt: skip
            return
        for field, buf in targets:
            buf.copy_(stage.views[field])

    # ---- replay --------------------------------------------------------------------------------
    def bucket_for(
        self, num_requests: int, n: int, block_tables: list[list[int]] | None = None
    ) -> tuple[int, int] | None:
        """The smallest captured bucket that holds `num_requests` requests of n tokens (and,
        given, their page tables: at most `max_pages` pages each, what a stage holds; a context
        past the model's runs eagerly)."""
        if block_tables is not None and max(map(len, block_tables)) > self.max_pages:
            return None
        for b, m in self.buckets:  # sorted by (n, B)
            if m == n and b >= num_requests:
                return (b, n)
        return None

    def replay(self, bucket: tuple[int, int], batch: int) -> torch.Tensor:
        """Replay a bucket whose stage holds this step's inputs (`stages[bucket].write_*`) for
        `batch` requests; returns their (batch * n, V) fp32 logits (a prefill bucket's: its
        last valid row's (1, V)), a view of the graph's output."""
        step = self.steps[bucket]
        t = batch * bucket[1]
        step.graph.replay()
        if step.hidden is not None:
            self.model.captured = step.hidden[:t]
        self.replays += 1
        return step.logits[:t]

    @property
    def info(self) -> dict:
        return {
            "enabled": True,
            "buckets": [list(bn) for bn in self.buckets],
            "capture_seconds": round(sum(s.seconds for s in self.steps.values()), 3),
            "replays": self.replays,
        }
