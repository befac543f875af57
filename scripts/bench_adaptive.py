"""Adaptive vs fixed DDTree budgets vs plain decoding (treeverify.bench.adaptive), one JSON under
bench_results/ named by date, device and commit, and the markdown table docs/performance.md shows.

python scripts/bench_adaptive.py --model smollm2-135m --chat --max-tokens 40
python scripts/bench_adaptive.py --model tiny-llama --max-tokens 96
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path

import torch

from treeverify.bench.adaptive import WORKLOADS, adaptive_vs_fixed


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True)  # fmt: skip
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "cpu"


def table(rows: list[dict]) -> str:
    configs = list(dict.fromkeys(r["config"] for r in rows))
    out = ["| workload | " + " | ".join(f"{c} tok/s" for c in configs)
           + " | adaptive / plain | adaptive / best fixed | adaptive cold / plain "
           "| adaptive budgets (steps) |",
           "|" + " --- |" * (len(configs) + 5)]  # fmt: skip
    for wl in dict.fromkeys(r["workload"] for r in rows):
        by = {r["config"]: r for r in rows if r["workload"] == wl}
        cells = []
        for c in configs:
            r = by[c]
            acc = ""
            if r.get("rounds"):
                acc = f" (τ {r['avg_accept_length']:.2f})"
            elif "rounds" in r:
                acc = " (no rounds)"
            cells.append(f"{r['tokens_per_s']:.2f}{acc}")
        a = by["adaptive"]
        steps = ", ".join(f"{b}: {n}" for b, n in a.get("steps_by_budget", {}).items() if n)
        cold = a["cold_tokens_per_s"] / by["plain"]["tokens_per_s"]
        ratios = f"{a['vs_plain']:.2f}x | {a['vs_best_fixed']:.2f}x | {cold:.2f}x"
        out.append(f"| {wl} | " + " | ".join(cells) + f" | {ratios} | {steps} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--budgets", default="4,8,16", help="fixed budgets; adaptive goes up to the max")
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    p.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="runs per cell: the first cold, the best of the rest reported",
    )
    p.add_argument(
        "--clock",
        choices=("wall", "process"),
        default="wall",
        help="process: CPU seconds of this process (a shared CPU; sets one thread)",
    )
    p.add_argument("--threads", type=int, help="torch threads (default: 1 with --clock process)")
    p.add_argument("--out", default="bench_results")
    args = p.parse_args(argv)
    if args.threads or args.clock == "process":
        torch.set_num_threads(args.threads or 1)
    commit = _commit()  # the code this run imported
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()  # fmt: skip
    commit += "-dirty" if dirty else ""
    rows = adaptive_vs_fixed(
        args.model, workloads=args.workloads.split(","), max_tokens=args.max_tokens,
        budgets=tuple(int(b) for b in args.budgets.split(",")), depth=args.depth,
        device=args.device, chat=args.chat, repeat=args.repeat, clock=args.clock,
    )  # fmt: skip
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    dev = "cpu" if args.device == "cpu" else torch.cuda.get_device_name().split()[-1].lower()
    result = {
        "date": date, "commit": commit, "device": _cpu() if dev == "cpu" else dev,
        "torch_threads": torch.get_num_threads(), "clock": args.clock,
        "command": " ".join(["python"] + sys.argv),
        "rows": rows,
    }  # fmt: skip
    path = Path(args.out) / f"{date}-{dev}-adaptive-{args.model}-{commit}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"Run: {date}, {result['device']} ({result['torch_threads']} threads), commit {commit}, "
          f"{args.clock} clock")  # fmt: skip
    print(table(rows))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
