"""Gaps between cost trials of one (batch size, budget) that keep confirming its cost (a helper
of engine/budget_controller.py, `ControllerConfig.cost_trial_backoff`).

A cost trial moves the controller to a bucket whose stale cost hides a better rate, for a dwell
that re-measures it (docs/ddtree.md, "Stale costs"). An entry goes stale `cost_fresh_steps`
(256) decisions after it was last measured, so on a device whose costs do not move, the same
trial comes back every ~256 decisions for as long as acceptance keeps the bucket near the
current rate, each one a dwell of 8 steps at a larger tree: on the H100 at b=8 on code (fifty-
fifth session's decision log) 31 trials in nine 512-decision passes, 8-25 of a pass's ~143 steps
at budget 64, and the adaptive engine at 0.911 of fixed 16's tokens/s.

Plain trials already space themselves this way (engine/plain_trials.py): a trial that found the
cost within PLAIN_TRIAL_CONFIRMED of what the table held confirmed it, and the gap to the next
doubles, up to PLAIN_TRIAL_MAX_GAP x `cost_fresh_steps`; one that moved it starts the gaps over.
Cost trials take the same tolerance and cap, judged differently: lazily, when the next trial of
the entry is considered, the entry's own median (not an interpolated or borrowed estimate)
against the one the trial started from; a trial whose entry no step measured since it started
keeps the last wait (neither doubled nor reset). While a bucket above the current one waits for
its next trial, its own median still bounds the buckets beyond it in the controller's search
(else a farther, dearer bucket is tried in its place).
Torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from treeverify.engine.plain_trials import PLAIN_TRIAL_CONFIRMED, PLAIN_TRIAL_MAX_GAP

if TYPE_CHECKING:
    from treeverify.engine.budget_controller import BudgetController
    from treeverify.engine.budget_costs import CostModel


class CostTrialGaps:
    """One step path's cost trials by (batch size, budget): the median each last trial started
    from and the gap factor it waited with."""

    def __init__(self) -> None:
        # (n, budget) -> (the median its last trial started from, the factor that trial waited
        # with, the decision it started at)
        self._last: dict[tuple[int, int], tuple[float | None, int, int]] = {}

    def factor(self, cost: CostModel, n: int, budget: int) -> int:
        """Times `cost_fresh_steps` the next trial of (n, budget) waits after the last one: 1
        after none, or after one whose entry's median now differs from the one it started from
        by more than PLAIN_TRIAL_CONFIRMED (or has none of its own to compare); the last
        trial's factor again when no step measured the entry since that trial started (the
        batch size or the step path changed in its dwell: nothing was judged); else twice the
        last trial's factor, at most PLAIN_TRIAL_MAX_GAP."""
        last = self._last.get((n, budget))
        if last is None:
            return 1
        before, waited, started = last
        if cost.seen_at.get((n, budget), -1) <= started:
            return waited
        now = cost.median(n, budget)
        if before is None or now is None or abs(now - before) > PLAIN_TRIAL_CONFIRMED * before:
            return 1
        return min(2 * waited, PLAIN_TRIAL_MAX_GAP)

    def tried(self, cost: CostModel, n: int, budget: int, step: int) -> None:
        """A trial of (n, budget) starts at decision `step` (before its entry's window is cut):
        keep the median it starts from, the factor it waited with, and `step`."""
        self._last[(n, budget)] = (cost.median(n, budget), self.factor(cost, n, budget), step)

    def wait(self, c: BudgetController, n: int, budget: int) -> int:
        """Times `cost_fresh_steps` a cost trial of (n, budget) waits after its last one: 1, or
        with `cost_trial_backoff` the entry's `factor`."""
        return self.factor(c.cost, n, budget) if c.cfg.cost_trial_backoff else 1

    def confirmed(self, c: BudgetController, n: int, side: tuple[int, ...],
                  over: dict[int, bool], waits: dict[int, int]) -> dict[int, float]:  # fmt: skip
        """With `cost_trial_backoff` (else none): the buckets of `side` whose stale costs wait
        for their next trial (tried within `waits`, not overstated by a burst: `over`), by their
        own medians; they bound the buckets beyond them in the controller's search."""
        if not c.cfg.cost_trial_backoff:
            return {}
        now, fresh = c.step_index, c.cfg.cost_fresh_steps
        out = {}
        for w in side:
            at = c._tried.get((n, w))
            median = c.cost.median(n, w)
            if (at is not None and not over[w] and median is not None
                    and not c.cost.is_fresh(n, w, now, fresh)
                    and now - at <= waits[w]):  # fmt: skip
                out[w] = median
        return out

    def factors(self) -> dict[str, int]:
        """By "n:budget": the factor each entry's last trial waited with (/server_info)."""
        return {f"{n}:{b}": f for (n, b), (_, f, _) in sorted(self._last.items())}
