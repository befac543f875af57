"""Acceptance trials (engine/budget_trials.py, accept_trial): while the controller stays below a
bucket, only the rare probes at the top measure that bucket's gain, so one unlucky probe can
hold the estimate near zero for a whole generation (replayed on tiny-code's recorded traces:
8 where a fixed 16 is 10% faster). A request whose bucket above lacks its own evidence gets one
dwell there, whose rounds measure the gain; the usual rule decides after. Synthetic acceptance
(tests/test_budget_controller.py's path_for), given costs."""

from __future__ import annotations

import pytest

from test_budget_controller import feed, path_for
from treeverify.engine.budget_controller import BudgetController, ControllerConfig
from treeverify.engine.budget_costs import CostModel

COSTS = {0: 1.0, 4: 1.05, 8: 1.1, 16: 1.18, 64: 1.4}
TRUE = {4: 2, 8: 4, 16: 7, 64: 8}  # a budget-16 tree accepts 3 more than a budget-8 one
UNLUCKY = {4: 2, 8: 4, 16: 4, 64: 4}  # what the one probe at 64 happened to see: no gain at 16


def controller(**cfg) -> BudgetController:
    base = {"min_dwell": 4, "explore_every": 1000, "explore_max": 1000}  # no probe but the first
    return BudgetController(tuple(COSTS), CostModel.given(COSTS), ControllerConfig(**base | cfg))


def run(ctl: BudgetController, rid: str, steps: int, first: dict[int, int] = UNLUCKY) -> list[int]:
    """The first round (a probe at the top) accepts `first`; every later one TRUE."""
    chosen = []
    for i in range(steps):
        b = ctl.choose([rid])
        chosen.append(b)
        if b:
            ctl.observe_round(rid, b, path_for(first if i == 0 else TRUE, b))
    return chosen


@pytest.mark.parametrize("trials", [True, False])
def test_an_unlucky_probe_no_longer_holds_the_budget_below_the_best(trials):
    ctl = controller(accept_trials=trials)
    chosen = run(ctl, "r", 60)
    assert chosen[0] == 64 and chosen[1] == 8  # the probe's curve says 8 (16 adds nothing)
    if trials:  # after the dwell at 8, a trial at 16, whose rounds show 16's gain: it stays
        assert ctl.accept_trials == 1 and ctl.current == 16
        assert chosen[-20:] == [16] * 20
        assert ctl.accept_estimate("r", 16) > ctl.accept_estimate("r", 8) + 2
    else:  # nothing ever measures 16 again
        assert ctl.accept_trials == 0 and ctl.current == 8 and chosen[-20:] == [8] * 20
        assert ctl.accept_estimate("r", 16) == ctl.accept_estimate("r", 8)


def test_a_trial_that_loses_returns_and_is_not_repeated_for_that_request():
    """16 really adds nothing: the trial's dwell shows it, the rule goes back to 8, and the
    same request gets no second trial at 16 (a new request does get its own)."""
    ctl = controller()
    chosen = feed(ctl, "r", UNLUCKY, 80)
    assert ctl.accept_trials == 1 and ctl.current == 8
    assert chosen.count(16) <= 12 and chosen[-30:] == [8] * 30
    feed(ctl, "s", UNLUCKY, 10)
    assert ctl.accept_trials == 2


def test_no_trial_where_the_current_bucket_gains_little():
    """Nearly unpredictable text: one draft accepted in eight rounds, so the controller sits at
    the smallest bucket (just above plain) and even an optimistic next bucket cannot beat it by
    the margin: no trial."""
    lucky, flat = {4: 1, 8: 1, 16: 1, 64: 1}, {4: 0, 8: 0, 16: 0, 64: 0}
    ctl = controller()
    for i in range(80):
        b = ctl.choose(["r"])
        if b:
            ctl.observe_round("r", b, path_for(lucky if i % 8 == 0 else flat, b))
    assert ctl.accept_trials == 0 and ctl.current in (0, 4)
    assert ctl.info()["accept_trials"] == 0


def test_no_trial_from_plain_decoding_nor_for_a_bucket_with_evidence():
    ctl = controller()
    feed(ctl, "r", {4: 0, 8: 0, 16: 0, 64: 0}, 30)
    assert ctl.current == 0 and ctl.accept_trials == 0  # plain steps measure nothing
    ctl = controller()
    run(ctl, "r", 40, first=TRUE)  # the probe saw 16's gain: 16 from the start, no trial
    assert ctl.current == 16 and ctl.accept_trials == 0


def test_bad_trial_settings_are_value_errors():
    with pytest.raises(ValueError, match="accept_evidence"):
        ControllerConfig(accept_evidence=-1)
    with pytest.raises(ValueError, match="accept_optimism"):
        ControllerConfig(accept_optimism=-0.1)


def test_a_trial_within_the_margin_goes_back_after_its_dwell():
    """A bucket up that costs little more and adds nothing: by hysteresis alone the trial would
    stay (the bucket it left is not 5% better), so the trial is judged as a switch up: it must
    beat the bucket it left by the margin, or the controller goes back (replayed at b=8: a trial
    at 32 costing 2% more than 16)."""
    costs = {0: 1.0, 4: 1.01, 8: 1.02, 16: 1.03, 32: 1.06, 64: 1.5}
    flat_above_16 = {4: 2, 8: 4, 16: 6, 32: 6, 64: 6}
    cfg = ControllerConfig(min_dwell=4, explore_every=1000, explore_max=1000)
    ctl = BudgetController(tuple(costs), CostModel.given(costs), cfg)
    chosen = feed(ctl, "r", flat_above_16, 40)
    assert ctl.accept_trials == 1 and 32 in chosen
    assert ctl.current == 16 and chosen[-15:] == [16] * 15


def test_a_new_groups_switch_ends_the_acceptance_trial_of_the_group_before():
    """A switch made at once for a new group (`new_batch_at_once`) can fall inside an acceptance
    trial's dwell (no other switch can). The trial is over then: judged after the new group's
    dwell it moved the controller back to the bucket the old request's trial left, with no
    margin nor confirmation (a helper's review: [4, 4, 4, 4, 8, 8, ...], 8 kept)."""
    ctl = controller()
    i = 0
    while ctl.accept_trials == 0:  # a greedy request's trial, 8 -> 16
        b = ctl.choose(["r"])
        if b:
            ctl.observe_round("r", b, path_for(UNLUCKY if i == 0 else TRUE, b))
        i += 1
    assert ctl._trial_from == 8 and ctl.current == 16
    ctl.forget("r")
    lucky = {4: 1, 8: 1, 16: 1, 64: 1}  # the sampled class: one draft a round, whatever the tree
    ctl.note_request("old", "sampled")
    for _ in range(3):
        ctl.observe_round("old", 64, path_for(lucky, 64))
    ctl.forget("old")
    ctl.note_request("s", "sampled")
    chosen = []
    for _ in range(12):
        b = ctl.choose(["s"])
        chosen.append(b)
        if b:
            ctl.observe_round("s", b, path_for(lucky, b))
    assert chosen[:7] == [4] * 7, chosen  # at once to 4, its rate's best; no judgement back
    assert ctl.current == 4, chosen  # (its own trial at 8 after the dwell returns to 4)
