"""The DFlash drafter's per-round forward captured once per (depth, batch bucket).

Eagerly a draft is ~100 small kernel launches per round, more host time than GPU time. Here it
is one graph replay that reads the context store in place (engine/draft_context.py: one ring of
keys/values per request, slot s at kv[s]) and one small input:

    meta  (4, max_bucket) int64   per request: rows the draft reads (the newest), its root token,
                                  its end (the block's first position), its ring's slot;
                                  padding requests: 0 rows, the mask token, end 0, scratch ring

A round stages `meta` once (`DraftMeta`: a reused pinned host buffer, non_blocking), replays,
and returns the (B, L, V) logits, a view of the graph's output, valid until the next replay.
Nothing syncs with the host, allocates on the GPU or copies a context. A batch larger than every
bucket or a depth not captured returns None: the caller drafts eagerly (same results up to
float rounding of the different padded shapes).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from treeverify.engine.cuda_graphs import GraphCaptureError, capturing
from treeverify.engine.draft_context import DraftContextCache

log = logging.getLogger("treeverify.engine")


class DraftMeta:
    """The (4, max_bucket) int64 draft meta on the device (what a captured draft reads: rows,
    roots, ends, ring slots; `DraftContextCache.draft_meta`), staged in one non-blocking copy
    from a reused pinned host buffer. Reusing that buffer while its last copy is still queued
    would race; that never happens in the engine (each round reads its result back first), and
    if it did a fresh pinned block is used instead (kept by the caching host allocator until its
    copy has run): no wait either way. On the CPU (the eager whole rounds) a plain copy."""

    def __init__(self, context: DraftContextCache, max_bucket: int, device: torch.device):
        self.context = context
        pad = context.draft_meta([], [], max_bucket)
        self.dev = torch.tensor(pad, dtype=torch.int64, device=device)  # (4, max_bucket)
        self._pin = torch.device(device).type == "cuda"
        self.host = torch.zeros(4, max_bucket, dtype=torch.int64, pin_memory=self._pin)
        self._np = self.host.numpy()  # writes without a torch op per value
        self._staged = torch.cuda.Event() if self._pin else None  # the last copy enqueued

    def stage(self, request_ids: list[str], last_tokens: Sequence[int]) -> list[list[int]]:
        """Stage these requests' meta (padding past them); returns it as written."""
        meta = self.context.draft_meta(request_ids, last_tokens, self.dev.shape[1])
        host, h = self.host, self._np
        if self._staged is not None and not self._staged.query():
            host = torch.empty(self.host.shape, dtype=torch.int64, pin_memory=True)
            h = host.numpy()
        h[:] = meta
        self.dev.copy_(host, non_blocking=self._pin)
        if self._staged is not None:
            self._staged.record()
        return meta


class DraftGraphs:
    def __init__(
        self,
        context: DraftContextCache,  # fixed (`fix`): its store's address is baked in
        batch_sizes: Sequence[int],  # the engine's decode batch buckets
        depths: Sequence[int],  # the draft depths the engine asks for (one per engine, usually)
        device: torch.device,
    ):
        if not batch_sizes or not depths or not context.fixed:
            raise ValueError(f"batch_sizes/depths/context: expected some buckets, some depths "
                             f"and a fixed context store, got {batch_sizes}/{depths}/"
                             f"fixed={context.fixed}")  # fmt: skip
        self.context, self.drafter = context, context.drafter
        self.width = context.width
        self.batch_sizes = sorted(set(batch_sizes))
        self.depths = sorted(set(depths))
        mb = self.batch_sizes[-1]
        self.meta = DraftMeta(context, mb, device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None  # one memory pool for all buckets (largest captured first)
        self.replays = 0
        self.report: list[dict] = []
        t_all = time.perf_counter()
        for depth in self.depths:
            for b in reversed(self.batch_sizes):
                t0 = time.perf_counter()
                self.graphs[(depth, b)] = self._capture(b, depth)
                self.report.append({"batch": b, "depth": depth,
                                    "seconds": round(time.perf_counter() - t0, 4)})  # fmt: skip
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t_all
        log.info("DFlash draft graphs: captured %d buckets (batch %s, depth %s, ring width %d, "
                 "%.1f MiB of rings) in %.2f s", len(self.graphs), self.batch_sizes, self.depths,
                 self.width, context.kv.nbytes / 2**20, self.capture_seconds)  # fmt: skip

    @torch.inference_mode()
    def _capture(self, b: int, depth: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        meta = self.meta.dev[:, :b]  # (4, b)

        def draft() -> torch.Tensor:  # (b, L, V)
            return self.context.draft(meta, depth)

        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warmup: lazy kernels, cuBLAS handles, allocator
                draft()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, self.pool):
                out = draft()
            self.pool = graph.pool()
        except Exception as exc:
            raise GraphCaptureError(f"CUDA graph capture failed for the DFlash draft bucket "
                                    f"batch={b} depth={depth}: {type(exc).__name__}: {exc}"
                                    ) from exc  # fmt: skip
        return graph, out

    def bucket_for(self, batch: int) -> int | None:
        return next((b for b in self.batch_sizes if b >= batch), None)

    def propose(self, request_ids: list[str], last_tokens: Sequence[int],
                depth: int) -> torch.Tensor | None:  # fmt: skip
        """(B, L, V) draft logits (the drafter's `logits_dtype()`), a view of the graph's
        output; None: not captured for this batch or depth."""
        b = len(request_ids)
        bucket = self.bucket_for(b)
        if bucket is None or (depth, bucket) not in self.graphs:
            return None
        graph, out = self.graphs[(depth, bucket)]
        self.meta.stage(request_ids, last_tokens)
        graph.replay()
        self.replays += 1
        return out[:b]

    @property
    def info(self) -> dict:
        return {
            "buckets": self.batch_sizes,
            "depths": self.depths,
            "context_width": self.width,
            "capture_seconds": round(self.capture_seconds, 3),
            "replays": self.replays,
        }
