"""A calibration that overstated plain decoding's cost, with and without plain trials (issue 13:
speculation that never loses). On the CPU, one process's clock (a shared machine's neighbours do
not count), tiny-code + its DFlash drafter, the adaptive budget:

    plain            plain decoding
    adaptive         the adaptive budget as calibrated
    stalled          plain decoding's calibrated cost x --stall (a stall while calibrating: a
                     neighbour's load put it at 16 ms for 8 on this CPU), default knobs
    stalled-floor1   the same, stale_plain_floor=1.0 (plain trials only where the stale cost
                     already wins: the behaviour before plain trials, nearly)

Per workload (bench/adaptive.py's texts), interleaved passes, each config's best; one JSON.

    PYTHONPATH=src python3 scripts/stalled_plain_ab.py --json out.json [--stall 2.6]
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from treeverify.bench.adaptive import WORKLOADS
from treeverify.engine.llm import LLM
from treeverify.engine.sampling_params import SamplingParams


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--stall", type=float, default=2.6, help="x plain's calibrated cost")
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--workloads", default="prose-sampled,code,prose,list")
    args = ap.parse_args()
    torch.set_num_threads(1)
    spec = dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=16,
                speculative_num_draft_tokens=15, speculative_cost_clock="process")  # fmt: skip
    llms = {
        "plain": LLM("tiny-code", num_pages=256),
        "adaptive": LLM("tiny-code", num_pages=256, **spec),
        "stalled": LLM("tiny-code", num_pages=256, **spec),
        "stalled-floor1": LLM("tiny-code", num_pages=256,
                              speculative_controller=("stale_plain_floor=1.0",), **spec),
    }  # fmt: skip
    calibrated = llms["adaptive"].controller.cost.curve(1)
    for name in ("stalled", "stalled-floor1"):  # the stall: plain's calibrated entry inflated
        cost = llms[name].controller.cost
        stalled = args.stall * cost.estimate(1, 0)
        cost.table[(1, 0)] = collections.deque([stalled], maxlen=cost.window)
        cost._median[(1, 0)] = stalled
    rows = []
    for wl in args.workloads.split(","):
        text, temp = WORKLOADS[wl]
        sp = SamplingParams(temperature=temp, max_tokens=args.tokens, ignore_eos=True, seed=7)
        best = dict.fromkeys(llms, float("inf"))
        steps = {}
        for _ in range(args.passes):
            for name, llm in llms.items():
                llm.reset_stats()
                t0 = time.process_time()
                llm.generate([text], sp)
                best[name] = min(best[name], time.process_time() - t0)
                if llm.spec_stats:
                    steps[name] = llm.spec_stats["adaptive"]["steps_by_budget"]
        for name in llms:
            row = {"workload": wl, "config": name, "seconds": round(best[name], 4),
                   "vs_plain": round(best["plain"] / best[name], 3),
                   "steps_by_budget": steps.get(name)}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    out = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit,
           "device": "cpu", "clock": "process", "torch_threads": 1, "stall": args.stall,
           "tokens": args.tokens, "passes": args.passes, "calibrated_seconds": calibrated,
           "rows": rows}  # fmt: skip
    args.json.write_text(json.dumps(out, indent=1))
    print("| workload | " + " | ".join(llms) + " |")
    for wl in args.workloads.split(","):
        cells = [f"{r['vs_plain']:.3f}x" for r in rows if r["workload"] == wl]
        print(f"| {wl} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
