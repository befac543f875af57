"""Host time of TreeAttentionPlan.plan() on the CPU: the capacity checks and the numpy staging of
plan_metadata.py, without the CUDA calls (backend="torch", device="cpu"), for the three cases of
scripts/host_step_profile.py (the GPU-side view). For iterating on plan()'s Python without a GPU;
compare two trees by running it with PYTHONPATH on each, interleaved, on an idle host.

    PYTHONPATH=src python scripts/plan_host_time.py [--json out.json] [--label new]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

import torch

from treeverify.bench.cases import Case, load_grid
from treeverify.kernels.plan import TreeAttentionPlan

CASES = (  # as scripts/host_step_profile.py
    "llama8b-gqa/B1/L1024/N16",
    "llama8b-gqa/B32/L32768/N64",
    "kimi-k2-mla-tp8/B8/L8192/N16",
)


def plan_us(case: Case, iters: int) -> float:
    b, n, page = case.B, case.N, 16
    pages = -(-(case.L + n) // page)
    plan = TreeAttentionPlan(
        num_qo_heads=case.hq, num_kv_heads=case.hkv, head_dim_qk=case.dqk, head_dim_v=case.dv,
        mla=case.mla, page_size=page, max_batch=b, max_tree=n, max_pages_per_request=pages,
        sm_scale=0.1, device="cpu", backend="torch",
    )  # fmt: skip
    meta = (
        torch.randint(0, 1 << 20, (b, pages), dtype=torch.int32),  # (B, pages)
        torch.full((b,), case.L, dtype=torch.int32),  # (B,)
        torch.arange(b + 1, dtype=torch.int32) * n,  # (B+1,)
        torch.randint(0, 1 << 30, (b * n, -(-n // 32)), dtype=torch.int32),  # (B*N, W)
    )
    for _ in range(iters // 10):
        plan.plan(*meta)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        plan.plan(*meta)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--label", default="")
    ap.add_argument("--iters", type=int, default=2000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    grid = {c.name: c for c in load_grid()[0]}
    rows = {name: round(plan_us(grid[name], args.iters), 2) for name in CASES}
    for name, us in rows.items():
        print(f"{name:32s} plan {us:6.1f} us")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()  # fmt: skip
        out = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "label": args.label,
               "commit": commit, "iters": args.iters, "plan_us": rows}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
