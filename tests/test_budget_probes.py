"""The adaptive controller's exploration (engine/budget_probes.py, driven by
engine/budget_controller.py) on synthetic acceptance and cost: falling back to plain decoding
with probes, which bucket a probe runs at (hybrid, top, one up), the interval's back-off and
restart, the fade before a probe from plain decoding, and rounds launched ahead (awaited, not
arrivals)."""

from __future__ import annotations

import pytest

from test_budget_controller import feed, path_for, synthetic
from treeverify.engine.budget_controller import BudgetController, ControllerConfig


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
