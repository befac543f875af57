"""The adaptive controller's host time a step inside the engine (CPU, the real tiny-code pair):
every controller call and the engine's own step-path check timed by wrappers, per step, at a
b=8 queue of code prompts, the controller's costs frozen at the H100's b=8 table so its
decisions resemble the GPU's (on the CPU's own costs it decodes plainly). What
scripts/controller_cost.py's synthetic loop leaves out: the engine's batches as requests join
and leave, its calls as it makes them, the step-path check, observe_step / observe_wall. At
b=8 the GPU's step may be host-bound, so this is step time.

    PYTHONPATH=src python3 scripts/controller_engine_cost.py [--set KNOB=VALUE ...]
        [--requests 16] [--tokens 64] [--json F]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pair import code_prompts  # noqa: E402
from call_timer import wrap  # noqa: E402
from raw_json import write_rows  # noqa: E402
from sim_adaptive import controller  # noqa: E402
from sim_adaptive_suite import H100_BATCH  # noqa: E402

from treeverify.engine.llm import LLM  # noqa: E402
from treeverify.engine.sampling_params import SamplingParams  # noqa: E402

HELDOUT = (
    Path(__file__).resolve().parent.parent / "src/treeverify/models/data/tiny-code/heldout.json"
)
CALLS = ("choose", "observe_round", "observe_step", "observe_wall", "forget", "note_request")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", action="append", default=[], help="ControllerConfig KNOB=VALUE")
    ap.add_argument("--requests", type=int, default=16, help="code prompts through 8 slots")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    llm = LLM("tiny-code", device="cpu", num_pages=4096, max_num_seqs=8,
              speculative_algorithm="DDTREE", speculative_ddtree_budget=64,
              speculative_adaptive=True, speculative_controller=tuple(args.set))  # fmt: skip
    # the engine's own controller swapped for one on the H100's b=1 / b=8 costs, frozen (the
    # replay's: scripts/sim_adaptive.py), its knobs kept
    ctl = llm.controller = controller(llm.controller.buckets, H100_BATCH, llm.controller.cfg)
    acc, calls = collections.Counter(), collections.Counter()
    for name in CALLS:
        wrap(ctl, name, f"controller.{name}", acc, calls)
    wrap(llm, "_cost_path", "engine._cost_path", acc, calls)
    for p in code_prompts(HELDOUT, args.requests):
        llm.add_request(p, SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True))
    steps = 0
    while llm.has_unfinished():
        llm.step()
        steps += 1
    total = sum(v for k, v in acc.items() if k.startswith("controller."))
    budgets = {b: c for b, c in ctl.steps_by_budget.items() if c}
    print(f"{steps} steps, set {args.set}, decisions by budget {budgets}")
    rows = []
    for key, sec in acc.most_common():
        us = sec / steps * 1e6
        rows.append(
            {
                "call": key,
                "us_per_step": round(us, 2),
                "calls_per_step": round(calls[key] / steps, 2),
            }
        )
        print(f"  {key:28s} {us:7.1f} us a step  ({calls[key] / steps:.2f} calls a step)")
    print(f"  {'controller, all calls':28s} {total / steps * 1e6:7.1f} us a step")
    rows.append({"call": "controller total", "us_per_step": round(total / steps * 1e6, 2),
                 "steps": steps, "set": args.set, "decisions_by_budget": budgets})  # fmt: skip
    if args.json:
        write_rows(args.json, "controller_engine_cost.py", None, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
