"""Captured forwards: one CUDA graph per bucket (B requests padded, n tokens each).

A decode step is the bucket (B, 1); a speculative verify step over trees of n nodes is (B, n).
Each graph replays the whole model forward over fixed input buffers (token ids, positions, the
valid-row mask) and the bucket's own `TreeAttentionPlan`s, whose metadata `PagedAttention.plan()`
rewrites in place before every replay. Padding requests are empty trees to the kernels, their K/V
rows go to the cache's scratch slot, and they are left out of the MoE counters.

Capture happens once at startup, largest bucket first, into one shared memory pool; a failure
raises `GraphCaptureError` naming the bucket (the server refuses to start; there is no silent
fallback to eager). Nothing inside a replay syncs with the host or allocates.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from treeverify.engine.paged_attention import PagedAttention
from treeverify.progress import progress

log = logging.getLogger("treeverify.engine")


class GraphCaptureError(RuntimeError):
    """A bucket's forward could not be captured; the message names the bucket."""


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
        self.steps: dict[tuple[int, int], CapturedStep] = {}
        self.pool = None
        self.replays = 0

    # ---- capture -------------------------------------------------------------------------------
    def forward_rows(self, rows: int) -> torch.Tensor:
        return self.model(self.ids[:rows], self.pos[:rows], attention=self.attention,
                          token_valid=self.valid[:rows])  # fmt: skip

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
            with torch.cuda.stream(side):  # warmup: plans, kernels, cuBLAS handles made here
                self.forward_rows(rows)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self.forward_rows(rows)  # (rows, V)
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

    # ---- replay --------------------------------------------------------------------------------
    def bucket_for(self, num_requests: int, n: int) -> tuple[int, int] | None:
        """The smallest captured bucket that holds `num_requests` requests of n tokens."""
        for b, m in self.buckets:  # sorted by (n, B)
            if m == n and b >= num_requests:
                return (b, n)
        return None

    def replay(
        self,
        bucket: tuple[int, int],
        ids: torch.Tensor,  # (T,) int64, host or device
        pos: torch.Tensor,  # (T,) int64
    ) -> torch.Tensor:  # (T, V) fp32, a view of the graph's output
        """Inputs into the fixed buffers, replay; the attention plans must already be planned
        (`attention.select(bucket)` + `attention.plan(...)`)."""
        step = self.steps[bucket]
        t = ids.shape[0]
        rows = bucket[0] * bucket[1]
        if t > rows:
            raise ValueError(f"ids: {t} tokens exceed bucket {bucket} ({rows} rows)")
        self.ids[:t].copy_(ids, non_blocking=True)
        self.ids[t:rows].zero_()
        self.pos[:t].copy_(pos, non_blocking=True)
        self.pos[t:rows].zero_()
        self.valid[:t].fill_(True)
        self.valid[t:rows].fill_(False)
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
