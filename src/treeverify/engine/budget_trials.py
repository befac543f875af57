"""Cost trials and acceptance trials: the adaptive controller (engine/budget_controller.py)
moving to a bucket for a dwell to measure what it cannot see from where it is. Torch-free.

Cost trials (stale costs). A cost the controller does not run is not re-measured (a probe is one
step, never a steady overlapped one), so a calibration that overstated it would hold forever: on
the H200 the calibrated budget 16 (0.52 ms) kept the controller at 8 (0.43) while a fixed 16
outran it. A budget's cost is at least the fresh cost of any smaller budget (a larger tree is
never cheaper), so when that lower bound, in place of the stale cost, would beat the current
rate by the switch margin, the controller moves there for a dwell, which measures it; each
(batch size, budget) at most once per `cost_fresh_steps` steps (`cost_trial_backoff`: a wait
doubling while trials confirm the cost, engine/cost_trial_gaps.py); a trial's steps replace the
entry's window (`CostModel.restart`), and a cost at BURST_FACTOR x the lowest median its entry
held (a burst of slow host steps, engine/cost_bursts.py) is tried, fresh or not, weighed at that
median. Plain decoding's cost bounds nothing (another path): engine/plain_trials.py re-measures
it, started from here when no cost trial runs.

Acceptance trials. While the controller stays below a bucket, only the rare probes measure that
bucket's gain, so one unlucky probe can hold its estimate near zero for a whole generation; an
optimistic rate there that beats the current one moves the controller up for a dwell, judged
after it as a switch up would be.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from treeverify.engine import budget_events as ev
from treeverify.engine.acceptance_curves import RequestCurve, estimate_curve

if TYPE_CHECKING:
    from treeverify.engine.budget_controller import BudgetController

# Cost and acceptance trials are looked for every this many decisions: a search costs ~5 us
# of Python, a step at batch 1 on the H200 ~450 us of which the host's share overlaps the GPU.
TRIAL_CHECK_EVERY = 4


def cost_trial(ctl: BudgetController, request_ids: list[str], cur_rate: float,
               held: bool = False) -> None:  # fmt: skip
    """When some bucket's rate at its least possible cost (the largest fresh cost below it)
    beats the current rate by the switch margin while its own cost is stale, move to the
    nearest stale bucket on that side of the current one: its steps there measure it (and
    its fresh cost then bounds the buckets beyond it: on accurate costs one trial, not a
    climb to the top), and the usual rule (margin, dwell) decides after. A stale cost at
    BURST_FACTOR or more times the lowest median its entry held is weighed at that median
    too (on either side: a burst of slow host steps overstated it), and is tried even when
    its samples are fresh (the burst's are)."""
    n, now, fresh = len(request_ids), ctl.step_index, ctl.cfg.cost_fresh_steps
    if not ctl.cfg.cost_trials or ctl.since_switch < ctl.cfg.min_dwell:
        return
    steady = ctl.cfg.trial_steady_batch
    if steady and now - ctl._batch_since < steady:  # a batch size passing by (a draining
        return  # group's tail): no trial, plain trials included, until it holds
    if now % TRIAL_CHECK_EVERY:
        return
    ctl._bursts.calm(ctl.cost, n, ctl.buckets[1:])  # calm again: gaps forgotten
    over = {b: ctl.cost.overstated(n, b) for b in ctl.buckets[1:]}  # a burst's
    i = ctl.buckets.index(ctl.current)
    bar = (1 + ctl.cfg.switch_margin) * cur_rate
    gaps = ctl._trial_gaps
    for side in (ctl.buckets[i + 1 :], ctl.buckets[1:i][::-1]):  # above, then below
        # overstated by a burst (fresh as its samples are; none while held), or stale
        waits = {b: ctl._bursts.gap(n, b) if over[b] else fresh * gaps.wait(ctl, n, b)
                 for b in side}  # fmt: skip
        stale = [b for b in side
                 if (not held if over[b] else not ctl.cost.is_fresh(n, b, now, fresh))
                 and now - ctl._tried.get((n, b), -fresh - 1) > waits[b]]  # fmt: skip
        above = side and side[0] > ctl.current
        confirmed = gaps.confirmed(ctl, n, side, over, waits) if above else {}
        for b in stale:
            low = ctl.cost.lower_bound(n, b, now, fresh)
            # above the current bucket, one waiting out its back-off still bounds the ones
            # beyond it: its trials confirmed that cost (else a farther, dearer bucket took
            # its place: a review)
            bound = [m for w, m in confirmed.items() if w < b]
            if bound:
                low = max(bound) if low is None else max(low, *bound)
            if over[b]:  # weighed at its lowest median: below the
                # current bucket no fresh smaller cost bounds it, so without this a bucket
                # a burst hit was never measured again
                seen = ctl.cost.best[(n, b)]
                low = seen if low is None else min(low, seen)
            if low is not None and (r := ctl.rate(request_ids, b, cost=low)) and r > bar:
                nearest = stale[0]  # its fresh cost will bound the ones beyond it
                ctl._tried[(n, nearest)] = now
                ctl._bursts.tried(ctl.cost, n, nearest, fresh)
                if ctl.cfg.cost_trial_backoff:  # (before the window is cut)
                    gaps.tried(ctl.cost, n, nearest, now)
                ctl.cost.restart(n, nearest)  # its dwell's steps set the median
                ctl._move(ev.COST_TRIAL, nearest, n,
                           f"{b} at cost >= {low:.3g} s beats {bar:.4g}")  # fmt: skip
                ctl._cost_trial_at = ctl.step_index
                ctl.cost_trials += 1
                return
    ctl.plain_trials.maybe_start(ctl, n, bar)


def accept_trial(ctl: BudgetController, request_ids: list[str], cur_rate: float) -> None:
    """While the controller stays below a bucket, only the rare probes measure that bucket's
    gain, so one unlucky probe can hold its estimate near zero for a whole generation (the
    replay on tiny-code: 8 where 16 is 10% faster). When the bucket just above has fewer
    than `accept_evidence` rounds of some request's own, and an optimistic rate there (its
    gain `accept_optimism` (0.35, chosen on the replay: docs/ddtree.md) times the current
    bucket's own gain) beats the current rate by the switch margin, move up for a dwell:
    its rounds measure its gain for every request; `judge_accept_trial` decides after.
    Once per request and bucket; never from 0 (plain steps measure nothing)."""
    if not ctl.cfg.accept_trials or ctl.since_switch < ctl.cfg.min_dwell:
        return
    i = ctl.buckets.index(ctl.current)
    if i == 0 or i + 1 >= len(ctl.buckets) or ctl.step_index % TRIAL_CHECK_EVERY:
        return
    up, cur = ctl.buckets[i + 1], ctl.current
    reqs = [ctl.requests.get(rid) for rid in request_ids]
    if any(r is None for r in reqs):
        return  # a request with no rounds yet: the probes' curve is all there is

    def lacks(r: RequestCurve) -> bool:  # no trial of its own yet, and too few rounds at `up`
        mean = r.curve.get(up)
        return up not in r.tried_up and (mean.den if mean else 0.0) < ctl.cfg.accept_evidence

    lacking = [r for r in reqs if lacks(r)]
    cost_up = ctl.cost.estimate(len(request_ids), up)
    if not lacking or cost_up is None:
        return
    total = 0.0
    for rid, r in zip(request_ids, reqs, strict=True):
        curve = estimate_curve(
            ctl.buckets, r, ctl._prior_curve(rid), ctl.cfg.prior_rounds
        )  # A_r at every bucket; the current
        # bucket's gain: i - (i - 1)
        if curve[i] is None or curve[i - 1] is None:
            return
        total += 1.0 + curve[i] + ctl.cfg.accept_optimism * (curve[i] - curve[i - 1])
    if total / cost_up <= (1 + ctl.cfg.switch_margin) * cur_rate:
        return
    for r in reqs:
        r.tried_up.add(up)
    ctl._trial_from = cur
    ctl._move(ev.ACCEPT_TRIAL, up, len(request_ids),
               f"{len(lacking)} request(s) lack rounds at {up}")  # fmt: skip
    ctl.accept_trials += 1


def judge_accept_trial(ctl: BudgetController, rates: dict[int, float | None], n: int) -> None:
    """After its dwell, an acceptance trial stays only if it beats the bucket it left by
    the switch margin, as a switch up must; otherwise back (a trial within the margin would
    otherwise stay by hysteresis: replayed at b=8, a trial at 32 costing 2% more than 16)."""
    came_from, here = ctl._trial_from, ctl.current
    if came_from is None or ctl.since_switch < ctl.cfg.min_dwell:
        return
    ctl._trial_from = None
    r_here, r_from = rates.get(here), rates.get(came_from)
    known = r_here is not None and r_from is not None
    if known and r_here <= (1 + ctl.cfg.switch_margin) * r_from:
        ctl._move(ev.TRIAL_BACK, came_from, n, f"rate {r_here:.4g} vs {r_from:.4g}")
