"""The adaptive budget controller's math on synthetic acceptance and cost (no engine, no timing):
the free acceptance curve, the decayed means, R(B), hysteresis, exploration, cost borrowing."""

from __future__ import annotations

import random

import pytest

from treeverify.engine import budget_events
from treeverify.engine.acceptance_curves import accepted_at_budgets
from treeverify.engine.budget_controller import (
    BudgetController,
    ControllerConfig,
    CostModel,
    budget_buckets,
)


def test_buckets():
    assert budget_buckets(16) == (0, 4, 8, 16)
    assert budget_buckets(48) == (0, 4, 8, 16, 32, 48)
    assert budget_buckets(3) == (0, 3)
    with pytest.raises(ValueError, match="max_budget"):
        budget_buckets(0)


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


def synthetic(costs: dict[int, float], **cfg) -> BudgetController:
    buckets = tuple(sorted(costs))
    return BudgetController(buckets, CostModel.given(costs), ControllerConfig(**cfg))


def feed(ctl: BudgetController, rid: str, accepted: dict[int, int], steps: int) -> list[int]:
    """Run `steps` decisions for one request whose rounds accept `accepted[b]` drafts in a
    budget-b tree (a path whose node indices make exactly that free curve)."""
    chosen = []
    for _ in range(steps):
        b = ctl.choose([rid])
        chosen.append(b)
        if b:
            ctl.observe_round(rid, b, path_for(accepted, b))
    return chosen


def path_for(accepted: dict[int, int], budget: int) -> list[int]:
    """A root-first path of node indices whose cut at every bucket <= budget is accepted[b]:
    the nodes first counted at bucket b get indices just above the previous bucket."""
    path, lo = [0], 0
    for b in sorted(k for k in accepted if 0 < k <= budget):
        need = accepted[b] - (len(path) - 1)
        path += list(range(lo + 1, lo + 1 + need))
        lo = b
    return path


@pytest.mark.parametrize(("probe", "probed"), [("top", {16}), ("up", {4}), ("hybrid", {4, 16})])
def test_falls_back_to_plain_when_drafts_are_never_accepted(probe, probed):
    ctl = synthetic({0: 1.0, 4: 1.3, 8: 1.4, 16: 1.6}, min_dwell=4, explore_every=10, probe=probe)
    chosen = feed(ctl, "r", {4: 0, 8: 0, 16: 0}, 60)
    assert ctl.current == 0
    tail = chosen[20:]
    assert tail.count(0) >= 0.85 * len(tail)  # plain, with a probe now and then ...
    # ... at the largest bucket, one bucket up, or (hybrid) in turns the best-rated one (with
    # nothing accepted, the cheapest: 4) and the largest
    assert set(tail) - {0} <= probed and (probe != "hybrid" or set(tail) - {0} == probed)
    assert ctl.rate(["r"], 0) > ctl.rate(["r"], 4)


def test_hybrid_probes_from_plain_alternate_the_best_rated_bucket_and_the_top():
    """From plain decoding hybrid probes in turns the speculating bucket of best estimated rate
    (cheaper than the top, and the one a switch would go to) and the largest; from a
    speculating budget one bucket up."""
    costs = {0: 1.0, 4: 2.0, 8: 2.1, 16: 3.0}  # 8 accepts as much as 16 here, for less
    ctl = synthetic(costs, min_dwell=1, explore_every=1, explore_max=1)
    ctl.current, ctl.switches = 0, 1
    ctl.observe_round("r", 16, path_for({4: 0, 8: 1, 16: 1}, 16))  # R(8) = 2 / 2.1 best of 4-16
    probes = [b for b in (ctl.choose(["r"]) for _ in range(40)) if b]
    assert probes[:4] == [8, 16, 8, 16], probes
    ctl = synthetic(costs, min_dwell=1, explore_every=1, explore_max=1)
    ctl.current, ctl.switches = 4, 1
    ctl.observe_round("r", 16, path_for({4: 3, 8: 3, 16: 3}, 16))
    assert {ctl.probes.target(ctl, {b: 1.0 for b in costs})} == {8}  # one up from 4


@pytest.mark.parametrize(("probe", "ends_at"), [("top", 16), ("up", 0), ("hybrid", 16)])
def test_a_probe_at_the_top_sees_what_only_a_large_tree_accepts(probe, ends_at):
    """After a stretch at 0, the text turns predictable for a large tree only (a budget-4 or -8
    tree still accepts nothing): a probe at the largest bucket measures that in one round and
    the controller goes there; probes one bucket up measure nothing new and it stays plain."""
    costs = {0: 1.0, 4: 1.3, 8: 1.4, 16: 1.6}  # R(16) = 7 / 1.6 = 4.4 tokens per unit vs 1
    ctl = synthetic(costs, min_dwell=4, explore_every=10, explore_max=40, probe=probe)
    feed(ctl, "r", {4: 0, 8: 0, 16: 0}, 60)
    assert ctl.current == 0
    feed(ctl, "r", {4: 0, 8: 0, 16: 6}, 120)
    assert ctl.current == ends_at


