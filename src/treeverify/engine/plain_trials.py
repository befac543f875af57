"""Plain trials: the adaptive controller re-measuring plain decoding's stale cost (a mixin-free
helper of engine/budget_controller.py).

A round's cost bounds the costs of larger rounds (a larger tree is never cheaper), so cost
trials can re-measure stale round costs; plain decoding's cost bounds nothing (another path), so
only plain steps refresh it. A calibration during a stall overstated it and held a CPU engine
in rounds on text no drafter predicts (0.64-0.66x plain, thirty-second session). So when plain
decoding's stale cost at `stale_plain_floor` of itself would beat the rounds' rate (the switch
margin included) on PLAIN_TRIAL_PATIENCE trial checks in a row, PLAIN_TRIAL_STEPS plain steps
measure it and the controller resumes the decision state it had (the trial only measures; the
usual rule then decides on the fresh cost). At most one trial per `cost_fresh_steps` decisions
per batch size with a plain cost measured at it; a batch size whose estimate is derived from
other sizes' costs (interpolated, or scaled from the nearest) has none within the gap of the
engine's last trial at any size (that size's gap): a b=8 group's draining tail, 7, 6, 5
requests, each a size never measured, had a trial in four of five passes on the H100 (6 plain
steps each, ~2% of a pass of code; `plain_trials_per_batch`: every size its own, as before the
forty-third session). The gap doubles after each trial that confirmed the estimate (within
PLAIN_TRIAL_CONFIRMED of it), up to PLAIN_TRIAL_MAX_GAP x `cost_fresh_steps`.

A burst of slow host steps overstates plain decoding's cost by far more than 2x (medians of
0.5-1.7 ms for 0.18 on the H100 at 869825f, where the DFlash engine then ran no plain step in
five passes of sampled prose: 0.51x plain), so the trial is also weighed at the lowest median
plain decoding has held (`CostModel.best`), and a trial cuts the entry's window to one sample
(`CostModel.restart`) so that its steady steps, not the burst's, set the median.

Torch-free, as the controller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from treeverify.engine.budget_events import PLAIN_TRIAL

if TYPE_CHECKING:
    from treeverify.engine.budget_controller import BudgetController

# A plain trial's steps: on a GPU the first takes the round launched ahead and the second is
# read first, so four steady steps measure plain decoding (a majority of a cost window of 9
# holding one calibrated sample).
PLAIN_TRIAL_STEPS = 6
PLAIN_TRIAL_PATIENCE = 4  # trial checks in a row (every 4th decision) the case must hold
PLAIN_TRIAL_CONFIRMED = 0.15  # a trial within this fraction of the estimate confirmed it ...
PLAIN_TRIAL_MAX_GAP = 16  # ... and doubles the gap to the next, up to this x cost_fresh_steps


@dataclass
class _Trial:
    """A plain trial under way: plain steps left, the batch size and plain's estimate it
    started from, and the decision state it resumes (the trial only measures)."""

    left: int
    n: int
    before: float
    since_switch: int
    pending: tuple[int, int] | None
    started: int  # the decision it started at (a cost seen after it was measured by it)


class PlainTrials:
    """The trial under way (if any), the gap to the next per batch size, and the patience."""

    def __init__(self) -> None:
        self.trial: _Trial | None = None
        self.gap: dict[int, float] = {}  # per batch size: decisions between trials
        self.gate = 0  # trial checks in a row that a trial's case held
        self.last_started: int | None = None  # the decision the engine's last trial started at
        self.last_n = 0  # ... and its batch size

    @property
    def running(self) -> bool:
        return self.trial is not None

    def gaps(self) -> dict[str, int]:
        """Per batch size the decisions between trials (/server_info)."""
        return {str(n): int(g) for n, g in sorted(self.gap.items())}

    def maybe_start(self, c: BudgetController, n: int, bar: float) -> None:
        """A trial check at batch size n (`bar`: the rounds' rate with the switch margin): start
        a trial when plain decoding's stale cost at `stale_plain_floor` of itself (or at the
        lowest median it has held, if lower: a burst's overstatement) has beaten
        `bar` on PLAIN_TRIAL_PATIENCE checks in a row (a dip in acceptance passes: the replay's
        predictable rows kept their rates), the gap since the last trial is over, and the cost
        model is not frozen (a given cost table, tests and replays, is never re-measured)."""
        now, fresh = c.step_index, c.cfg.cost_fresh_steps
        if not c.current or c.cost.frozen:
            return
        # a burst's overstatement (BURST_FACTOR x the lowest median held) is tried at once: its
        # samples are fresh, a trial that still finds it overstated is retried after
        # engine/cost_bursts.py's gap (32, doubling), and there is no dip of acceptance to wait
        # out (the patience)
        over = c.cost.overstated(n, 0)
        c._bursts.calm(c.cost, n, (0,))
        if c.cost.is_fresh(n, 0, now, fresh) and not over:
            return
        gap = c._bursts.gap(n, 0) if over else self.gap.get(n, float(fresh))
        last = c._tried.get((n, 0), -gap - 1)
        own = (n, 0) in c.cost.table  # a cost measured at n (maybe stale), not derived
        if not (own or c.cfg.plain_trials_per_batch) and self.last_started is not None:
            # an estimate derived from other sizes' costs: the engine's last trial answers,
            # for as long as that trial's own size waits for its next
            gap = max(gap, self.gap.get(self.last_n, float(fresh)))
            last = max(last, self.last_started)
        if now - last <= gap:
            return
        est = c.cost.estimate(n, 0)
        low = est and min(c.cfg.stale_plain_floor * est, c.cost.best.get((n, 0), est))
        if not (low and n / low > bar):
            self.gate = 0
            return
        self.gate += 1
        if over or self.gate >= PLAIN_TRIAL_PATIENCE:
            self.gate = 0
            c._tried[(n, 0)] = now
            self.last_started, self.last_n = now, n
            c._bursts.tried(c.cost, n, 0, fresh)
            self.trial = _Trial(PLAIN_TRIAL_STEPS, n, est, c.since_switch, c._pending, now)
            c.events.add(now, PLAIN_TRIAL, c.current, 0, n,
                         f"plain at cost >= {low:.3g} s beats the rounds' {bar:.4g}")  # fmt: skip
            c.cost.restart(n, 0)
            c.cost_trials += 1

    def step(self, c: BudgetController) -> bool:
        """One decision during a trial: True, run it plainly. At the trial's end (False) the
        decision state is as the trial found it (the current bucket never changed; its dwell
        and a pending switch resume), and the gap to the next trial doubles when the fresh cost
        confirmed the estimate. A trial that moved the controller (a dwell back at the bucket,
        a confirmed switch lost) cost one replayed prose row 5% at accurate costs."""
        t = self.trial
        if t is None:
            return False
        if t.left > 0:
            t.left -= 1
            return True
        self.trial = None
        fresh = float(c.cfg.cost_fresh_steps)
        gap = self.gap.get(t.n, fresh)
        if c.cost.seen_at.get((t.n, 0), -1) > t.started:  # measured (not: prefills came, the
            # batch size changed, no step was steady): judged; else the gap stays
            after = c.cost.estimate(t.n, 0) or t.before
            close = abs(after - t.before) <= PLAIN_TRIAL_CONFIRMED * t.before
            confirmed = close and not c.cost.overstated(t.n, 0)  # (a burst still on: not judged)
            self.gap[t.n] = min(2 * gap, PLAIN_TRIAL_MAX_GAP * fresh) if confirmed else fresh
        c.since_switch, c._pending = t.since_switch, t.pending
        return False
