"""The adaptive budget controller's decision on synthetic acceptance and cost (no engine, no
timing): R(B), hysteresis and the margin to leave the rounds, dwell and confirmation, cost
borrowing, step paths, new groups on their class's prior, the decision log, the knobs'
validation. Its acceptance curves: tests/test_acceptance_curves.py; its probes:
tests/test_budget_probes.py; cost trials: tests/test_budget_costs.py; acceptance trials:
tests/test_accept_trials.py. The helpers below (`synthetic`, `feed`, `path_for`) serve them all."""

from __future__ import annotations

import pytest

from treeverify.engine import budget_events
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
