"""The probe cycle of bench_pair's b=8 queue on sampled text, replayed: 8 slots refilled by 32
requests of 128 tokens each, text no drafter predicts but with the sampled class's acceptance
near what the H100 measured at T=1 (budget 4 accepts ~0.5 drafts, 64 ~0.75), one adaptive
controller over several passes (as bench_pair's engine lives through its passes), rounds seen a
decision late, a plain <-> rounds switch charged as measured at b=8, at the 0932ca9 lease's
step costs. Per pass: x plain decoding, probes, interval restarts, and how many probes fell on
the last two decisions before a group of requests finished.

Why (fifty-fifth session): on the H100 the adaptive engine probed 1 to 5 times a 512-decision
pass at b=8 on prose sampled at T=1, each probe from plain decoding a 1.5-3.4 ms step (~8-19
plain steps). With budget 4 at ~0.65 of plain decoding's rate on the sampled class's prior,
above `arrival_probe_factor` (0.6), every group of arrivals restarts the probes' interval and
the interval is never far: the probes come every `explore_max` (256) decisions, two a pass,
~6% of its time, and a probe on a group's last decision puts the next group's arrival right
after it. The replay suite cannot show this: its sampled traces sit under the factor.

    PYTHONPATH=src python scripts/sim_probe_cycle.py ['{"knob": value}' ...]  (ControllerConfig)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_adaptive import controller, replay_batch, table, unpredictable  # noqa: E402
from sim_adaptive_suite import SWITCH_SECONDS_B8, texts  # noqa: E402

from treeverify.engine.budget_controller import ControllerConfig, budget_buckets  # noqa: E402

# bench_results/2026-12-07-h100-0932ca9-pair_queue8_quiet.json: the adaptive engine's step
# costs (`cost_seconds_batch1`, `cost_seconds_batch8`) on prose sampled at T=1, seconds
COSTS = {
    1: {0: 0.000149, 4: 0.000257, 8: 0.000287, 16: 0.000276, 32: 0.000369, 64: 0.000504},
    8: {0: 0.000134, 4: 0.000312, 8: 0.000331, 16: 0.000357, 32: 0.000417, 64: 0.000576},
}
TOKENS, REQUESTS, SLOTS = 128, 32, 8


def sampled_traces(first: float = 0.5, n: int = REQUESTS, tokens: int = TOKENS) -> list[dict]:
    """Rounds that accept the first draft with probability `first`; after it, 0.4 of them one
    more inside a budget-16 tree (node 9) and 0.3 of those one more inside 64 (node 40): the
    class curve A(4) = A(8) = first, A(16) = A(32) = 1.4 first, A(64) ~1.5 first. The H100's
    sampled class at T=1: 0.52 / 0.63 / 0.91 / 0.95 / 1.09 at 4 / 8 / 16 / 32 / 64."""
    return unpredictable(tokens, n, first, deeper=((9, 0.4), (40, 0.3)))


def run(cfg: ControllerConfig, passes: int = 4, first: float = 0.5,
        code_after: bool = False) -> list[dict]:  # fmt: skip
    """`passes` passes of the queue with one controller: each pass's x plain, probes,
    interval restarts, and restarts right after a probe. `code_after`: then one more pass of
    32 recorded code traces (set 3) also sampling (code at a low temperature: a sampled request
    the drafter predicts), its x plain and x the best fixed budget: does a stricter bar for
    sampled arrivals leave such requests at plain decoding?"""
    costs, traces = table(COSTS), sampled_traces(first)
    plain = replay_batch(traces, TOKENS, costs, 0, SLOTS, queue=True)["tokens_per_s"]
    ctl = controller(budget_buckets(64), COSTS, cfg)
    out = _passes(ctl, costs, traces, plain, passes)
    if code_after:
        code = texts()["set3 code"][:REQUESTS]
        fixed = {b: replay_batch(code, TOKENS, costs, b, SLOTS, queue=True)["tokens_per_s"]
                 for b in budget_buckets(64)}  # fmt: skip
        row = _passes(ctl, costs, code, fixed[0], 1)[0]
        row["x_best_fixed"] = round(row["x_plain"] * fixed[0] / max(fixed.values()), 3)
        out.append(row | {"text": "code, sampled"})
    return out


def _passes(ctl, costs, traces: list[dict], plain: float, passes: int) -> list[dict]:
    out = []
    for _ in range(passes):
        start, probes = ctl.step_index, ctl.explorations
        got = replay_batch(traces, TOKENS, costs, ctl, SLOTS, "sampled", SWITCH_SECONDS_B8, 1,
                           queue=True)  # fmt: skip
        if not ctl.events.complete_since(start):  # (the log keeps its last 128 events)
            raise RuntimeError("the decision log lost events of this pass: count them otherwise")
        events = ctl.events.since(start)
        restarts = [e["step"] for e in events if e["kind"] == "interval_restart"]
        probed = [e["step"] for e in events if e["kind"] == "probe"]
        out.append({
            "x_plain": round(got["tokens_per_s"] / plain, 3),
            "probes": ctl.explorations - probes,
            "restarts": len(restarts),
            # a restart one decision after a probe: its round made a group finish, and the
            # requests that replaced it arrived with no rounds of their own
            "restarts_after_a_probe": sum(1 for r in restarts if r - 1 in probed),
        })  # fmt: skip
    return out


def main(argv: list[str]) -> int:
    for knobs in [{}, *(json.loads(a) for a in argv)]:
        cfg = ControllerConfig(**knobs)
        for first in (0.3, 0.5):
            rows = run(cfg, first=first, code_after=True)
            cells = " | ".join(f"{r['x_plain']:.3f} ({r['probes']} probes, {r['restarts']} "
                               f"restarts, {r['restarts_after_a_probe']} after a probe)"
                               for r in rows[:-1])  # fmt: skip
            code = rows[-1]
            print(f"{knobs or 'defaults'} A(4)={first}: {cells}; then code, sampled: "
                  f"{code['x_plain']:.3f}x plain, {code['x_best_fixed']:.3f} of the best "
                  f"fixed ({code['probes']} probes)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