@pytest.mark.parametrize(("probe", "probed"), [("top", 16), ("up", 8), ("hybrid", 8)])
def test_probes_from_a_speculating_budget(probe, probed):
    """Speculating at 4 with nothing to gain above it: "top" probes the largest bucket, "up"
    and "hybrid" (the default) one bucket up, a cheaper step (hybrid probes the top only from
    plain decoding, where a large tree may see what a small one does not)."""
    costs = {0: 1.0, 4: 1.1, 8: 1.5, 16: 2.0}
    ctl = synthetic(costs, min_dwell=2, explore_every=10, probe=probe)
    ctl.current = 4
    chosen = feed(ctl, "r", {4: 3, 8: 3, 16: 3}, 80)  # R(4) = 4 / 1.1 beats 8 and 16
    assert ctl.current == 4
    assert set(chosen[20:]) == {4, probed}
    assert ControllerConfig().probe == "hybrid"


def test_grows_to_the_best_budget_when_acceptance_is_high():
    costs = {0: 1.0, 4: 1.1, 8: 1.2, 16: 1.5}
    accepted = {4: 3, 8: 5, 16: 6}  # R: 1, 3.6, 5.0, 4.67 -> 8 is best
    ctl = synthetic(costs, min_dwell=2)
    ctl.current = 0  # start from plain: exploration must find its way up
    feed(ctl, "r", accepted, 120)
    assert ctl.current == 8
    assert ctl.rate(["r"], 8) == pytest.approx(6 / 1.2)


def test_hysteresis_keeps_the_budget_within_the_margin():
    # 4 and 8 within 3% of each other: no flapping between them once settled.
    ctl = synthetic({0: 1.0, 4: 1.0, 8: 1.03}, switch_margin=0.05, min_dwell=2)
    feed(ctl, "r", {4: 3, 8: 3}, 30)
    settled, switches = ctl.current, ctl.switches
    feed(ctl, "r", {4: 3, 8: 3}, 100)
    assert ctl.current == settled and ctl.switches == switches


def test_leaving_the_rounds_needs_a_margin_that_narrows_while_plain_keeps_winning():
    """Plain decoding measures no acceptance, and acceptance comes in bursts: a dip where plain
    looks 30% faster must persist before the rounds are left (the margin starts at
    plain_margin = 1.0 and halves every plain_halflife = 16 decisions: below 0.3 after ~28),
    while text that nothing predicts (plain 2.5x faster) leaves at once."""
    knobs = dict(min_dwell=2, explore_every=1000, explore_max=1000)
    ctl = synthetic({0: 1.0, 16: 1.3}, **knobs)  # nothing accepted: plain 1.3x the rate
    ctl.current, ctl.switches = 16, 1
    chosen = feed(ctl, "r", {16: 0}, 60)
    first_plain = chosen.index(0)
    assert 26 <= first_plain <= 32, chosen  # log2(1 / 0.3) * 16 = 27.8 decisions, + confirm
    assert chosen[first_plain:] == [0] * (60 - first_plain)

    ctl = synthetic({0: 1.0, 16: 2.5}, **knobs)  # plain 2.5x: beyond the widest margin
    ctl.current, ctl.switches = 16, 1
    assert feed(ctl, "r", {16: 0}, 4) == [16, 16, 0, 0]  # the dwell (2), then confirmed
    info = ctl.info()  # /server_info: why the budget is what it is
    assert info["config"]["plain_margin"] == 1.0 and info["config"]["plain_halflife"] == 16.0
    assert info["plain_ahead_decisions"] >= 2

    # 8 requests: their summed acceptance averages bursts out, the margin is 1 / sqrt(8) = 0.35
    ctl = synthetic({0: 1.0, 16: 1.3}, **knobs)
    ctl.current, ctl.switches = 16, 1
    ids = [f"r{i}" for i in range(8)]
    chosen = []
    for _ in range(12):
        chosen.append(ctl.choose(ids))
        for rid in ids if chosen[-1] else []:
            ctl.observe_round(rid, 16, [0])
    assert 4 <= chosen.index(0) <= 8, chosen  # 0.35 * 0.5 ** (w / 16) < 0.3: w >= 4, + confirm

    ctl = synthetic({0: 1.0, 16: 1.3}, plain_margin=0.05, **knobs)  # the old rule: at once
    ctl.current, ctl.switches = 16, 1
    assert feed(ctl, "r", {16: 0}, 4) == [16, 16, 0, 0]


