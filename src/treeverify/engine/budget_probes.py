"""Exploration for the adaptive controller (engine/budget_controller.py, "Exploration"): which
bucket a probe runs at, when one is due, and how the interval between probes backs off. A
helper of the controller, as plain_trials.py and cost_bursts.py are; its methods read the
controller's config, buckets, costs and switch count. Torch-free.

The interval is `explore_every` decisions times cost(probe) / cost(current), doubled after each
probe that changed nothing, up to `explore_max` (times `explore_far_factor` at plain decoding
while no bucket's rate comes within `arrival_probe_factor` of plain decoding's), and back to
`explore_every` when a request without rounds of its own joins and its class's prior says a
bucket may pay (`near_plain`). `soon` (`plain_probe_after`): after a switch to plain decoding,
one probe due within a few decisions whatever the interval.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from treeverify.engine.budget_controller import BudgetController


class Probes:
    def __init__(self, explore_every: int) -> None:
        self.since = 0  # decisions since the last probe
        self.interval = float(explore_every)  # decisions between probes, before the cost ratio
        self.count = 0  # probes made (/server_info's `explorations`)
        self.from_plain = 0  # probes made from plain decoding (hybrid alternates their target)
        # `plain_probe_after`: the `since` at which a probe is due whatever the interval (a
        # switch to plain decoding the requests' own rounds made), until the next probe or a
        # move back to a round budget
        self.soon: int | None = None
        self._switches_at_probe = 0

    def restart(self, c: BudgetController) -> bool:
        """Back to the shortest interval (a request that may be predictable joined); whether
        it was longer."""
        longer = self.interval > c.cfg.explore_every
        self.interval = float(c.cfg.explore_every)
        return longer

    def not_a_change(self) -> None:
        """A switch just made is not one a probe's measurement caused (a new group moved on
        its class's prior): the next probe does not start the interval over for it."""
        self._switches_at_probe += 1

    @staticmethod
    def near_plain(c: BudgetController, rates: dict[int, float | None],
                   sampled: bool = False) -> bool:  # fmt: skip
        """Whether some bucket's rate comes within `arrival_probe_factor` of plain decoding's,
        or is unknown (always, at factor 0): requests without rounds of their own restart the
        interval only then (their rates are their class's prior), and far from it, at plain
        decoding, the interval backs off further. `sampled` (every request of the step samples):
        within `sampled_arrival_factor` instead, when set."""
        factor = c.cfg.arrival_probe_factor
        if sampled and c.cfg.sampled_arrival_factor:
            factor = c.cfg.sampled_arrival_factor
        plain = rates.get(0)
        if not factor or plain is None:
            return True
        rounds = [r for b, r in rates.items() if b]
        return any(r is None for r in rounds) or max(rounds) >= factor * plain

    def target(self, c: BudgetController, rates: dict[int, float | None]) -> int | None:
        """The bucket a probe would run at (None at the largest bucket: nothing above it).
        "hybrid" from plain decoding: in turns, the speculating bucket of best estimated rate
        (what a switch would go to; the same round measures every bucket below it, at less
        than the top's cost) and the largest (the gains only a large tree sees); elsewhere one
        bucket up. CPU suite against the largest every time: unpredictable text 0.959 ->
        0.963x plain, code after it 1.27x -> 1.44x, predictable rows unchanged (docs/ddtree.md).
        "top": always the largest; "up": always one up."""
        buckets = c.buckets
        i = buckets.index(c.current)
        if i + 1 >= len(buckets):
            return None
        if c.cfg.probe == "top":
            return buckets[-1]
        if c.cfg.probe == "hybrid" and c.current == 0:
            known = {b: r for b, r in rates.items() if b and r is not None}
            if self.from_plain % 2 or not known:
                return buckets[-1]
            return max(known, key=lambda b: (known[b], -b))
        return buckets[i + 1]

    def due(self, c: BudgetController, n: int, up: int, far: bool = False) -> bool:
        """Whether a probe at `up` is due for n requests: the interval times the probe's cost
        against a step here, at most `cap(far)` decisions. The cost is the steady table's; a
        probe from plain decoding really costs more (engine/budget_excursions.py), and from
        `excursion_min_batch` requests up (2 by default) the measured excursion's extra is
        added to it (spacing b=1 by it too lost predictable text in the replay: docs/ddtree.md)."""
        return self.since >= self._threshold(c, n, up, far)

    def quiet(self, c: BudgetController, n: int, up: int, far: bool = False) -> int:
        """How many decisions after this one cannot find a probe at `up` due, at today's costs
        (each adds one to `since` before `due` is asked): the controller's quiet stretch at plain
        decoding (`plain_quiet`) ends before it."""
        return max(0, math.ceil(self._threshold(c, n, up, far) - self.since) - 1)

    def _threshold(self, c: BudgetController, n: int, up: int, far: bool) -> float:
        """The decisions since the last probe at which one at `up` is due."""
        here, there = c.cost.estimate(n, c.current), c.cost.estimate(n, up)
        if there and c.current == 0 and Probes.excursion_priced(c, n):
            there += c.excursions.extra(n) or 0.0
        ratio = max(1.0, there / here) if here and there else 1.0
        due = min(self.cap(c, far), self.interval * ratio)
        return due if self.soon is None else min(due, self.soon)

    @staticmethod
    def excursion_priced(c: BudgetController, n: int) -> bool:
        """Whether a probe from plain decoding with n requests is spaced by its excursion's
        measured price (`excursion_min_batch` requests or more), not the steady table's."""
        gate = c.cfg.excursion_min_batch
        return bool(gate) and n >= gate

    @staticmethod
    def cap(c: BudgetController, far: bool) -> float:
        """The most decisions between probes: `explore_max`, times `explore_far_factor` when
        `far` (every bucket's rate far below plain decoding's, as on sampled text no drafter
        predicts)."""
        return c.cfg.explore_max * (c.cfg.explore_far_factor if far else 1.0)

    def probed(self, c: BudgetController, far: bool) -> str:
        """A probe runs: the interval doubles while probes change nothing (up to `cap(far)`),
        else starts over. Returns what it did, for the decision log."""
        waited = self.since
        if self.count and c.switches == self._switches_at_probe:  # changed nothing
            self.interval = min(2 * self.interval, self.cap(c, far))
            why = "doubled"
        else:
            self.interval = float(c.cfg.explore_every)
            since_last = c.switches - self._switches_at_probe
            why = f"restarted ({since_last} switches since the last)" if self.count else "first"
        self._switches_at_probe = c.switches
        self.since, self.soon = 0, None
        self.count += 1
        self.from_plain += c.current == 0
        return f"after {waited} decisions; interval {why} -> {self.interval:g}" + (
            " (far)" if far else ""
        )
