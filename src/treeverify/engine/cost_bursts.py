"""Bursts of slow host steps in the adaptive controller's step costs (engine/budget_controller.py;
docs/ddtree.md, "Bursts of slow host steps"): a helper of the controller, as plain_trials.py is.

A burst (on an H100 host, 10-30 steps in a row at 1-2.5 ms where a plain step takes 0.18, in
the plain engine too) fills the cost window of the budget running then. An entry whose median
is BURST_FACTOR x its lowest (`CostModel.overstated`) is re-measured though its samples are
fresh: `BurstGaps` spaces those trials (BURST_RETRY decisions, doubling while they still find
it overstated: a rise that lasts, a long context's plain step, is re-measured ever less often,
at most once a freshness window); `BurstHold` keeps the controller at plain decoding for
BURST_RETRY decisions while plain decoding's own cost is overstated (a burst raises the cost of
what runs, not of the rounds it is compared with). Torch-free.
"""

from __future__ import annotations

from treeverify.engine.budget_costs import CostModel

BURST_RETRY = 32  # decisions: the first gap between trials of an overstated cost, and the hold


class BurstGaps:
    """One step path's gaps between trials of an overstated cost, by (batch size, budget)."""

    def __init__(self) -> None:
        self.gaps: dict[tuple[int, int], int] = {}

    def gap(self, n: int, budget: int) -> int:
        """Decisions a trial of this overstated cost waits after the last one."""
        return self.gaps.get((n, budget), BURST_RETRY)

    def tried(self, cost: CostModel, n: int, budget: int, most: int) -> None:
        """A trial started: if the cost is overstated, the first sets BURST_RETRY and a repeat
        (the last trial left it overstated: its gap was not forgotten) doubles it, up to
        `most` (the freshness window)."""
        if cost.overstated(n, budget):
            gap = self.gaps.get((n, budget))
            self.gaps[(n, budget)] = BURST_RETRY if gap is None else min(2 * gap, most)

    def calm(self, cost: CostModel, n: int, budgets) -> None:
        """At a trial check: each of `budgets` no longer overstated forgets its gap."""
        for b in budgets:
            if (n, b) in self.gaps and not cost.overstated(n, b):
                del self.gaps[(n, b)]


class BurstHold:
    """Plain decoding held through a burst of its own cost: `held` is True for BURST_RETRY
    decisions after plain decoding's cost became overstated (then no switch, and no cost
    trial to a bucket a burst overstated); `holds` counts the decisions held (/server_info,
    /metrics). The replay (`scripts/sim_bursts.py`): text no drafter predicts 0.68-0.80x plain
    through bursts without the hold, 0.91x with it. Only at plain decoding: held in the rounds
    too, the replay's predictable rows lost up to 8%."""

    def __init__(self) -> None:
        self.since: int | None = None  # the decision plain decoding's cost became overstated
        self.holds = 0

    def held(self, cost: CostModel, current: int, n: int, step: int) -> bool:
        if current != 0 or not cost.overstated(n, 0):
            self.since = None
            return False
        if self.since is None:
            self.since = step
        if step - self.since < BURST_RETRY:
            self.holds += 1
            return True
        return False