def test_switch_needs_dwell_and_confirmation():
    # plain_margin=0.05: the leaving-the-rounds margin as any switch's (tested on its own below)
    knobs = dict(confirm=3, explore_every=1000, explore_max=1000, plain_margin=0.05)
    ctl = synthetic({0: 1.0, 4: 1.5}, min_dwell=5, **knobs)
    ctl.current, ctl.switches = 4, 1  # as if it had just switched to 4
    ctl.observe_round("r", 4, [0])  # nothing accepted: plain is better
    chosen = [ctl.choose(["r"]) for _ in range(5)]
    assert chosen == [4] * 5  # five steps at 4 (the dwell) before the switch
    assert ctl.choose(["r"]) == 0 and ctl.switches == 2

    ctl = synthetic({0: 1.0, 4: 1.5}, min_dwell=0, **knobs)
    ctl.current, ctl.switches = 4, 1
    ctl.observe_round("r", 4, [0])
    assert [ctl.choose(["r"]) for _ in range(4)] == [4, 4, 0, 0]  # 3 consecutive wins


def test_the_first_choice_needs_no_dwell_nor_confirmation():
    ctl = synthetic({0: 1.0, 4: 1.1, 8: 1.5}, min_dwell=50, confirm=5)
    assert ctl.choose(["r"]) == 8  # nothing measured yet: the top, which measures every budget
    ctl.observe_round("r", 8, [0, 1, 2, 3, 9])  # 3 accepted at 4, 4 at 8
    assert ctl.choose(["r"]) == 4  # R: 1.0, 3.64, 3.33


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


def test_batch_rate_sums_requests_over_the_batch_cost():
    ctl = synthetic({0: 1.0, 4: 2.0})
    ctl.observe_round("a", 4, [0, 1, 2, 3])  # 3
    ctl.observe_round("b", 4, [0, 1])  # 1
    ctl.cfg.prior_rounds = 0.0
    assert ctl.rate(["a", "b"], 4) == pytest.approx((4 + 2) / 2.0)
    assert ctl.rate(["a", "b"], 0) == pytest.approx(2 / 1.0)


def test_cost_model_median_and_borrowing():
    m = CostModel(window=5)
    for s in (1.0, 1.1, 9.0, 1.0, 1.2):  # one stall
        m.observe(1, 4, s)
    assert m.estimate(1, 4) == pytest.approx(1.1)
    m.observe(1, 0, 0.5)
    m.observe(8, 0, 2.0)
    assert m.estimate(8, 4) == pytest.approx(1.1 * 2.0 / 0.5)  # batch 1's curve, scaled
    assert m.estimate(1, 16) is None
    with pytest.raises(ValueError, match="budget 4"):
        CostModel.given({0: 1.0, 4: 0.0})


def test_cost_model_interpolates_between_measured_batch_sizes():
    """Batch sizes between two measured ones: linear at that budget (the borrowed shape of
    batch 1 would put budget 32 at batch 8 barely above 16: a round's GPU work grows with
    batch x budget); outside them, borrowing as before; a newly measured size re-brackets."""
    m = CostModel(window=1)
    for n, c16, c32 in ((1, 1.0, 1.1), (8, 1.2, 2.4), (32, 2.0, 6.0)):
        m.observe(n, 0, 0.5 * c16)
        m.observe(n, 16, c16)
        m.observe(n, 32, c32)
    assert m.estimate(4, 32) == pytest.approx(1.1 + (2.4 - 1.1) * 3 / 7)
    assert m.estimate(16, 16) == pytest.approx(1.2 + (2.0 - 1.2) * 8 / 24)
    assert m.estimate(8, 32) == pytest.approx(2.4)  # measured: its own
    assert m.estimate(64, 32) == pytest.approx(6.0)  # past every size: the nearest's (borrowed)
    m.observe(12, 32, 3.0)
    assert m.estimate(10, 32) == pytest.approx(2.4 + (3.0 - 2.4) * 2 / 4)


def test_pinned_budget_and_info():
    ctl = synthetic({0: 1.0, 4: 1.0, 8: 1.0})
    ctl.pinned = 4
    assert [ctl.choose(["r"]) for _ in range(3)] == [4, 4, 4]
    info = ctl.info()
    assert info["buckets"] == [0, 4, 8] and info["steps_by_budget"]["4"] == 3
    assert info["cost_seconds_batch1"] == {"0": 1.0, "4": 1.0, "8": 1.0}


