"""Kernel times of DDTree's draft-table top-k and heap build (kernels/cuda/ddtree_topk.cu,
ddtree_heap.cu) on their own, by torch.profiler over captured replays, across the sizes that
should move them (k, vocabulary, budget): whether their ~11 us each in a round is their
algorithm or a floor. Usage: PYTHONPATH=src python scripts/tree_kernels_gpu.py [--json P]"""

from __future__ import annotations

import argparse
import functools
import json
from datetime import datetime, timezone

import torch

from treeverify.spec.topk_cuda import draft_topk_cuda
from treeverify.spec.tree import LOGPROB_FLOOR
from treeverify.spec.tree_heap import build_tree_heap


def kernel_us(fn, replays: int = 50) -> dict[str, float]:
    """Median-free mean kernel time (us) per replay of `fn` captured in a graph, by kernel."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and "ddtree" in e.key:
            out[e.key[:40]] = round(e.device_time_total / replays, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for bsz, depth, vocab, k in [(1, 15, 8192, 16), (1, 15, 8192, 1), (1, 15, 512, 16),
                                 (1, 1, 8192, 16), (8, 15, 8192, 16)]:  # fmt: skip
        logits = torch.randn(bsz, depth, vocab, device=dev, generator=g) * 4
        t = kernel_us(functools.partial(draft_topk_cuda, logits, k, LOGPROB_FLOOR))
        rows.append({"kernel": "topk", "batch": bsz, "depth": depth, "vocab": vocab, "k": k, **t})
    for bsz, depth, k, budget in [(1, 15, 16, 16), (1, 15, 16, 1), (1, 15, 32, 32),
                                  (1, 15, 32, 64), (8, 15, 16, 16), (1, 15, 32, 256)]:  # fmt: skip
        lp, ids = draft_topk_cuda(torch.randn(bsz, depth, 8192, device=dev, generator=g) * 4, k,
                                  LOGPROB_FLOOR)  # fmt: skip
        roots = torch.zeros(bsz, dtype=torch.int64, device=dev)
        build = functools.partial(build_tree_heap, lp, ids, budget, roots, with_mask=True)
        t = kernel_us(build)
        rows.append({"kernel": "heap", "batch": bsz, "depth": depth, "k": k, "budget": budget,
                     **t})  # fmt: skip
    for r in rows:
        print(r)
    if args.json:
        meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "gpu": torch.cuda.get_device_name(), "rows": rows}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(meta, f, indent=1)


if __name__ == "__main__":
    main()
