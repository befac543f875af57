"""Cost trials over many passes, replayed: bench_pair's b=8 queue on recorded code traces (32
requests of 128 tokens; four mixes of the recorded sets), one adaptive controller over nine
passes (as bench_pair's engine lives through its passes), started from the H100's calibrated
table (0932ca9, every entry stale) while steps cost what serving measured there; steady steps
feed their cost back, so stale entries are re-measured and cost trials happen, as on the GPU.
Per config: the passes' x the best fixed budget, cost trials and steps at each budget. Asks
what `cost_trial_backoff` (trials that confirm the table wait longer) saves where the device's
costs do not move.

    PYTHONPATH=src python scripts/sim_trial_backoff.py ['{"knob": value}' ...]  (ControllerConfig)
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_adaptive import controller, replay_batch, table  # noqa: E402
from sim_adaptive_suite import SWITCH_SECONDS_B8, texts  # noqa: E402

from treeverify.engine.budget_controller import (  # noqa: E402
    BudgetController,
    ControllerConfig,
    budget_buckets,
)

# bench_results/2026-12-07-h100-0932ca9-pair_queue8_quiet.json, the adaptive engine on code:
# `calibrated_medians` (what startup measured) and `cost_seconds_batch*` (what serving did)
CALIBRATED = {
    1: {0: 0.000151, 4: 0.000258, 8: 0.00028, 16: 0.0003, 32: 0.000393, 64: 0.000481},
    8: {0: 0.000181, 4: 0.000364, 8: 0.000413, 16: 0.00045, 32: 0.000486, 64: 0.000642},
}
SERVED = {
    1: {0: 0.000151, 4: 0.000258, 8: 0.000261, 16: 0.0003, 32: 0.000393, 64: 0.000434},
    8: {0: 0.000123, 4: 0.000364, 8: 0.000338, 16: 0.000362, 32: 0.000429, 64: 0.000531},
}
TOKENS, REQUESTS, SLOTS, PASSES = 128, 32, 8, 9


def calibrated(cfg: ControllerConfig) -> BudgetController:
    """A controller as calibrate() leaves it: the table filled at 1 and 8, every entry stale."""
    return controller(budget_buckets(64), CALIBRATED, cfg, calibrated=True)


def code_sets() -> dict[str, list[dict]]:
    """Four queues of 32 recorded code traces (the trace sets of sim_adaptive_suite.py)."""
    t = texts()
    return {
        "set3 0-31": t["set3 code"][:REQUESTS],
        "set3 8-39": t["set3 code"][8:40],
        "set2 twice": t["set2 code"] * 2,
        "sets 1, 4, 5, 2": t["set1 code"] + t["set4 code"] + t["set5 code"] + t["set2 code"][:8],
    }


def run(cfg: ControllerConfig, code: list[dict], passes: int = PASSES,
        switch: float = SWITCH_SECONDS_B8) -> dict:  # fmt: skip
    """`passes` passes of the queue with one controller: x the best fixed budget each pass,
    cost trials and the steps at each budget over all of them. `switch`: seconds a plain <->
    rounds switch adds (as measured at b=8, as the suite's charged rows; 0: free)."""
    costs = table(SERVED)
    best = max(replay_batch(code, TOKENS, costs, b, SLOTS, queue=True)["tokens_per_s"]
               for b in budget_buckets(64))  # fmt: skip
    ctl = calibrated(cfg)
    xs, steps = [], {}
    for _ in range(passes):
        got = replay_batch(code, TOKENS, costs, ctl, SLOTS, "greedy", switch, 1, queue=True,
                           feedback=True)  # fmt: skip
        xs.append(round(got["tokens_per_s"] / best, 3))
        for b, k in got["steps_by_budget"].items():
            steps[b] = steps.get(b, 0) + k
    return {"x_best_fixed": xs, "cost_trials": ctl.cost_trials,
            "steps_by_budget": dict(sorted(steps.items()))}  # fmt: skip


def main(argv: list[str]) -> int:
    for (name, code), switch in itertools.product(code_sets().items(), (SWITCH_SECONDS_B8, 0.0)):
        for knobs in [{}, {"cost_trial_backoff": True}, *(json.loads(a) for a in argv)]:
            r = run(ControllerConfig(**knobs), code, switch=switch)
            xs = r["x_best_fixed"]
            print(f"{name}, switches {'charged' if switch else 'free'}, {knobs or 'defaults'}: "
                  f"x best fixed, passes 2-{len(xs)}: "
                  f"{sum(xs[1:]) / (len(xs) - 1):.3f} (pass 1 {xs[0]:.3f}); cost trials "
                  f"{r['cost_trials']}; steps {r['steps_by_budget']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