def test_bad_config_is_a_value_error():
    with pytest.raises(ValueError, match="decay"):
        ControllerConfig(decay=1.0)
    with pytest.raises(ValueError, match="plain_margin"):
        ControllerConfig(plain_margin=-0.1)
    with pytest.raises(ValueError, match="plain_halflife"):
        ControllerConfig(plain_halflife=0)
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="arrival_probe_factor"):
            ControllerConfig(arrival_probe_factor=bad)
    for bad in (0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="explore_far_factor"):
            ControllerConfig(explore_far_factor=bad)
    # a bool knob from the command line: the usual spellings, and a typo is an error
    cfg = ControllerConfig()
    assert cfg.with_settings(["new_batch_at_once=off"]).new_batch_at_once is False
    assert cfg.with_settings(["cost_trials=No"]).cost_trials is False
    assert cfg.with_settings(["new_batch_at_once=yes"]).new_batch_at_once is True
    with pytest.raises(ValueError, match="new_batch_at_once: expected true or false"):
        cfg.with_settings(["new_batch_at_once=maybe"])
    for knob in ("plain_margin=nan", "switch_margin=inf", "prior_rounds=-inf"):  # pass `<` checks
        with pytest.raises(ValueError, match=f"{knob.split('=')[0]}: expected a finite number"):
            cfg.with_settings([knob])
    with pytest.raises(ValueError, match="buckets"):
        BudgetController((4, 8))


def test_per_request_state_is_bounded(monkeypatch):
    import treeverify.engine.budget_controller as bc

    monkeypatch.setattr(bc, "MAX_TRACKED_REQUESTS", 3)
    ctl = synthetic({0: 1.0, 4: 1.0})
    for i in range(5):
        ctl.observe_round(f"r{i}", 4, [0, 1])
    assert list(ctl.requests) == ["r2", "r3", "r4"]


@pytest.mark.parametrize(
    ("factor", "far", "restarts", "gap"),
    [(0.0, 2.0, True, 32), (0.6, 2.0, False, 64), (0.6, 1.0, False, 32)],
)
def test_probes_back_off_scale_with_cost_and_restart_for_new_requests(factor, far, restarts,
                                                                      gap):  # fmt: skip
    """Probes back off while they change nothing, to `explore_max` steps apart, or that times
    `explore_far_factor` while every bucket's rate is under `arrival_probe_factor` of plain
    decoding's (here 0.5 of it: a round accepts nothing at twice a plain step's cost); a
    request without rounds of its own restarts the interval (new text, maybe predictable),
    unless its class's engine-wide curve says no bucket comes within that factor. Replayed at
    the H100's costs, the restart's probes cost text no drafter predicts 0.915 -> 0.962x plain
    (2 probes a 128-token request), the far cap 0.962 -> 0.968x, the recorded code and prose
    rows nothing (docs/ddtree.md)."""
    ctl = synthetic({0: 1.0, 4: 2.0}, explore_every=4, explore_max=32, min_dwell=0,
                    arrival_probe_factor=factor, explore_far_factor=far)  # fmt: skip
    feed(ctl, "r", {4: 0}, 400)  # never accepted: at 0, probing less and less often
    probes = [i for i, b in enumerate(feed(ctl, "r", {4: 0}, 400)) if b == 4]
    gaps = [b - a for a, b in zip(probes[:-1], probes[1:], strict=True)]
    assert gaps and all(g == gap for g in gaps), gaps  # backed off to the cap
    ctl.observe_round("r", 4, [0])
    ctl.probes.since = 0  # as right after a probe
    chosen = feed(ctl, "new", {4: 0}, 12)  # a new request: back to 4 steps x cost ratio 2?
    assert (4 in chosen[:9]) == restarts
    # a request of a class never measured has no prior: the interval restarts
    ctl.note_request("s", "sampled")
    ctl.probes.since = 0
    assert 4 in feed(ctl, "s", {4: 0}, 12)[:9]


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


def test_settings_from_the_command_line_are_parsed_and_validated():
    cfg = ControllerConfig().with_settings(["prior_rounds=128", "min_dwell=32", "cost_trials=0"])
    assert (cfg.prior_rounds, cfg.min_dwell, cfg.cost_trials) == (128.0, 32, False)
    assert ControllerConfig().with_settings([]) == ControllerConfig()
    for bad, name in (("nope=1", "nope"), ("decay", "decay"), ("min_dwell=x", "min_dwell"),
                      ("decay=2", "decay")):  # fmt: skip
        with pytest.raises(ValueError, match=name):
            ControllerConfig().with_settings([bad])


