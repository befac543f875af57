"""Kernel times of DDTree's draft-table top-k and heap build (kernels/cuda/ddtree_topk.cu,
ddtree_heap.cu) on their own, by torch.profiler over captured replays, across the sizes that
should move them (k, vocabulary, budget): whether their ~11 us each in a round is their
algorithm or a floor. The top-k on bf16 logits read as they are and on their fp32 upcast (the
copy kernel the engine made before the fifty-first session, timed with it), and at real models'
vocabularies (128256: Llama 3; 151936: Qwen3), where its k rounds rescanned the row. Usage:
PYTHONPATH=src python scripts/tree_kernels_gpu.py [--json P]"""

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
    """Mean kernel time (us) per replay of `fn` captured in a graph, by kernel (every kernel
    the replay runs: an upcast's copy too)."""
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
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.key[:40]] = round(e.device_time_total / replays, 2)
    return out


def topk_of(x: torch.Tensor, k: int, upcast: bool):
    """The draft table of x, from its fp32 copy first when `upcast` (the copy timed with it)."""
    return draft_topk_cuda(x.float() if upcast else x, k, LOGPROB_FLOOR)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    # every k a budget takes (4, 8, 16, 32; 1, 12, 13: where rows held in registers crossed
    # over to the threshold until the fifty-second session)
    for bsz, depth, vocab, k in [(1, 15, 8192, 16), (1, 15, 8192, 1), (1, 15, 8192, 4),
                                 (1, 15, 8192, 8), (1, 15, 8192, 12), (1, 15, 8192, 13),
                                 (1, 15, 8192, 32), (1, 15, 512, 16),
                                 (1, 1, 8192, 16), (8, 15, 8192, 16), (1, 15, 128256, 16),
                                 (8, 15, 128256, 16), (1, 15, 151936, 16)]:  # fmt: skip
        b16 = (torch.randn(bsz, depth, vocab, device=dev, generator=g) * 4).bfloat16()
        forms = {"fp32": b16.float(), "bf16": b16}
        for form in ("fp32", "bf16", "bf16 upcast"):
            x = forms.get(form, b16)
            upcast = form == "bf16 upcast"
            t = kernel_us(functools.partial(topk_of, x, k, upcast))
            rows.append({"kernel": "topk", "input": form, "batch": bsz, "depth": depth,
                         "vocab": vocab, "k": k, "total_us": round(sum(t.values()), 2),
                         **t})  # fmt: skip
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
