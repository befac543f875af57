"""The adaptive controller's acceptance curves (engine/acceptance_curves.py, read by
engine/budget_controller.py) on synthetic rounds: each round's free curve, the decayed means, a
request's own curve shrunk toward its class's engine-wide one, the plain steps' fade, the kept
rate sums, the acceptance classes, the engine-wide curve's memory in steps."""

from __future__ import annotations

import random

import pytest

from test_budget_controller import feed, synthetic
from treeverify.engine.acceptance_curves import accepted_at_budgets
from treeverify.engine.budget_controller import BudgetController, CostModel


def test_free_curve_cuts_the_path_at_the_first_node_outside_the_smaller_tree():
    rng = random.Random()
    for _ in range(200):
        path = [0]
        for _ in range(rng.randint(0, 8)):
            path.append(path[-1] + rng.randint(1, 9))  # indices grow along a path
        buckets = (0, 4, 8, 16, 32, 64)
        got = accepted_at_budgets(path, buckets)
        for b in buckets:
            want = 0
            while want + 1 < len(path) and path[want + 1] <= b:
                want += 1
            assert got[b] == want
        assert all(got[a] <= got[b] for a, b in zip(buckets[:-1], buckets[1:], strict=True))


def test_requests_start_from_the_engine_wide_curve_and_move_to_their_own():
    ctl = synthetic({0: 1.0, 8: 1.0}, prior_rounds=2.0)
    for _ in range(20):
        ctl.observe_round("old", 8, [0, 1, 2, 3, 4])  # 4 accepted
    assert ctl.accept_estimate("new", 8) == pytest.approx(4.0)
    ctl.observe_round("new", 8, [0])  # the new request accepts nothing
    est = ctl.accept_estimate("new", 8)
    assert 0 < est < 4.0
    ctl.forget("new")
    assert ctl.accept_estimate("new", 8) == pytest.approx(ctl.global_estimate(8))


def test_a_stale_larger_bucket_follows_a_drop_below_it():
    ctl = synthetic({0: 1.0, 4: 1.0, 8: 1.0}, decay=0.5, prior_rounds=0.0)
    ctl.observe_round("r", 8, [0, 1, 2, 3, 6])  # A(4) 3, A(8) 4: the gain of 8 is 1
    for _ in range(10):
        ctl.observe_round("r", 4, [0])  # then at 4 only, nothing accepted
    assert ctl.accept_estimate("r", 4) < 0.01
    assert ctl.accept_estimate("r", 8) == pytest.approx(1.0 + ctl.accept_estimate("r", 4))


def test_decayed_mean_forgets_old_rounds():
    ctl = synthetic({0: 1.0, 4: 1.0}, decay=0.5, prior_rounds=0.0)
    for _ in range(10):
        ctl.observe_round("r", 4, [0, 1, 2, 3, 4])
    for _ in range(10):
        ctl.observe_round("r", 4, [0])
    assert ctl.accept_estimate("r", 4) < 0.01


def test_kept_rate_sums_follow_every_round_and_forget():
    """R(B)'s per-request sums are kept between steps (plain steps read them every step): a new
    round, a forgotten request and a new cost all show in the next rate; fresh random paths."""
    rng = random.Random()
    c = BudgetController((0, 4, 8), CostModel.given({0: 1.0, 4: 1.5, 8: 2.0}))
    ids = ["a", "b"]

    def fresh(budget: int) -> float:  # the same sum computed from scratch
        return sum(1.0 + c.accept_estimate(r, budget) for r in ids) / c.cost.estimate(2, budget)

    for rid in ids:
        c.observe_round(rid, 8, [0, 1, 5])
    for _ in range(20):
        before = c.rate(ids, 8)
        assert before == pytest.approx(fresh(8))
        path = [0]
        for _ in range(rng.randint(0, 3)):
            path.append(path[-1] + rng.randint(1, 3))
        c.observe_round(rng.choice(ids), 8, path)
        assert c.rate(ids, 8) == pytest.approx(fresh(8))
    c.forget("b")
    assert c.rate(ids, 8) == pytest.approx(fresh(8))
    c.cost.frozen = False
    c.cost.observe(2, 8, 10.0)  # a measured cost at this batch size replaces the borrowed one
    assert c.rate(ids, 8) == pytest.approx(fresh(8))


@pytest.mark.parametrize(("plain_decay", "comes_back"), [(0.9, True), (1.0, False)])
def test_plain_steps_fade_a_dip_toward_the_engine_wide_curve(plain_decay, comes_back):
    """A request whose rounds accepted nothing went plain; then the engine's other requests'
    rounds accept 6 drafts again; no probe comes (explore_every huge). With `plain_decay` the
    request's own estimate fades step by step toward the engine-wide one and it speculates
    again; without, it stays plain."""
    ctl = synthetic({0: 1.0, 16: 1.6}, plain_decay=plain_decay, prior_rounds=1.0, min_dwell=2,
                    explore_every=10_000, explore_max=10_000)  # fmt: skip
    for _ in range(60):  # the dip, long enough to weigh ~20 rounds (decay 0.95)
        ctl.observe_round("r", 16, [0])
    while ctl.choose(["r"]):
        pass  # to plain decoding (after the dwell and confirmation)
    for _ in range(40):
        ctl.observe_round("other", 16, [0, 1, 2, 3, 4, 5, 6])  # the engine's rounds recover
    chosen = [ctl.choose(["r"]) for _ in range(80)]
    assert chosen[0] == 0
    assert (chosen[-1] == 16) == comes_back


