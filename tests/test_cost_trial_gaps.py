"""Cost trials that keep confirming the table wait longer (`ControllerConfig.cost_trial_backoff`,
engine/cost_trial_gaps.py): the waits double while trials confirm an entry's own median, start
over when one moves it, stay when one measured nothing; a bucket waiting for its next trial
still bounds the buckets beyond it. Synthetic acceptance, costs fed back as the engine does
(tests/test_budget_costs.py's `calibrated` and `serve`)."""

from __future__ import annotations

import itertools

import pytest

from test_budget_costs import CALIBRATED, calibrated, serve
from treeverify.engine.budget_controller import BudgetController, ControllerConfig
from treeverify.engine.budget_costs import CostModel


def trial_starts(ctl: BudgetController) -> list[int]:
    """The decisions cost trials started at (the decision log)."""
    return [e["step"] for e in ctl.events.since(0) if e["kind"] == "cost_trial"]


def test_trials_that_confirm_an_accurate_cost_come_ever_less_often():
    """`cost_trial_backoff`: each trial of 16 finds the cost the table held (1.9), so the wait
    before the next doubles (~200, 400, 800 decisions with a window of 100), where without it a
    trial came every ~100 decisions for as long as 16 looked near 8's rate. The budget served is
    the same either way."""
    steps = 1600
    plain = calibrated(min_dwell=4, cost_fresh_steps=100)
    chosen_plain = serve(plain, CALIBRATED, steps)
    ctl = calibrated(min_dwell=4, cost_fresh_steps=100, cost_trial_backoff=True)
    chosen = serve(ctl, CALIBRATED, steps)
    assert plain.current == ctl.current == 8
    assert plain.cost_trials >= 10  # ~ one per window
    starts = trial_starts(ctl)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert len(starts) == ctl.cost_trials <= 5
    assert all(g2 >= 1.9 * g1 for g1, g2 in itertools.pairwise(gaps))  # doubling
    assert chosen.count(16) < chosen_plain.count(16) / 2
    assert ctl.info()["cost_trial_waits"]["1:16"] >= 4


def test_a_bucket_waiting_out_its_backoff_still_bounds_the_ones_beyond():
    """Six buckets, served at 16; 32 looks near 16's rate, 64 does not at 32's true cost. Each
    trial of 32 confirms it, so 32 waits longer and longer; meanwhile its own median must still
    bound 64 (a larger tree is never cheaper), or 64, judged at 16's cost, is tried in 32's place
    (a review found trials alternating 32, 64, 32, 64: more steps at 64 with the knob than
    without)."""
    buckets = (0, 4, 8, 16, 32, 64)
    table = {0: 1.0, 4: 1.2, 8: 1.3, 16: 1.5, 32: 2.3, 64: 3.0}
    # R(16) = 4/1.5; 32 at 16's cost 5/1.5 looks 25% better, at its own 5/2.3 0.82x; 64 at
    # 32's cost 6/2.3 does not beat 16 by the margin, at 16's cost 6/1.5 it would
    accepted = {4: 1, 8: 2, 16: 3, 32: 4, 64: 5}

    def run(**cfg) -> tuple[BudgetController, list[int]]:
        cfg = {"explore_every": 1000, "explore_max": 1000, "min_dwell": 4,
               "cost_fresh_steps": 100, **cfg}  # fmt: skip
        ctl = BudgetController(buckets, CostModel(window=9), ControllerConfig(**cfg))
        for b, sec in table.items():
            ctl.observe_step(1, b, sec)
        ctl.reset()
        return ctl, serve(ctl, table, 1600, accepted)

    plain, chosen_plain = run()
    ctl, chosen = run(cost_trial_backoff=True)
    tried = [e["to"] for e in ctl.events.since(0) if e["kind"] == "cost_trial"]
    assert tried and set(tried) == {32}, tried
    assert chosen.count(64) <= chosen_plain.count(64)
    assert chosen.count(32) < chosen_plain.count(32)
    assert ctl.current == plain.current == 16


def test_a_trial_that_measured_nothing_keeps_the_wait():
    """A trial whose entry no step measured since it started (its dwell ran at another batch
    size, or on the other step path) confirmed nothing: the next waits as the last did, neither
    doubled nor back to 1."""
    from treeverify.engine.cost_trial_gaps import CostTrialGaps

    cost, gaps = CostModel(window=9), CostTrialGaps()
    cost.observe(2, 16, 1.0, at=10)
    gaps.tried(cost, 2, 16, 20)
    cost.observe(2, 16, 1.0, at=25)  # measured by the trial, the same cost: confirmed
    assert gaps.factor(cost, 2, 16) == 2
    gaps.tried(cost, 2, 16, 300)  # the next trial: its dwell never measured (2, 16)
    assert gaps.factor(cost, 2, 16) == 2  # kept, not 4
    cost.observe(2, 16, 1.0, at=700)
    assert gaps.factor(cost, 2, 16) == 4


def test_a_trial_that_finds_the_cost_moved_starts_the_gaps_over():
    """Confirmed trials back off; one that finds the cost moved (a cheaper 16 after the device
    sped up: 1.9 -> 1.32, so 16 now wins) is judged at the next trial's check: the gaps start
    over from `cost_fresh_steps` and the controller serves 16 once measured."""
    ctl = calibrated(min_dwell=4, cost_fresh_steps=100, cost_trial_backoff=True)
    serve(ctl, CALIBRATED, 800)
    waits = ctl._trial_gaps.factor(ctl.cost, 1, 16)
    assert waits >= 4 and ctl.current == 8
    fast = {**CALIBRATED, 16: 1.32}
    chosen = serve(ctl, fast, 100 * (waits + 2))
    assert ctl.current == 16 and chosen[-100:].count(16) >= 90
    assert ctl.cost.estimate(1, 16) == pytest.approx(1.32)
    assert ctl._trial_gaps.factor(ctl.cost, 1, 16) == 1  # moved by more than 15%: over


def test_cost_trial_waits_compare_own_medians_only():
    """An entry with no median of its own (interpolated between measured sizes, or borrowed)
    never counts as confirmed; the factor doubles at most to PLAIN_TRIAL_MAX_GAP."""
    from treeverify.engine.cost_trial_gaps import CostTrialGaps
    from treeverify.engine.plain_trials import PLAIN_TRIAL_MAX_GAP

    cost, gaps = CostModel(window=9), CostTrialGaps()
    cost.observe(1, 16, 1.0, at=1)
    cost.observe(4, 16, 2.0, at=1)
    assert cost.estimate(2, 16) is not None and cost.median(2, 16) is None  # interpolated
    gaps.tried(cost, 2, 16, 5)  # nothing of its own at (2, 16)
    cost.observe(2, 16, 1.3, at=6)
    assert gaps.factor(cost, 2, 16) == 1
    for step in range(10, 100, 10):
        gaps.tried(cost, 2, 16, step)  # each trial finds the same median
        cost.observe(2, 16, 1.3, at=step + 1)
    assert gaps.factor(cost, 2, 16) == PLAIN_TRIAL_MAX_GAP
    cost.observe(2, 16, 1.5, at=200)  # median of (1.3 x 10, 1.5): still 1.3, confirmed
    assert gaps.factor(cost, 2, 16) == PLAIN_TRIAL_MAX_GAP
    for _ in range(9):
        cost.observe(2, 16, 2.6, at=300)  # the window's median 2.6: moved
    assert gaps.factor(cost, 2, 16) == 1
