"""A class's acceptance by request age (`ControllerConfig.age_prior_tokens`,
engine/age_prior.py): the bins, the prior a request shrinks toward, and the controller leaving
plain decoding when its requests reach an age whose rounds paid, with no probe to show it."""

from __future__ import annotations

import pytest

from treeverify.engine.acceptance_curves import DecayedMean
from treeverify.engine.age_prior import AGE_MIN_ROUNDS, AgePrior
from treeverify.engine.budget_controller import BudgetController, ControllerConfig
from treeverify.engine.budget_costs import CostModel


def test_bins_double_from_the_first_width_and_crossing_is_reported():
    age = AgePrior(32)
    assert [age.bin(a) for a in (0, 31, 32, 63, 64, 127, 128, 10_000)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert not age.grow("r", 31)  # 31: still the first bin
    assert age.grow("r", 1)  # 32: the second
    assert not age.grow("r", 31)
    assert age.grow("r", 100)  # 163: the last
    age.forget("r")
    assert age.ages == {}


def test_ages_of_requests_never_forgotten_stay_bounded():
    """A caller that never forgets its requests (the engine forgets every finished one) keeps
    the newest `keep` ages, not every id it ever passed (a review's repro: 20000 ids)."""
    age = AgePrior(32)
    for i in range(age.keep + 50):
        age.grow(f"r{i}", 1)
    assert len(age.ages) == age.keep
    assert "r0" not in age.ages and age.ages[f"r{age.keep + 49}"] == 1


def test_prior_takes_the_age_bins_mean_where_it_holds_enough_rounds_and_exceeds_the_flat():
    age = AgePrior(8)
    flat = {4: DecayedMean(), 8: DecayedMean()}
    for m, v in zip(flat.values(), (0.5, 0.25), strict=True):
        m.num, m.den = v * 10, 10.0
    assert age.prior("greedy", "r", flat) is flat  # no bin measured yet
    young = age.curve("greedy", "r")
    young[4] = DecayedMean()
    young[4].num, young[4].den = 0.9 * (AGE_MIN_ROUNDS - 1), AGE_MIN_ROUNDS - 1
    assert age.prior("greedy", "r", flat)[4] is flat[4]  # too few rounds in the bin
    young[4].num, young[4].den = 0.9 * AGE_MIN_ROUNDS, AGE_MIN_ROUNDS
    prior = age.prior("greedy", "r", flat)
    assert prior[4] is young[4] and prior[8] is flat[8]  # per bucket: 8 stays known
    young[4].num = 0.1 * AGE_MIN_ROUNDS  # below the flat curve: not taken
    assert age.prior("greedy", "r", flat)[4] is flat[4]
    age.grow("r", 8)  # an older bin, unmeasured: the flat curve again
    assert age.prior("greedy", "r", flat) is flat


def test_config_rejects_a_negative_width():
    with pytest.raises(ValueError, match="age_prior_tokens"):
        ControllerConfig(age_prior_tokens=-1)
    with pytest.raises(ValueError, match="age_prior_tokens"):
        ControllerConfig().with_settings(["age_prior_tokens=x"])


BUCKETS = (0, 4, 8, 16)
COSTS = {0: 1.0, 4: 1.5, 8: 1.6, 16: 1.8}  # seconds a step at n = 1
YOUNG = 16  # tokens: rounds accept nothing before, five drafts of a budget-16 tree after
MATURE = [0, 1, 5, 9, 12, 15]  # the accepted nodes of a matured request's round: 1 / 2 / 5
# drafts within budgets 4 / 8 / 16 (rates 1.33 / 1.88 / 3.33 against plain decoding's 1)


def accepted(made: int, budget: int) -> list[int]:
    """The accepted path of a round at `budget` of a request that has generated `made` tokens."""
    return [0] if made < YOUNG else [n for n in MATURE if n <= budget]


def controller(age_tokens: int) -> BudgetController:
    """No probes, no trials: only the rates move the budget."""
    cfg = ControllerConfig(explore_every=10_000, explore_max=10_000, cost_trials=False,
                           accept_trials=False, age_prior_tokens=age_tokens)  # fmt: skip
    ctl = BudgetController(BUCKETS, CostModel(window=9), cfg)
    for b, sec in COSTS.items():
        ctl.observe_step(1, b, sec)
    return ctl


def history(ctl: BudgetController) -> None:
    """Requests that accepted nothing for their first YOUNG tokens and five drafts a round after
    (as tiny-code's code traces climb with age), then a group of young ones last (64 rounds):
    the engine-wide curve, a decayed mean of the newest rounds, is the young group's."""
    for i in range(4):
        rid, made = f"old{i}", 0
        ctl.note_request(rid, "greedy")
        while made < 96:
            path = accepted(made, 16)
            ctl.observe_round(rid, 16, path)
            made += len(path)
        ctl.forget(rid)
    for i in range(8):
        ctl.note_request(f"young{i}", "greedy")
        for _ in range(8):
            ctl.observe_round(f"young{i}", 16, [0])
        ctl.forget(f"young{i}")


@pytest.mark.parametrize("age_tokens", [0, 8])
def test_plain_decoding_ends_when_the_requests_reach_an_age_whose_rounds_paid(age_tokens):
    """A new request after the history: its first rounds accept nothing, the controller moves to
    plain decoding. With the age prior, once it has generated YOUNG tokens at plain decoding its
    prior is the older requests' (1 + 5 tokens a round at 1.8 against 1 at 1.0) and the
    controller returns to the rounds; with one flat curve (the young group's) it stays at plain
    decoding until a probe, and here none comes."""
    ctl = controller(age_tokens)
    history(ctl)
    ctl.note_request("new", "greedy")
    chosen, made = [], 0
    for _ in range(200):
        b = ctl.choose(["new"])
        chosen.append(b)
        if not b:
            made += 1
            continue
        path = accepted(made, b)
        ctl.observe_round("new", b, path)
        made += len(path)
    first_plain = chosen.index(0)
    back = [i for i, b in enumerate(chosen) if i > first_plain and b]
    if age_tokens:
        assert back, "the matured request should have gone back to the rounds"
        assert chosen[-1] == 16
        info = ctl.info()["accept_gains_by_age"]["greedy"]
        assert info["16"]["4"] > 0.9 and info["0"]["4"] < 0.1  # the old bins paid, the young not
    else:
        assert not back and chosen[-1] == 0
        assert ctl.info()["accept_gains_by_age"] == {}