def test_plain_decoding_decides_every_fourth_step_and_a_round_or_a_new_request_at_once():
    """At budget 0 the rates are computed on every TRIAL_CHECK_EVERY-th decision only (a plain
    step observes no round; the rules' Python was ~25 us of a plain step), but a probe's round
    and a change of requests are decided on at once."""
    from treeverify.engine.budget_trials import TRIAL_CHECK_EVERY

    costs = {0: 1e-4, 4: 1.0, 8: 1.0, 16: 1.0}
    ctl = synthetic(costs, explore_every=10_000, explore_max=10_000)
    feed(ctl, "a", {4: 0, 8: 0, 16: 0}, 8)  # nothing accepted: to plain decoding
    assert ctl.current == 0
    calls = []
    rate = ctl.rate
    ctl.rate = lambda ids, b, cost=None: calls.append(b) or rate(ids, b, cost)
    decisions = 8 * TRIAL_CHECK_EVERY
    assert feed(ctl, "a", {4: 0, 8: 0, 16: 0}, decisions) == [0] * decisions
    full = calls.count(0)  # one rate per bucket per full decision
    assert full == decisions // TRIAL_CHECK_EVERY
    calls.clear()
    ctl.choose(["a", "b"])  # a request joins: decided now, whatever the step
    ctl.choose(["a", "b"])
    assert calls.count(0) >= 1
    calls.clear()
    ctl.observe_round("a", 16, [0, 1, 2])  # a probe's round moves the rates
    ctl.choose(["a", "b"])
    assert calls.count(0) == 1


def test_a_switch_back_from_plain_decoding_is_not_delayed_by_the_reused_rates():
    """Plain decoding, then the text turns predictable (a probe shows it): the controller
    leaves plain decoding within the steps it took when every decision computed the rates."""
    costs = {0: 1.0, 4: 1.05, 8: 1.1, 16: 1.2}
    ctl = synthetic(costs, explore_every=4, explore_max=4)
    feed(ctl, "a", {4: 0, 8: 0, 16: 0}, 40)
    assert ctl.current == 0
    chosen = feed(ctl, "a", {4: 4, 8: 8, 16: 16}, 24)
    assert ctl.current > 0, chosen


def test_each_step_path_keeps_its_own_costs_and_a_new_one_starts_from_the_fast_ones_stale():
    """Steps read first (general path) cost several times those picked in the graph (fast
    path): each path has its table, so sampled text's 3 ms rounds do not price greedy rounds,
    and a decision reads the costs of the path its step takes."""
    from treeverify.engine.budget_controller import FAST, GENERAL

    ctl = BudgetController((0, 4, 8, 16), CostModel(window=3))
    for b, sec in {0: 1.0, 4: 1.1, 8: 1.2, 16: 1.3}.items():
        ctl.observe_step(1, b, sec)  # the calibration: fast path
    ctl.reset()
    for _ in range(12):  # predictable text: rounds pay at these costs
        b = ctl.choose(["a"])
        ctl.observe_round("a", b, [0, 1, 2, 3, 4] if b else [0])
    assert ctl.current > 0 and ctl.path == FAST
    ctl.choose(["a"], GENERAL)  # a new path: the fast table's values, every entry stale
    assert ctl.path == GENERAL
    assert ctl.cost.estimate(1, 16) == pytest.approx(1.3)
    assert not ctl.cost.is_fresh(1, 16, ctl.step_index, 10**6)
    for b in (4, 8, 16):  # the general path's rounds measured at 10x: two steps outvote
        ctl.observe_step(1, b, 13.0, GENERAL)  # the copied value
        ctl.observe_step(1, b, 13.0, GENERAL)
    assert ctl.paths[GENERAL].cost.estimate(1, 16) == pytest.approx(13.0)
    assert ctl.paths[FAST].cost.estimate(1, 16) == pytest.approx(1.3)  # untouched
    assert ctl.rate(["a"], 16) < ctl.rate(["a"], 0)  # on the general path plain wins
    ctl.choose(["a"], FAST)
    assert ctl.rate(["a"], 16) > ctl.rate(["a"], 0)  # on the fast path rounds still do
    assert set(ctl.info()["cost_seconds_batch1_by_path"]) == {FAST, GENERAL}


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


