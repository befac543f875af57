"""DDTree tree build on the GPU, by backend: the one-launch heap kernel vs the batched beam search
(Triton sibling chain), each captured in a CUDA graph with the mask compile, replay time per
build. The draft tables come from random logits (L=15, V=8192, as tiny-code-dflash's).
Usage (GPU machine, repo root): PYTHONPATH=src python3 scripts/bench_tree_build.py --json F"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from treeverify.spec import build_tree_from_topk, draft_topk, parents_to_tree_mask


def replay_ms(fn, iters: int = 50) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for bsz in (1, 8, 32):
        for budget in (16, 64, 256, 1024):
            logits = torch.randn(bsz, 15, 8192, device=dev) * 3
            roots = torch.zeros(bsz, dtype=torch.long, device=dev)
            lp, ids = draft_topk(logits, budget)
            row = {"batch": bsz, "budget": budget, "depth": 15}
            for backend in ("heap", "triton"):

                def build(backend=backend, lp=lp, ids=ids, budget=budget, roots=roots):
                    t = build_tree_from_topk(lp, ids, budget, roots, backend=backend)
                    parents_to_tree_mask(t.parents, max_depth=15)

                row[f"{backend}_ms"] = round(replay_ms(build), 4)
            row["speedup"] = round(row["triton_ms"] / row["heap_ms"], 2)
            print(row, flush=True)
            rows.append(row)
    args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
