"""Pending feed-ring rows projected into the DFlash context store by one replay, the gather done
inside the graph.

A DFlash engine at adaptive budget 0 keeps every plain step's tapped rows pending, as ids in the
feed ring (engine/feed_ring.py), until a flush or the next round projects them
(engine/draft_context.py). The general path pays per projection: the ids gathered by a host-built
index (`FeedRing.gather`), the positions and store rows built per request in torch on the host,
the captured projection's input and padding copies per bucket of 256 rows, and a scatter: ~0.55
ms of host in a probe's ~1.3 ms round at b=1 (cProfile, H100, thirty-ninth session), and at b=8
probe rounds of 1.9-5.7 ms against 0.5-0.85 ms for a steady round (forty-first session's
`step_kinds --warm`): the probes, not the plain steps, were most of the DFlash engine's loss on
text no drafter predicts.

Here the host writes one (3, P) int64 block — ring row, position, store row per projected row;
padding rows read ring row 0 and write the scratch ring — and uploads it with one pinned copy;
one replay per chunk of up to the largest bucket then gathers the rows from the ring, projects
them (`drafter.context_kv`) and scatters the keys/values into the store. Rows are independent,
so padding changes nothing and a chunk's size only picks the bucket. On the CPU (no graphs) the
same gather, projection and scatter run eagerly over exactly the rows given (`project_from_ring`:
no padding, since an uncaptured store grows and moves its scratch ring).

The stream orders it: the replay reads ring rows written by steps queued before it, and a later
write to those rows is queued after it; the context keeps every pending id live until then
(`DraftContextCache.ring_write`'s floor and spill).
"""

from __future__ import annotations

import numpy as np
import torch

from treeverify.engine.cuda_graphs import capturing
from treeverify.kernels.staging import copy_from_host


def buckets_up_to(rows: int, smallest: int = 16, largest: int = 1024) -> list[int]:
    """Powers of two from `smallest` to the first at or above `rows`, at most `largest`: a
    projection of more rows replays the largest bucket several times."""
    out, b = [smallest], smallest
    while b < min(rows, largest):
        b *= 2
        out.append(b)
    return out


@torch.inference_mode()
def project_from_ring(drafter, ring: torch.Tensor, store: torch.Tensor,
                      block: torch.Tensor) -> None:  # fmt: skip
    """block (3, P) int64 on the ring's device: ring rows, positions, flat store rows. The rows'
    keys/values (`drafter.context_kv`) written into the store."""
    feats = ring.index_select(0, block[0])  # (P, F)
    kv = drafter.context_kv(feats, block[1])  # (P, n_layers, 2, Hkv, D)
    store.index_copy_(0, block[2], kv.to(store.dtype))


class RingProjection:
    def __init__(self, drafter, ring: torch.Tensor, store: torch.Tensor, scratch_rows: range,
                 buckets: list[int]) -> None:  # fmt: skip
        """ring (rows, F): the feed ring's buffer; store (S * W, n_layers, 2, Hkv, D): the
        fixed context store, flat; scratch_rows: the scratch ring's flat rows (padding writes
        there). One CUDA graph per bucket, captured here."""
        self.drafter, self.ring, self.store = drafter, ring, store
        self.buckets = sorted(buckets)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.blocks: dict[int, torch.Tensor] = {}  # bucket -> (3, P) int64 on the device
        self.pads: dict[int, np.ndarray] = {}  # bucket -> (3, P) int64 host: padding rows
        scratch = np.asarray(scratch_rows, dtype=np.int64)
        for p in self.buckets:
            pad = np.zeros((3, p), dtype=np.int64)
            pad[2] = scratch[np.arange(p) % len(scratch)]  # never the same row twice if it fits
            self.pads[p] = pad
            self.blocks[p] = torch.from_numpy(pad.copy()).to(ring.device)
        self.replays = 0
        self._capture()

    def _run(self, block: torch.Tensor) -> None:
        project_from_ring(self.drafter, self.ring, self.store, block)

    def _capture(self) -> None:
        pool = None
        for p in sorted(self.buckets, reverse=True):  # the largest first: the pool fits all
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._run(self.blocks[p])  # warm-up: lazy kernels, autotuning (writes scratch)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, pool):
                self._run(self.blocks[p])
            pool = graph.pool()
            self.graphs[p] = graph
        torch.cuda.synchronize()

    def __call__(self, ring_rows: np.ndarray, positions: np.ndarray,
                 store_rows: np.ndarray) -> None:  # fmt: skip
        """Project these rows (each (R,) int64: ring buffer row, position, flat store row) into
        the store: per chunk of up to the largest bucket, one upload and one replay. No sync."""
        total, top = len(ring_rows), self.buckets[-1]
        for a in range(0, total, top):
            n = min(top, total - a)
            p = next(b for b in self.buckets if b >= n)
            host = self.pads[p].copy()  # (3, P): padding rows as captured
            host[0, :n] = ring_rows[a : a + n]
            host[1, :n] = positions[a : a + n]
            host[2, :n] = store_rows[a : a + n]
            block = self.blocks[p]
            copy_from_host(block, torch.from_numpy(host))  # pinned, queued: no sync
            self.graphs[p].replay()
            self.replays += 1