def test_a_new_group_switches_on_its_classs_prior_at_once():
    """A step whose requests have no rounds of their own (a new group) is judged on its class's
    prior with no dwell nor confirmation: after greedy groups ran at 16, a new group of sampled
    requests (a class that accepts nothing) goes to plain decoding on its first decision; with
    `new_batch_at_once` off it runs rounds until `confirm` decisions and `min_dwell` steps.
    Once its requests have rounds of their own, the usual rules hold."""
    costs = {0: 1.0, 4: 1.3, 8: 1.4, 16: 1.6}
    high, none = {4: 4, 8: 7, 16: 10}, {4: 0, 8: 0, 16: 0}

    def after_greedy(at_once: bool) -> list[int]:
        ctl = synthetic(costs, min_dwell=6, confirm=3, explore_every=1000, explore_max=1000,
                        new_batch_at_once=at_once)  # fmt: skip
        greedy = [f"g{i}" for i in range(8)]
        for _ in range(40):
            for rid in greedy:
                ctl.note_request(rid, "greedy")
            b = ctl.choose(greedy)
            for rid in greedy:
                if b:
                    ctl.observe_round(rid, b, path_for(high, b))
        assert ctl.current == 16
        ctl.switches = max(ctl.switches, 1)  # past the start's first switch (no dwell there)
        sampled = [f"s{i}" for i in range(8)]
        for rid in greedy:
            ctl.forget(rid)
        for i in range(4):  # the sampled class's prior: an earlier group's rounds
            ctl.note_request(f"old{i}", "sampled")
            ctl.observe_round(f"old{i}", 16, path_for(none, 16))
            ctl.forget(f"old{i}")
        for rid in sampled:
            ctl.note_request(rid, "sampled")
        chosen = []
        for _ in range(8):
            b = ctl.choose(sampled)
            chosen.append(b)
            for rid in sampled:
                if b:
                    ctl.observe_round(rid, b, path_for(none, b))
        return chosen

    assert after_greedy(True) == [0] * 8
    slow = after_greedy(False)
    assert slow[0] == 16 and slow[-1] == 0, slow  # the dwell and the confirmations first


def test_a_probe_from_plain_decoding_fades_first():
    """The fade of the plain steps since the last one (every FADE_EVERY) is applied before a
    probe's round is observed (and before the first round after a stretch at plain decoding):
    none lands on acceptance newer than the steps it stands for (a helper's review, with the
    fade every 16 plain steps instead of 4)."""
    ctl = synthetic({0: 1.0, 4: 2.0}, explore_every=4, explore_max=40, min_dwell=0)
    probes = 0
    for _ in range(400):
        before = ctl._plain_unfaded
        mean = ctl.requests["r"].curve[4] if "r" in ctl.requests else None
        den = mean.den if mean is not None else None
        b = ctl.choose(["r"])
        if b and ctl.current == 0 and den is not None:  # a probe from plain decoding
            probes += 1
            assert ctl._plain_unfaded == 0
            assert mean.den == pytest.approx(den * ctl.cfg.plain_decay**before)
        if b:
            ctl.observe_round("r", b, [0])  # nothing accepted: plain decoding stays best
    assert probes >= 5


def _groups_in_turns(ctl: BudgetController, passes: int) -> list[list[dict]]:
    """Groups of 8 requests in turns, as bench_pair's b=8 passes run them: greedy code (high
    acceptance), then sampled text no drafter predicts, one controller throughout; returns each
    group's decision log."""
    high = {4: 3, 8: 4, 16: 5, 32: 6, 64: 6}
    none = dict.fromkeys(high, 0)
    logs = []
    for p in range(passes):
        for cls, acc in (("greedy", high), ("sampled", none)):
            ids = [f"{cls}{p}-{i}" for i in range(8)]
            for rid in ids:
                ctl.note_request(rid, cls)
            start, tokens = ctl.step_index, 0
            while tokens < 128:  # tokens per request
                b = ctl.choose(ids)
                got = path_for(acc, b) if b else [0]
                for rid in ids:
                    if b:
                        ctl.observe_round(rid, b, got)
                tokens += len(got)
            for rid in ids:
                ctl.forget(rid)
            logs.append(ctl.events.since(start))
    return logs


