"""The SM clock the GPU actually runs our latency-bound work at, measured from inside the work.

Why: the tree build's kernels cost ~11 us each whatever their size (a draft top-k of one
512-entry row: 8.5 us; a heap pop ~1 us, "~2,000 cycles" if the SMs ran at 1980 MHz;
docs/performance.md, twenty-seventh session), and the device notes saw the H200's SMs at 345 MHz
idle and 1980 MHz after a matrix product. If a replay of tiny kernels runs below the boost
clock, those "cycles" are an artefact and the remedy is fewer, larger kernels, not faster ones.

How (no clock setting is touched; METHOD.md): `torch.cuda._sleep(n)` spins one thread for n SM
cycles (clock64), so n / its event-timed duration is the SM clock in MHz while it runs. Probed
(1) cold, (2) right after ~1 s of large matrix products, (3) while ~1 s of captured graphs of
100 tiny kernels each replays back to back (a decode step's kind of load: many launches, little
work), (4) after 1 s idle again, each the median of several probes; `nvidia-smi` samples the
reported SM clock beside it when it is there.

    PYTHONPATH=src python scripts/gpu_clock_probe.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from datetime import datetime, timezone

import torch

SPIN_CYCLES = 200_000  # ~0.1 ms at 1980 MHz, ~0.6 ms at 345


def spin_mhz(probes: int = 7) -> float:
    """Median SM clock (MHz) over `probes` event-timed spins of SPIN_CYCLES cycles."""
    got = []
    for _ in range(probes):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(SPIN_CYCLES)
        b.record()
        b.synchronize()
        got.append(SPIN_CYCLES / (a.elapsed_time(b) * 1e3))  # cycles / us = MHz
    return round(statistics.median(got), 1)


def smi_clock() -> str | None:
    """nvidia-smi's reported SM clock now (None where it does not answer)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,utilization.gpu",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=10)  # fmt: skip
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def tiny_graph(kernels: int = 100) -> torch.cuda.CUDAGraph:
    """A graph of `kernels` one-element adds: launches with next to no work in them."""
    x = torch.zeros(1, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            x.add_(1.0)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(kernels):
            x.add_(1.0)
    return g


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--seconds", type=float, default=1.0, help="each load phase")
    args = ap.parse_args()
    torch.cuda.init()
    out: dict = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(), "spin_cycles": SPIN_CYCLES, "phases": {},
    }  # fmt: skip
    torch.cuda._sleep(1000)  # module load etc. before the first probe
    torch.cuda.synchronize()

    def phase(name: str) -> None:
        out["phases"][name] = {"spin_mhz": spin_mhz(), "nvidia_smi": smi_clock()}
        print(f"{name:34s} {out['phases'][name]}", flush=True)

    phase("cold")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < args.seconds:
        a @ a
    phase("after matrix products")
    g = tiny_graph()
    g.replay()
    torch.cuda.synchronize()
    t0, replays = time.perf_counter(), 0
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ev0.record()
    while time.perf_counter() - t0 < args.seconds:
        for _ in range(20):
            g.replay()
        replays += 20
        torch.cuda.synchronize()
    ev1.record()
    ev1.synchronize()
    us_per_kernel = ev0.elapsed_time(ev1) * 1e3 / (replays * 100)
    out["tiny_kernel_us"] = round(us_per_kernel, 3)
    print(f"tiny graph: {us_per_kernel:.2f} us a kernel over {replays} replays", flush=True)
    phase("right after tiny-kernel replays")
    # the clock *during* such a load: spins interleaved with the replays
    during = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < args.seconds:
        for _ in range(5):
            g.replay()
        during.append(spin_mhz(1))
    out["phases"]["during tiny-kernel replays"] = {"spin_mhz": round(statistics.median(during), 1),
                                                   "probes": len(during)}  # fmt: skip
    print(f"{'during tiny-kernel replays':34s} {out['phases']['during tiny-kernel replays']}")
    time.sleep(args.seconds)
    phase("after 1 s idle")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
