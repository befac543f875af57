"""The DFlash drafter's per-round forward (`propose_from_kv`) captured once per batch bucket.

Eagerly a draft is ~100 small kernel launches per round, more host time than GPU time. Here it
is one graph replay over fixed input buffers shared by every bucket:

    kv    (max_bucket, W, n_layers, 2, Hkv, D)  drafter dtype: request i's context keys/values
                                                in rows kv[i, :len_i]; zeroed ONCE, so the rows
                                                past a length (stale or never written) are finite,
                                                and the lengths mask them out of attention
    meta  (3, max_bucket) int64                 context lengths, last tokens, block start
                                                positions; padding requests: length 0, the mask
                                                token, position 0

W is fixed (the context window capped at the target's max context); a bucket's graph reads the
first b rows. A round copies each request's held rows into its row (B device copies), the meta
once from a reused pinned host buffer (non_blocking), replays, and returns the (B, L, V) logits,
a view of the graph's output, valid until the next replay. Nothing syncs with the host or
allocates on the GPU. A batch larger than every bucket, a depth not captured or a context longer
than W returns None: the caller drafts eagerly (same results up to float rounding of the
different padded shapes).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from treeverify.engine.cuda_graphs import GraphCaptureError
from treeverify.spec.dflash import DFlashDrafter

log = logging.getLogger("treeverify.engine")


class DraftGraphs:
    def __init__(
        self,
        drafter: DFlashDrafter,
        batch_sizes: Sequence[int],  # the engine's decode batch buckets
        depths: Sequence[int],  # the draft depths the engine asks for (one per engine, usually)
        width: int,  # W: context rows per request, at most
        device: torch.device,
    ):
        if not batch_sizes or not depths or width < 1:
            raise ValueError(f"batch_sizes/depths/width: expected some buckets, some depths and "
                             f"width >= 1, got {batch_sizes}/{depths}/{width}")  # fmt: skip
        cfg = drafter.config
        self.drafter, self.width = drafter, width
        self.batch_sizes = sorted(set(batch_sizes))
        self.depths = sorted(set(depths))
        self.pad_token = drafter.mask_token_id  # a valid id for padding requests
        mb = self.batch_sizes[-1]
        shape = (mb, width, cfg.num_hidden_layers, 2, cfg.num_key_value_heads, cfg.head_dim)
        self.kv = torch.zeros(shape, dtype=drafter.fc.weight.dtype, device=device)
        self.meta = torch.zeros(3, mb, dtype=torch.int64, device=device)  # (3, max_bucket)
        self.meta[1].fill_(self.pad_token)
        self.meta_host = torch.zeros(3, mb, dtype=torch.int64, pin_memory=True)
        self._meta_np = self.meta_host.numpy()  # writes without a torch op per value
        self._staged = torch.cuda.Event()  # the last meta copy enqueued
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
        log.info("DFlash draft graphs: captured %d buckets (batch %s, depth %s, context width %d, "
                 "%.1f MiB of inputs) in %.2f s", len(self.graphs), self.batch_sizes, self.depths,
                 width, self.kv.nbytes / 2**20, self.capture_seconds)  # fmt: skip

    @torch.inference_mode()
    def _capture(self, b: int, depth: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        kv, meta = self.kv[:b], self.meta[:, :b]  # (b, W, nl, 2, Hkv, D), (3, b)

        def draft() -> torch.Tensor:  # (b, L, V)
            return self.drafter.propose_from_kv(kv, meta[0], meta[1], meta[2], depth)

        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warmup: lazy kernels, cuBLAS handles, allocator
                draft()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = draft()
            self.pool = graph.pool()
        except Exception as exc:
            raise GraphCaptureError(f"CUDA graph capture failed for the DFlash draft bucket "
                                    f"batch={b} depth={depth}: {type(exc).__name__}: {exc}"
                                    ) from exc  # fmt: skip
        return graph, out

    def bucket_for(self, batch: int) -> int | None:
        return next((b for b in self.batch_sizes if b >= batch), None)

    def propose(
        self,
        kvs: Sequence[torch.Tensor],  # per request (C_i, nl, 2, Hkv, D) on the device
        last_tokens: Sequence[int],  # per request: block position 0
        block_starts: Sequence[int],  # per request: the block's first position
        depth: int,
    ) -> torch.Tensor | None:  # (B, L, V) fp32, a view of the graph's output; None: not captured
        b = len(kvs)
        bucket = self.bucket_for(b)
        if bucket is None or (depth, bucket) not in self.graphs:
            return None
        if any(kv.shape[0] > self.width for kv in kvs):
            return None
        graph, out = self.graphs[(depth, bucket)]
        for i, kv in enumerate(kvs):  # rows past C_i keep whatever finite values they held
            self.kv[i, : kv.shape[0]].copy_(kv)
        self._stage_meta([kv.shape[0] for kv in kvs], last_tokens, block_starts)
        graph.replay()
        self.replays += 1
        return out[:b]

    def _stage_meta(self, lens: list[int], tokens: Sequence[int], starts: Sequence[int]) -> None:
        """All of `meta` in one non-blocking copy from the pinned buffer. Reusing that buffer
        while its last copy is still queued would race; that never happens in the engine (each
        round reads its result back first), and if it did a fresh pinned block is used instead
        (kept by the caching host allocator until its copy has run): no wait either way."""
        host, h = self.meta_host, self._meta_np
        if not self._staged.query():
            host = torch.empty(self.meta_host.shape, dtype=torch.int64, pin_memory=True)
            h = host.numpy()
        b = len(lens)
        h[0], h[1], h[2] = 0, self.pad_token, 0
        h[0, :b], h[1, :b], h[2, :b] = lens, tokens, starts
        self.meta.copy_(host, non_blocking=True)
        self._staged.record()

    @property
    def info(self) -> dict:
        return {
            "buckets": self.batch_sizes,
            "depths": self.depths,
            "context_width": self.width,
            "capture_seconds": round(self.capture_seconds, 3),
            "replays": self.replays,
        }
