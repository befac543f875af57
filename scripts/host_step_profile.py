"""Where the host time of one verify step goes (issue 15: plan() + replay <= 50 us a step).

For a few grid cases: a cuda plan and a one-step graph (bench kernel's `step_graph`), then the
median host time (GPU idle at the start, as `bench kernel`'s host_step_us) of
  step        plan(host metadata) + graph.replay()    (= host_step_us)
  plan        plan(host metadata) alone
  replay      graph.replay() alone
  empty       replay of a graph holding one tiny kernel (the launch floor)
and of plan()'s pieces on their own: one zero_ of a plan buffer, one copy_from_host of a small
host tensor, one pin_memory, one .to("cpu", int64). Then torch.profiler's CPU view of 50 steps
(top ops by self CPU time). Usage (GPU machine, repo root):
  PYTHONPATH=src python3 scripts/host_step_profile.py --json $OUT/host_step_profile.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from treeverify.bench.cases import load_grid, make_inputs
from treeverify.bench.kernel import _plan_for, step_graph
from treeverify.kernels.staging import copy_from_host

CASES = (
    "llama8b-gqa/B1/L1024/N16",
    "llama8b-gqa/B32/L32768/N64",
    "kimi-k2-mla-tp8/B8/L8192/N16",
)
META = ("block_table", "prefix_lens", "qo_indptr", "tree_mask")


def median_us(fn, iters: int = 200) -> float:
    """Median host microseconds of fn(), the GPU idle before each call."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def empty_graph() -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    x = torch.zeros(16, device="cuda")
    x.add_(1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(1)
    return graph, x


def profile_case(name: str, case) -> dict:
    inp = make_inputs(case, page_size=16, device="cuda", seed=1)
    plan = _plan_for(case, inp, 16)
    graph, _out = step_graph(plan, inp)
    host = [inp[k].cpu() for k in META]
    dev = [inp[k] for k in META]
    small = inp["prefix_lens"].cpu()

    def step() -> None:
        plan.plan(*host)
        graph.replay()

    row = {
        "case": name,
        "step_us": median_us(step),
        "plan_us": median_us(lambda: plan.plan(*host)),
        "plan_device_meta_us": median_us(lambda: plan.plan(*dev)),
        "replay_us": median_us(graph.replay),
        "zero_us": median_us(plan.prefix_lens.zero_),
        "copy_from_host_us": median_us(lambda: copy_from_host(plan.prefix_lens[:1], small[:1])),
        "pin_memory_us": median_us(small.pin_memory),
        "to_cpu_int64_us": median_us(lambda: small.to("cpu", torch.int64)),
        "launches": {"merge_kernel": bool(plan._launcher.merge_kernel_needed)},
    }
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(50):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    row["profile_top"] = [
        {"op": e.key, "calls": e.count, "self_cpu_us_per_step": e.self_cpu_time_total / 50}
        for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
    ]
    print(f"--- {name}\n{table}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cases = {c.name: c for c in load_grid()[0]}
    graph, _x = empty_graph()
    rows = [profile_case(n, cases[n]) for n in CASES]
    empty = median_us(graph.replay)
    cols = ("step_us", "plan_us", "plan_device_meta_us", "replay_us", "zero_us",
            "copy_from_host_us", "pin_memory_us", "to_cpu_int64_us")  # fmt: skip
    print(f"empty-graph replay {empty:.1f} us")
    print(f"{'case':<32}" + "".join(f"{c.removesuffix('_us'):>12}" for c in cols))
    for r in rows:
        print(f"{r['case']:<32}" + "".join(f"{r[c]:12.1f}" for c in cols))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "empty_replay_us": empty,
                       "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
