"""Replay the adaptive budget controller offline on recorded acceptance traces
(scripts/record_accept_traces.py) with a given cost per step, against every fixed budget: which
budgets it picks and the tokens/s that follow, in milliseconds of CPU instead of a GPU session.

The traces give, for every position of each prompt's greedy generation, the accepted path of a
largest-budget tree; a budget-B round there accepts that path cut at its first node index > B
(the budget-B tree is the first B nodes of the larger one). A plain step commits one token. The
controller (engine/budget_controller.py, unchanged) sees exactly what the engine feeds it:
`choose` per step, `observe_round` per round, `forget` when a request ends; requests run one
after another (batch 1), as bench_pair's b=1 rows. Costs are given, not measured, so the replay
shows the decision rule's quality apart from timing noise. A synthetic "unpredictable" text
(8 requests whose rounds accept nothing but a lucky draft in ten) is replayed too: there the
controller must stay near plain decoding.

`--calibrated`: the controller starts from this cost table (what calibration measured) while
the steps cost --costs (what serving measures), and each steady step (the third in a row at a
budget, as the engine's lookahead makes it) feeds its true cost back, as the engine does: how
the controller recovers from a calibration that misstated some budget.

    PYTHONPATH=src python scripts/sim_adaptive.py --traces T.json --costs '0:0.63,16:1.61,...'
        [--calibrated '0:0.63,16:1.9,...'] [--tokens 128] [--set decay=0.95 ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
from pathlib import Path

from treeverify.engine.budget_controller import (
    BudgetController,
    ControllerConfig,
    CostModel,
    budget_buckets,
)

# Seconds per step at batch 1 on the H200 (docs/performance.md, 2026-12-01): plain decoding
# 0.63 ms (bench_pair, 92e498b), a budget-16 DDTREE(dflash) round 1.61 ms (the same run: 3.74
# committed per round at 2317 tok/s); the other budgets scaled from the round profile (budget 64
# ~2% over 16, f9ca876), budgets 4 and 8 taken as 16's less 2%. Approximate: see --costs.
H200_COSTS = {0: 0.63e-3, 4: 1.58e-3, 8: 1.58e-3, 16: 1.61e-3, 32: 1.63e-3, 64: 1.65e-3}


def unpredictable(tokens: int, n: int = 8, lucky: float = 0.1,
                  deeper: tuple[tuple[int, float], ...] = ()) -> list[dict]:  # fmt: skip
    """Traces of text no drafter predicts: n requests whose rounds accept the root alone, a
    lucky draft in 1 / `lucky` (seeded: every replay sees the same ones). lucky 0.3: accept
    length ~1.3, the DFlash drafter's on prose sampled at T=1 (H100, fixed budgets 16-32).
    `deeper`: after a lucky draft, (node, probability) steps down the tree, each taken with its
    probability after the one before (node 9 needs a budget-16 tree, 40 a budget-64 one)."""
    rng = random.Random(0)

    def walk() -> list[int]:
        if rng.random() > lucky:
            return [0]
        out = [0, 1]
        for node, p in deeper:
            if rng.random() >= p:
                break
            out.append(node)
        return out

    return [{"paths": [walk() for _ in range(2 * tokens)]} for _ in range(n)]


def cut(path: list[int], budget: int) -> list[int]:
    """The budget-`budget` tree's walk: the larger tree's path up to its first node > budget."""
    out = []
    for node in path:
        if node > budget:
            break
        out.append(node)
    return out


def replay(traces: list[dict], tokens: int, costs: dict[int, float], policy,
           feedback: bool = False, switch_seconds: float = 0.0,
           bursts: tuple[int, int, float] | None = None) -> dict:  # fmt: skip
    """Generate `tokens` per prompt under `policy` (a fixed budget, or a BudgetController);
    returns tokens, seconds, rounds and steps by budget. `feedback`: the controller observes
    each steady step's cost (the third and later in a row at one budget). `switch_seconds`:
    added to a step whose neighbour is on the other path (plain <-> rounds): the engine
    launches the next step ahead only on the same path, so the step before a switch is read
    first (on the H200, tiny-code b=1: a plain step 0.291 ms read first, 0.2005 launched ahead).
    `bursts` (every, length, factor): steps `length` of every `every` (counted over the whole
    replay) cost `factor` times as much, and are observed so (a burst of slow host steps: on
    an H100 host 10-30 steps at 1-2.5 ms for 0.18, thirty-seventh session)."""
    seconds, steps, committed_total, rounds = 0.0, {}, 0, 0
    step_no = 0
    last, run = None, 0  # the previous step's budget, steps in a row at it
    for k, trace in enumerate(traces):
        paths, rid, made, p = trace["paths"], f"r{k}", 0, 0
        while made < tokens and p < len(paths):
            budget = policy.choose([rid]) if isinstance(policy, BudgetController) else policy
            steps[budget] = steps.get(budget, 0) + 1
            slow = bursts is not None and step_no % bursts[0] < bursts[1]
            cost = costs[budget] * (bursts[2] if slow else 1.0)
            step_no += 1
            if last is not None and (last == 0) != (budget == 0):
                cost += switch_seconds  # (the step's wall, as the engine's controller sees it)
            seconds += cost
            if isinstance(policy, BudgetController):
                policy.observe_wall(1, budget, cost)
            run, last = (run + 1 if budget == last else 1), budget
            if feedback and run >= 3 and isinstance(policy, BudgetController):
                policy.observe_step(1, budget, cost)
            if budget == 0:
                n = 1
            else:
                walk = cut(paths[p], budget)
                n = len(walk)  # accepted drafts + the bonus token
                rounds += 1
                if isinstance(policy, BudgetController):
                    policy.observe_round(rid, budget, walk)
            made += n
            p += n
        committed_total += made
        if isinstance(policy, BudgetController):
            policy.forget(rid)
    return {"tokens": committed_total, "seconds": round(seconds, 6),
            "tokens_per_s": round(committed_total / seconds, 1), "rounds": rounds,
            "steps_by_budget": dict(sorted(steps.items()))}  # fmt: skip


def ceilings(traces: list[dict], tokens: int, costs: dict[int, float]) -> dict:
    """What no causal controller can beat by much, at batch 1, in tokens/s: each request at its
    own best fixed budget (an oracle that knows each request's text beforehand), and each step
    at the budget with the best (accepted + 1) / cost at that position (an oracle that knows
    the round's outcome before choosing: the most a per-round signal, such as the drafter's
    confidence in this round's tree, could buy)."""
    per_request_tokens = per_request_seconds = 0.0
    for k in range(len(traces)):
        rows = [replay(traces[k : k + 1], tokens, costs, b) for b in costs]
        best = max(rows, key=lambda r: r["tokens_per_s"])
        per_request_tokens += best["tokens"]
        per_request_seconds += best["seconds"]
    made_total, seconds = 0, 0.0
    for trace in traces:
        paths, made = trace["paths"], 0
        while made < tokens and made < len(paths):
            path = paths[made]
            b = max(costs, key=lambda b: (len(cut(path, b)) if b else 1) / costs[b])
            made += len(cut(path, b)) if b else 1
            seconds += costs[b]
        made_total += made
    return {"per_request_best_fixed": round(per_request_tokens / per_request_seconds, 1),
            "per_step_oracle": round(made_total / seconds, 1)}  # fmt: skip


def table(costs_by_batch: dict[int, dict[int, float]]) -> CostModel:
    """A frozen cost model holding each batch size's curve (sizes between interpolate)."""
    m = CostModel(window=1)
    for n, curve in costs_by_batch.items():
        for b, sec in curve.items():
            m.observe(n, b, sec)
    m.frozen = True
    return m


def controller(buckets: tuple[int, ...], costs: dict, cfg: ControllerConfig,
               calibrated: bool = False) -> BudgetController:  # fmt: skip
    """A controller on `costs`: {batch: {budget: s}} frozen (a given table), or {budget: s}
    (batch 1), or {batch: {budget: s}} with `calibrated`, as a calibrated start that steady
    steps then update (every entry stale, as after calibration)."""
    nested = all(isinstance(v, dict) for v in costs.values())
    if nested and not calibrated:
        return BudgetController(buckets, table(costs), cfg)
    ctl = BudgetController(buckets, CostModel(cfg.cost_window), cfg)
    for n, curve in costs.items() if nested else [(1, costs)]:
        for b, sec in curve.items():
            ctl.observe_step(n, b, sec)
    ctl.reset()
    return ctl


def replay_batch(traces: list[dict], tokens: int, costs: CostModel, policy, batch: int,
                 cls: str | None = None, switch_seconds: float = 0.0,
                 lag: int = 0, queue: bool = False, feedback: bool = False) -> dict:  # fmt: skip
    """`replay` with `batch` requests decoding together, as bench_pair's b=8 rows: prompts in
    groups of `batch` starting together; each step one budget for every live request (the
    controller's `choose` over all of them), costing costs.estimate(live, budget); a request
    leaves when it has its tokens, so a group's last steps run smaller batches. `cls`: the
    requests' acceptance class, named to the controller (engine/budget_controller.py).
    `switch_seconds`: added to a step on the other path (plain <-> rounds) than the step
    before it, as `replay` does (a round entered from plain decoding, and the plain step after
    a round, run read first; at b=8 they also project the context rows pending). `lag`: the
    controller observes each round that many decisions late, as the engine does (it chooses
    the next step's budget, and launches it, before reading this step's round: lag 1).
    `queue`: continuous batching, as bench_pair's --queue: `batch` slots, each refilled by the
    next prompt at the step after its request finished (that step also pays one plain step at
    the new batch size: the newcomers' prefill), instead of groups that start together.
    `feedback`: the controller observes each steady step's cost (the third and later in a row
    at one batch size and budget), as `replay` does: a calibrated start's stale entries are
    re-measured by serving, and cost trials happen."""
    seconds, steps, committed_total, rounds = 0.0, {}, 0, 0
    unseen: list[list[tuple[str, int, list[int]]]] = []  # per decision, its rounds not yet seen
    ctl = policy if isinstance(policy, BudgetController) else None
    last = None  # the previous step's budget
    run, run_key = 0, None  # steps in a row at one (batch size, budget): `feedback`
    waiting = list(enumerate(traces))  # (prompt index, trace) not yet admitted
    live: dict[str, list] = {}

    def admit() -> float:
        """Fill free slots from the waiting prompts; the prefill's seconds (queue only)."""
        new = []
        while waiting and len(live) < batch:
            k, t = waiting.pop(0)
            live[f"r{k}"] = [t["paths"], 0, 0]
            new.append(f"r{k}")
        if ctl is not None and cls is not None:
            for rid in new:
                ctl.note_request(rid, cls)
        return costs.estimate(len(live), 0) if queue and new and steps else 0.0

    while waiting:
        admit()
        while live:
            rids = list(live)
            budget = ctl.choose(rids) if ctl else policy
            while ctl and len(unseen) > max(lag - 1, 0):  # the rounds read by now
                for rid, b, walk in unseen.pop(0):
                    if rid in live:  # (a finished request's last rounds were seen as it left)
                        ctl.observe_round(rid, b, walk)
            now: list[tuple[str, int, list[int]]] = []
            steps[budget] = steps.get(budget, 0) + 1
            wall = costs.estimate(len(rids), budget)
            if last is not None and (last == 0) != (budget == 0):
                wall += switch_seconds
            seconds += wall
            if ctl:  # every step's wall, as the engine's controller sees it
                ctl.observe_wall(len(rids), budget, wall)
            key = (len(rids), budget)
            run, run_key = (run + 1 if key == run_key else 1), key
            if ctl and feedback and run >= 3:  # a steady step's own cost
                ctl.observe_step(len(rids), budget, costs.estimate(len(rids), budget))
            last = budget
            for rid in rids:
                state = live[rid]
                paths, p, made = state
                if budget == 0:
                    n = 1
                else:
                    walk = cut(paths[p], budget)
                    n = len(walk)
                    rounds += 1
                    if ctl and lag:
                        now.append((rid, budget, walk))
                    elif ctl:
                        ctl.observe_round(rid, budget, walk)
                state[1], state[2] = p + n, made + n
                if state[2] >= tokens or state[1] >= len(paths):
                    committed_total += state[2]
                    del live[rid]
                    if ctl:
                        for r, b, walk in [x for d in unseen for x in d] + now:
                            if r == rid:  # the engine reads a request's last round, then drops it
                                ctl.observe_round(r, b, walk)
                        ctl.forget(rid)
            if lag:
                unseen.append(now)
            if queue:  # the freed slots taken before the next step
                seconds += admit()
    return {"tokens": committed_total, "seconds": round(seconds, 6),
            "tokens_per_s": round(committed_total / seconds, 1), "rounds": rounds,
            "steps_by_budget": dict(sorted(steps.items()))}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, required=True)
    ap.add_argument("--costs", help="budget:seconds,... (default: the H200's, see H200_COSTS)")
    ap.add_argument(
        "--calibrated",
        help="budget:seconds,... the controller starts from (steps still cost --costs)",
    )
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument(
        "--switch-seconds",
        type=float,
        default=0.0,
        help="a plain <-> rounds switch's cost (replay's switch_seconds)",
    )
    ap.add_argument("--set", action="append", default=[], help="ControllerConfig field=value")
    ap.add_argument(
        "--then",
        type=Path,
        help="another traces file: also replay ONE controller "
        "through this file's code, the unpredictable text, then --then's first 8 "
        "code prompts (does it fall back, and come back?)",
    )
    ap.add_argument("--batch", type=int, default=1, help="requests decoding together")
    ap.add_argument(
        "--batch-costs",
        help="budget:seconds,... at --batch (with --batch > 1; batch 1's are --costs)",
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    costs = H200_COSTS
    if args.costs:
        costs = {int(b): float(s) for b, s in (kv.split(":") for kv in args.costs.split(","))}
    data = json.loads(args.traces.read_text())
    data["texts"]["unpredictable"] = unpredictable(args.tokens)
    buckets = budget_buckets(max(costs))
    cfg = ControllerConfig().with_settings(args.set)
    out = {"traces": str(args.traces), "costs": costs, "controller": dataclasses.asdict(cfg),
           "texts": {}}  # fmt: skip
    by_batch = {1: costs}
    if args.batch > 1:
        if not args.batch_costs:
            raise SystemExit("--batch-costs: needed with --batch > 1")
        by_batch[args.batch] = {int(b): float(x) for b, x in
                                (kv.split(":") for kv in args.batch_costs.split(","))}  # fmt: skip
        out["batch"], out["batch_costs"] = args.batch, by_batch[args.batch]

    if args.calibrated and args.batch > 1:
        raise SystemExit("--calibrated: batch 1 only")
    calibrated = None
    if args.calibrated:
        calibrated = {
            int(b): float(s) for b, s in (kv.split(":") for kv in args.calibrated.split(","))
        }
        out["calibrated"] = calibrated

    def run(traces, policy):
        if args.batch == 1:
            return replay(
                traces,
                args.tokens,
                costs,
                policy,
                feedback=calibrated is not None,
                switch_seconds=args.switch_seconds,
            )
        return replay_batch(traces, args.tokens, table(by_batch), policy, args.batch)

    for text, traces in data["texts"].items():
        rows = {f"fixed {b}": run(traces, b) for b in buckets}
        rows["adaptive"] = run(traces, controller(buckets, calibrated or by_batch, cfg))
        plain = rows["fixed 0"]["tokens_per_s"]
        best = max((r for k, r in rows.items() if k != "adaptive"), key=lambda r: r["tokens_per_s"])
        print(f"--- {text} (plain {plain} tok/s)")
        for name, r in rows.items():
            r["speedup_vs_plain"] = round(r["tokens_per_s"] / plain, 3)
            mark = " <- best fixed" if r is best else ""
            print(f"  {name:10s} {r['tokens_per_s']:9.1f} tok/s {r['speedup_vs_plain']:6.3f}x "
                  f"steps {r['steps_by_budget']}{mark}")  # fmt: skip
        out["texts"][text] = rows
        if args.batch == 1:  # what no causal controller passes by much, beside the rows
            top = out.setdefault("ceilings", {})[text] = ceilings(traces, args.tokens, costs)
            print("  ceilings  ", {k: f"{v / best['tokens_per_s']:.3f} of the best fixed"
                                   for k, v in top.items()})  # fmt: skip
    if args.then:
        later = json.loads(args.then.read_text())["texts"]["code"][:8]
        segments = [
            ("code", data["texts"]["code"]),
            ("unpredictable", data["texts"]["unpredictable"]),
            ("code (--then)", later),
        ]
        ctl = BudgetController(buckets, CostModel.given(costs), cfg)
        out["sequence"] = {}
        for name, traces in segments:  # one controller throughout
            plain = replay(traces, args.tokens, costs, 0)["tokens_per_s"]
            got = replay(traces, args.tokens, costs, ctl, switch_seconds=args.switch_seconds)
            got = got["tokens_per_s"]
            out["sequence"][name] = round(got / plain, 3)
        print("--- one controller through", out["sequence"])
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
