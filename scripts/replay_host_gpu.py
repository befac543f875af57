"""Does a CUDA graph's replay block the host while an earlier replay of the same graph runs?
(GPU machine.) The whole-round graph (engine/round_graphs.py) is launched one round ahead, while
its previous replay still runs; the round profile showed ~85 us of host time in that replay call
against ~5 us on an idle queue. Here a synthetic graph of `--kernels` small kernels (about a
round's count and length) is timed: its host launch time on an idle queue, right behind a replay
of itself, and right behind a replay of an identical second graph (what double-buffered round
graphs would do).
Usage (repo root): python3 scripts/replay_host_gpu.py [--kernels 200] [--json F]"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def build(kernels: int, x: torch.Tensor) -> torch.cuda.CUDAGraph:
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            x.mul_(1.0001).add_(1e-4)  # warm up outside the capture
        with torch.cuda.graph(g, stream=s):
            for _ in range(kernels // 2):
                x.mul_(1.0001).add_(1e-4)  # (1024, 1024) fp32: a few us each
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    return g


def launch_us(g: torch.cuda.CUDAGraph) -> float:
    t0 = time.perf_counter()
    g.replay()
    return (time.perf_counter() - t0) * 1e6


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", type=int, default=200)
    ap.add_argument("--size", type=int, default=1 << 18, help="elements a kernel touches")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    x, y = (torch.ones(args.size, device="cuda") for _ in range(2))
    a, b = build(args.kernels, x), build(args.kernels, y)
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ev0.record()
    a.replay()
    ev1.record()
    torch.cuda.synchronize()
    gpu_us = ev0.elapsed_time(ev1) * 1e3
    idle, behind_self, behind_other, self_pair = [], [], [], []
    for _ in range(50):
        torch.cuda.synchronize()
        idle.append(launch_us(a))
        torch.cuda.synchronize()
        a.replay()
        behind_self.append(launch_us(a))  # a is still running
        torch.cuda.synchronize()
        a.replay()
        behind_other.append(launch_us(b))  # a is running; b is another exec
        torch.cuda.synchronize()
        a.replay()
        b.replay()
        self_pair.append(
            launch_us(a)
        )  # a, then b queued: a again (double buffering's steady state)
    torch.cuda.synchronize()
    out = {"gpu": torch.cuda.get_device_name(), "kernels": args.kernels,
           "graph_gpu_us": round(gpu_us, 1),
           "launch_us_idle": round(median(idle), 1),
           "launch_us_behind_itself": round(median(behind_self), 1),
           "launch_us_behind_another": round(median(behind_other), 1),
           "launch_us_behind_itself_then_another": round(median(self_pair), 1)}  # fmt: skip
    print(json.dumps(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