def test_sampled_requests_start_from_their_own_classs_curve():
    """Greedy requests accept deep trees, sampled ones almost nothing (T=1). With one
    engine-wide curve every sampled request that followed greedy ones started from the greedy
    prior and ran rounds until its own evidence outweighed it (after greedy passes on the same
    engine: budget 32 on 267 of 910 steps of sampled prose, 0.60x plain, H100). Per class, a
    sampled request starts from what sampled requests accepted, a greedy one from what greedy
    ones did: mixed traffic, greedy and sampled requests in turns."""
    costs = {0: 1.0, 4: 1.3, 8: 1.4, 16: 1.6}
    high, none = {4: 4, 8: 7, 16: 10}, {4: 0, 8: 0, 16: 0}

    def rounds_per_request(classes: bool) -> dict[str, list[int]]:
        ctl = synthetic(costs, min_dwell=4)
        out: dict[str, list[int]] = {"g": [], "s": []}
        for i in range(6):  # in turns: a greedy request, then a sampled one
            for kind, accepted in (("g", high), ("s", none)):
                rid = f"{kind}{i}"
                if classes:
                    ctl.note_request(rid, "sampled" if kind == "s" else "greedy")
                out[kind].append(sum(1 for b in feed(ctl, rid, accepted, 40) if b))
                ctl.forget(rid)
        return out

    one_curve, per_class = rounds_per_request(False), rounds_per_request(True)
    assert min(one_curve["s"]) >= 35  # each sampled request held in rounds by the greedy prior
    # per class: out of the rounds once the wide margin to leave them narrows (plain_margin;
    # the greedy request before left the controller at 16), ~14 rounds of 40
    assert max(per_class["s"][1:]) <= 16
    assert min(per_class["g"]) >= 38  # greedy requests lose at most the step to come back up


def test_acceptance_classes_are_kept_per_request_and_checked():
    ctl = synthetic({0: 1.0, 4: 1.3, 8: 1.4, 16: 1.6})
    ctl.note_request("s", "sampled")
    ctl.note_request("g", "greedy")
    feed(ctl, "g", {4: 4, 8: 4, 16: 4}, 3)
    assert ctl.global_estimate(16) == pytest.approx(4.0)
    assert ctl.global_estimate(16, "sampled") is None  # never measured: no prior
    assert ctl.accept_estimate("s", 16) is None and ctl.rate(["s"], 16) is None
    assert ctl.accept_estimate("unnamed", 16) == pytest.approx(4.0)  # unnamed: greedy
    assert set(ctl.info()["accept_curve_by_class"]) == {"greedy", "sampled"}
    ctl.reset()  # forgets acceptance, not what each request is
    assert ctl.classes == {"s": "sampled", "g": "greedy"}
    assert ctl.global_estimate(16) is None
    ctl.forget("s")
    assert "s" not in ctl.classes
    with pytest.raises(ValueError, match="cls"):
        ctl.note_request("x", "beam")
    assert "x" not in ctl.classes
    # not capped: a long queue of requests noted when queued kept the oldest (running) ones'
    # classes only up to 4096, then sent them to the greedy curve (a helper's review)
    ctl.note_request("running", "sampled")
    for i in range(5000):
        ctl.note_request(f"queued{i}", "greedy")
    assert ctl.classes["running"] == "sampled"


@pytest.mark.parametrize("per_step", [False, True])
def test_engine_decay_per_step_counts_the_engine_curves_memory_in_steps(per_step):
    """engine_decay_per_step: at n requests each of a step's n rounds decays the engine-wide
    curve by decay ** (1 / n) (a step's worth of decay a step); a request's own curve decays
    by `decay` a round either way. Off: both by `decay` a round."""
    d, n = 0.9, 4
    ctl = synthetic({0: 1e-4, 4: 2e-4}, decay=d, engine_decay_per_step=per_step)
    ids = [f"r{i}" for i in range(n)]
    steps = random.Random().randint(2, 5)
    for _ in range(steps):  # a decision, then every request's round
        ctl.choose(ids)
        for rid in ids:
            ctl.observe_round(rid, 4, [0, 1, 2])
    engine = ctl.global_estimate(4)  # 2 drafts accepted in every round: the mean is exact
    assert engine == pytest.approx(2.0)
    den = ctl.class_curves["greedy"][4].den
    e = d ** (1 / n) if per_step else d
    assert den == pytest.approx(sum(e**i for i in range(n * steps)))
    assert ctl.requests["r0"].curve[4].den == pytest.approx(sum(d**i for i in range(steps)))
