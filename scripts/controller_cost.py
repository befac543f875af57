"""Host time of the adaptive controller's per-step work at plain decoding (`choose` and
`observe_step`), no engine: n requests of low acceptance (sampled text) held at budget 0, step
costs from the H200's b=8 table, rounds at the probes. At b=8 a step is host-bound on the GPU,
so every microsecond here is one of the step's. `--rounds`: greedy requests of code-like
acceptance (2-7 drafts a round), held at a round budget, every step a round observed per
request (`choose` + `observe_round` x n + `observe_step`).

    PYTHONPATH=src python3 scripts/controller_cost.py [--requests 1,8] [--steps 20000]
        [--repeat 2] [--rounds] [--set KNOB=VALUE ...] [--json F] [--label L]
        (L: whose controller PYTHONPATH holds; --set: ControllerConfig knobs)
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from raw_json import write_rows  # noqa: E402

from treeverify.engine.budget_controller import (  # noqa: E402
    GREEDY,
    SAMPLED,
    BudgetController,
    ControllerConfig,
    budget_buckets,
)

# H200 (45a5d34, thirty-eighth session): the DFlash engine's step costs at 8 requests, seconds
COSTS = {0: 224e-6, 4: 441e-6, 8: 537e-6, 16: 589e-6, 32: 586e-6, 64: 739e-6}


def run(n: int, steps: int, accept: float, rounds: bool = False,
        cfg: ControllerConfig | None = None) -> tuple[float, dict[int, int]]:  # fmt: skip
    """us a step (choose + observe_step) for n requests held at plain decoding (`rounds`: at a
    round budget, code-like acceptance), and the budgets chosen."""
    rng = random.Random(0)
    ctl = BudgetController(budget_buckets(max(COSTS)), config=cfg)
    for b, c in COSTS.items():
        for _ in range(ctl.cfg.cost_window):
            ctl.cost.observe(n, b, c * rng.uniform(0.95, 1.05), at=0)
    ids = [f"r{i}" for i in range(n)]

    def a_round(budget: int) -> None:
        for rid in ids:
            if rounds:  # 2-7 drafts along the first nodes of a best-first tree
                nodes = [i for i in (1, 2, 4, 6, 9, 12, 15, 20) if i <= budget]
                ctl.observe_round(rid, budget, [0] + nodes[: rng.randint(2, 7)])
            else:
                ctl.observe_round(rid, budget, [0, 1] if rng.random() < accept else [0])

    for rid in ids:
        ctl.note_request(rid, GREEDY if rounds else SAMPLED)
    for _ in range(3):
        a_round(max(COSTS))
    budgets: dict[int, int] = {}
    t0 = time.perf_counter()
    for _ in range(steps):
        b = ctl.choose(ids)
        budgets[b] = budgets.get(b, 0) + 1
        ctl.observe_step(n, b, COSTS[b] * rng.uniform(0.95, 1.05))
        if b:
            a_round(b)
    return (time.perf_counter() - t0) / steps * 1e6, budgets


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", default="1,8", help="comma list of batch sizes")
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=2, help="runs per batch size")
    ap.add_argument("--accept", type=float, default=0.3, help="chance a round accepts a draft")
    ap.add_argument("--rounds", action="store_true", help="held at rounds (code-like text)")
    ap.add_argument("--label", default="", help="whose controller this is (kept in the rows)")
    ap.add_argument("--set", action="append", default=[], help="ControllerConfig KNOB=VALUE")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    cfg = ControllerConfig().with_settings(args.set)  # (a bad knob: its ValueError first)
    rows = []
    for n in (int(x) for x in args.requests.split(",")):
        for _ in range(args.repeat):
            us, budgets = run(n, args.steps, args.accept, args.rounds, cfg)
            rows.append({"label": args.label, "requests": n, "rounds": args.rounds, "set": args.set,
                         "us_per_step": round(us, 2), "steps_by_budget": budgets})  # fmt: skip
            print(
                f"{n} requests: {us:.1f} us a step (choose, observe_step, rounds seen); "
                f"steps by budget {budgets}"
            )
    if args.json:
        write_rows(args.json, "controller_cost.py", None, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