@pytest.mark.parametrize("restarts", [True, False])
def test_the_decision_log_says_when_and_why_and_a_new_groups_switch_need_not_restart_probes(
    restarts,
):
    """Every probe, switch and trial is logged with its decision index, the bucket it left and
    the one it went to (/server_info's `recent_decisions`). On groups in turns at b=8-like
    costs, a sampled group switches to plain decoding on its class's prior at once; counted as
    a change a probe saw (`new_batch_restarts_probes`, as before), that switch starts the probe
    interval over and the group probes twice; not counted, the later sampled groups probe at
    most once (what the thirty-ninth session measured on the H100: two probes a sampled group,
    ~1.5 ms each beyond a steady round, in a ~36 ms group)."""
    costs = {0: 0.28, 4: 0.5, 8: 0.52, 16: 0.56, 32: 0.65, 64: 0.85}
    ctl = synthetic(costs, new_batch_restarts_probes=restarts)
    chosen = []
    real_choose = ctl.choose

    def choose(ids, path="fast"):
        b = real_choose(ids, path)
        chosen.append((ctl.step_index, b, ctl.current))
        return b

    ctl.choose = choose
    logs = _groups_in_turns(ctl, 3)
    by_step = {s: (b, cur) for s, b, cur in chosen}
    for log in logs:
        moved = {}  # decision -> the bucket its last move went to
        for e in log:
            b, cur = by_step[e["step"]]
            if e["kind"] == "probe":  # the step ran at the probe's bucket, current stayed
                assert b == e["to"] != cur == e["from"] and "interval" in e["note"], e
            elif e["kind"] not in ("interval_restart", "plain_trial"):  # (no move: see
                # budget_events.py; the given costs here are frozen: no plain trial anyway)
                assert e["from"] != e["to"], e
                moved[e["step"]] = e["to"]
        assert all(by_step[s][1] == to for s, to in moved.items()), (moved, log)
    later_sampled = logs[3::2]  # the sampled class's prior was measured by the first group
    assert all(log[0]["kind"] == "new_batch" and log[0]["to"] == 0 for log in later_sampled)
    probes = [sum(e["kind"] == "probe" for e in log) for log in later_sampled]
    assert min(probes) >= 2 if restarts else max(probes) <= 1, probes
    info = ctl.info()
    assert info["recent_decisions"] == ctl.events.recent()
    assert info["recent_decisions"][-1]["step"] <= info["decision_index"] == ctl.step_index
    assert len(ctl.events.recent(10_000)) <= budget_events.KEPT_EVENTS  # bounded


def test_the_decision_log_keeps_the_last_events_only():
    log = budget_events.DecisionEvents(kept=3)
    for i in range(5):
        log.add(i, budget_events.PROBE, 0, 64, 8, f"p{i}")
    assert [e["step"] for e in log.recent()] == [2, 3, 4]
    assert [e["note"] for e in log.since(3)] == ["p4"]
    assert log.complete_since(1) and not log.complete_since(0)  # events 0 and 1 are gone
    assert log.recent(1) == [{"step": 4, "kind": "probe", "from": 0, "to": 64, "n": 8,
                              "note": "p4"}]  # fmt: skip


def test_a_round_not_yet_observed_is_no_arrival(monkeypatch):
    """The engine launches each step ahead, so the decision after a round comes before that
    round is observed. A group whose class's prior comes near plain decoding's rate restarts
    the probes' interval on arrival; its first probe's requests must not count as arrivals
    again at the next decision, which undid the probe's back-off: on the H100 each sampled
    group of 8 then probed again ~50 decisions after the first (the fortieth session's
    decision log). With the round awaited, decisions lagged by one make the same probes as
    decisions that see every round at once; without (the helper stubbed out), the lagged ones
    restart the interval after the first probe and probe sooner."""
    costs = {0: 0.28, 4: 0.5, 8: 0.52, 16: 0.56, 32: 0.65, 64: 0.85}

    def group_events(lag: int, **knobs) -> list[tuple[int, str]]:
        # the arrival bar of sampled and greedy requests alike (`sampled_arrival_factor` 0, the
        # default until the fifty-seventh session): this sampled prior restarts the interval
        ctl = synthetic(costs, sampled_arrival_factor=0.0, **knobs)
        for i in range(8):  # the sampled class's prior: a lucky draft in 3 (rate(4) ~0.73 x
            ctl.note_request(f"old{i}", "sampled")  # plain's: arrivals restart the interval)
            for k in range(12):
                ctl.observe_round(f"old{i}", 64, [0, 1] if k % 3 == 0 else [0])
            ctl.forget(f"old{i}")
        ctl.current, ctl.switches = 0, 1  # at plain decoding, probes backed off before
        ctl.probes.count, ctl.probes.interval, ctl.probes._switches_at_probe = 5, 256.0, 1
        ids = [f"s{i}" for i in range(8)]
        for rid in ids:
            ctl.note_request(rid, "sampled")
        start, waiting = ctl.step_index, []
        for k in range(128):
            waiting.append(ctl.choose(ids))
            if len(waiting) > lag:  # observed `lag` decisions late
                done = waiting.pop(0)
                for rid in ids:
                    if done:
                        ctl.observe_round(rid, done, [0, 1] if k % 3 == 0 else [0])
        return [(e["step"] - start, e["kind"]) for e in ctl.events.since(start)]

    at_once = group_events(0)
    assert [k for _, k in at_once][:2] == ["interval_restart", "probe"], at_once
    # a decision the engine planned and dropped (the batch changed before its step ran): its
    # round never comes back, and past AWAIT_DECISIONS its requests are arrivals again
    ctl = synthetic(costs)
    ctl._await_round(["x"])
    ctl.step_index += 2
    assert ctl._awaited("x")
    ctl.step_index += 1
    assert not ctl._awaited("x")
    ctl.observe_round("x", 4, [0])
    assert "x" not in ctl._awaiting
    assert group_events(1) == at_once
    monkeypatch.setattr(BudgetController, "_await_round", lambda self, ids: None)
    lagged = group_events(1)
    monkeypatch.undo()
    assert group_events(1, await_rounds=False) == lagged  # the knob, for A/B
    first = at_once[1][0]
    assert (first + 1, "interval_restart") in lagged, lagged  # the restart right after it
    probes = [s for s, k in lagged if k == "probe"]
    assert probes[1] < next(s for s, k in at_once[2:] if k == "probe"), (lagged, at_once)


