"""Host cost of the DFlash context's feed, copies against the feed ring (engine/feed_ring.py), on
this machine's CPU with the seeded tiny drafter: a plain step's hand-over at 1 and 8 requests
(a clone, a split and an `observe` per request, against one ring write and one `observe_ring`),
and a flush of rows pending over 8 requests (a `torch.cat` of one view per row, against one
gather). The projection is stubbed out (it is the same either way), so what is left is the
feed's own work; on a GPU the gather's copy is a kernel, here it is CPU work.

    PYTHONPATH=src python3 scripts/feed_ring_host.py [--steps 2000] [--json F]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from raw_json import write_rows  # noqa: E402

from treeverify.engine.draft_context import DraftContextCache  # noqa: E402
from treeverify.models.tiny import build_tiny  # noqa: E402
from treeverify.spec.dflash_io import tiny_dflash  # noqa: E402


class _Stub:
    """The captured projection's place: one bucket, returns rows of a fixed output."""

    def __init__(self, rows: int, row_shape: tuple[int, ...]):
        self.batch_sizes = [rows]
        self.out = torch.zeros(rows, *row_shape)

    def __call__(self, feats, pos):
        return (self.out[: feats.shape[0]],)


def _cache(drafter, ring: bool, batch: int, bucket: int) -> DraftContextCache:
    cache = DraftContextCache(drafter, 4096)
    cache._captured = _Stub(bucket, cache._row_shape())
    if ring:
        cache.enable_ring(batch)
    return cache


def _step(cache, ring: bool, rids: list[str], pos: int, hidden: torch.Tensor) -> None:
    """One plain step's rows handed to the context, as the engine hands them."""
    if ring:
        first = cache.ring_write(hidden)
        cache.observe_ring([(r, pos, first + i) for i, r in enumerate(rids)])
    else:
        kept = hidden.clone()
        for r, row in zip(rids, [kept] if len(rids) == 1 else kept.split(1), strict=True):
            cache.observe(r, pos, row)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg, model, _ = build_tiny("tiny-llama", seed=0)
    drafter = tiny_dflash(cfg, seed=1, target_embed=model.model.embed_tokens,
                          target_lm_head=model.lm_head).eval()  # fmt: skip
    feats, rows = drafter.config.context_features, []
    with torch.inference_mode():
        for batch in (1, 8):  # a step's hand-over (flushes at 256 rows included in the mean)
            for ring in (False, True):
                rids = [f"r{i}" for i in range(batch)]
                cache = _cache(drafter, ring, batch, 256)
                for r in rids:
                    cache.observe(r, 0, torch.randn(5, feats))
                hidden, times = torch.randn(batch, feats), []
                for s in range(args.steps):
                    t0 = time.perf_counter()
                    _step(cache, ring, rids, 5 + s, hidden)
                    times.append(time.perf_counter() - t0)
                times.sort()
                rows.append({"what": "step", "requests": batch, "ring": ring,
                             "median_us": round(times[len(times) // 2] * 1e6, 1),
                             "mean_us": round(sum(times) / len(times) * 1e6, 1)})  # fmt: skip
        for steps in (32, 96, 225):  # a flush of 8 requests' pending rows (median of 5)
            for ring in (False, True):
                rids, times = [f"r{i}" for i in range(8)], []
                for _ in range(5):
                    cache = _cache(drafter, ring, 8, 4096)
                    for r in rids:
                        cache.observe(r, 0, torch.randn(5, feats))
                    cache.project(rids)
                    hidden = torch.randn(8, feats)
                    for s in range(steps):
                        _step(cache, ring, rids, 5 + s, hidden)
                    t0 = time.perf_counter()
                    cache.project(rids)
                    times.append(time.perf_counter() - t0)
                rows.append({"what": "flush", "pending_rows": 8 * steps, "ring": ring,
                             "median_us": round(sorted(times)[2] * 1e6, 1)})  # fmt: skip
    for r in rows:
        print(r)
    if args.json:
        write_rows(args.json, "feed_ring_host.py", None, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
