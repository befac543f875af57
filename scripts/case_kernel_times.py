"""Each kernel of one grid case's captured plan.run, timed by the profiler, per flag setting:
which kernel an environment flag moved (the forward or the split merge).

    PYTHONPATH=src python scripts/case_kernel_times.py --case kimi-k2-mla-tp8/B1/L8192/N16 \
        --set TREEVERIFY_CUDA_MERGE_SPLIT_LANES=0 --set TREEVERIFY_CUDA_MERGE_SPLIT_LANES=1

Every --set (comma-separated assignments) builds a fresh plan under those variables (a
Launcher reads its flags when made) on the same inputs; the settings alternate for --passes.
"""

from __future__ import annotations

import argparse
import json

import torch

from treeverify import env
from treeverify.bench.cases import load_grid, make_inputs
from treeverify.bench.kernel import back_to_back_replay_seconds, capture_plan, replay_kernel_times


def profile(case, inp: dict, assignments: dict[str, str], replays: int) -> dict:
    """One plan made and captured under `assignments` (the grid's own capture_plan, one launch
    a replay), replayed: replay time and kernels."""
    with env.set_while(assignments):
        _plan, graph, _out = capture_plan(case, inp, 16, reps=1)  # _out lives with the graph
    kernels = replay_kernel_times(graph, replays)
    return {
        "set": assignments,
        "replay_us": back_to_back_replay_seconds(graph, replays, passes=1) * 1e6,
        "kernels_us": {k["kernel"][:80]: k["us_per_replay"] for k in kernels},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", required=True, action="append", help="a grid case name (repeat)")
    ap.add_argument("--set", required=True, action="append", help="NAME=VALUE[,NAME=VALUE]")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    grid = {c.name: c for c in load_grid()[0]}
    settings = [dict(a.split("=", 1) for a in s.split(",")) for s in args.set]
    rows = []
    for name in args.case:
        if name not in grid:
            raise SystemExit(f"--case: {name!r} is not a grid case")
        case = grid[name]
        inp = make_inputs(case, page_size=16, device="cuda", seed=0)
        for p in range(args.passes):
            for s in settings:
                r = {"case": name, "pass": p, **profile(case, inp, s, args.replays)}
                rows.append(r)
                kernels = r["kernels_us"].items()
                ks = ", ".join(f"{k.split('(')[0][:40]} {v:.1f}" for k, v in kernels)
                print(f"{name} {s} pass {p}: replay {r['replay_us']:6.1f} us | {ks}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