@pytest.mark.parametrize("await_rounds", [True, False])
def test_an_unknown_rate_is_probed_once_while_its_round_is_awaited(await_rounds):
    """A class never measured has no rate above the current bucket: its first decision probes
    there. With decisions lagged by one (steps launched ahead), the next decision still sees no
    rate; with the probe's round awaited it does not probe again (the lagged replay's first
    sampled group probed twice in a row)."""
    costs = {0: 0.28, 4: 0.5, 8: 0.52, 16: 0.56}
    ctl = synthetic(costs, await_rounds=await_rounds)
    for i in range(4):  # the greedy class is known up to 8 only (rounds at 8)
        ctl.observe_round(f"g{i}", 8, [0, 1, 2])
    ctl.current, ctl.switches = 8, 1
    ids = [f"s{i}" for i in range(4)]
    for rid in ids:
        ctl.note_request(rid, "sampled")  # no prior at all
    chosen, waiting = [], []
    for _ in range(4):
        chosen.append(ctl.choose(ids))
        waiting.append(chosen[-1])
        if len(waiting) > 1:  # observed a decision late
            done = waiting.pop(0)
            for rid in ids:
                ctl.observe_round(rid, done, [0])
    assert chosen[0] == 16  # the probe
    assert chosen[1] == (8 if await_rounds else 16), chosen


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


@pytest.mark.parametrize("every", [1, 2, 4])
def test_decide_every_runs_the_rules_at_rounds_every_that_many_decisions(every):
    """decide_every: at a round budget with the same requests, `_decide` (every bucket's rate,
    the switch and trial rules) runs on one decision in `every`, the others reuse its rates;
    a new request (other ids) decides at once. 1: every decision, as before."""
    ctl = synthetic({0: 4e-4, 4: 5e-4, 8: 5.5e-4, 16: 6e-4}, decide_every=every, min_dwell=10**6,
                    explore_every=10**6, explore_max=10**6)  # fmt: skip
    ids = ["a", "b"]
    for rid in ids:
        ctl.observe_round(rid, 16, [0, 1, 2, 3])
    first = ctl.choose(ids)  # the start's one switch, made at once; then held by the dwell
    assert first in (4, 8, 16)
    calls = []
    real = ctl._decide
    ctl._decide = lambda rids: calls.append(ctl.step_index) or real(rids)
    budgets = set()
    for _ in range(12):
        budgets.add(ctl.choose(ids))
        for rid in ids:
            ctl.observe_round(rid, first, [0, 1, 2, 3])
    assert budgets == {first}
    assert len(calls) == 12 // every, calls
    assert all(i % every == 0 for i in calls)
    before = len(calls)
    ctl.choose(ids + ["c"])  # other requests: decided now, whatever the count
    assert len(calls) == before + 1


def test_decide_every_names_itself_when_wrong():
    with pytest.raises(ValueError, match="decide_every"):
        ControllerConfig(decide_every=3)


def test_choose_without_requests_names_the_argument():
    """A step with no speculating requests has no rate to weigh: a clear error naming the
    argument (dividing the margin by sqrt(0) raised ZeroDivisionError deep in the rule)."""
    ctl = BudgetController(budget_buckets(16))
    for b in ctl.buckets:
        ctl.observe_step(1, b, 1e-3 * (1 + b / 16))
    with pytest.raises(ValueError, match="request_ids"):
        ctl.choose([])
    assert ctl.choose(["r"]) in ctl.buckets  # the controller still decides afterwards
