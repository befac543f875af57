"""Stale step costs and cost trials (engine/budget_costs.py, budget_trials.cost_trial): a
calibration that overstated a budget's cost must not hold the controller below it forever (on
the H200 a calibrated budget 16 at 0.52 ms kept it at 8 while a fixed 16 outran it), and an
accurate calibration must cost at most one short trial per bucket per freshness window.
Synthetic acceptance, costs fed back as the engine does: every steady step (the third in a row
at one budget) observes its true cost."""

from __future__ import annotations

import itertools

import pytest

from test_budget_controller import path_for
from treeverify.engine.budget_controller import BudgetController, ControllerConfig
from treeverify.engine.budget_costs import CostModel
from treeverify.engine.budget_trials import cost_trial
from treeverify.engine.plain_trials import PLAIN_TRIAL_PATIENCE, PLAIN_TRIAL_STEPS

BUCKETS = (0, 4, 8, 16)
CALIBRATED = {0: 1.0, 4: 1.3, 8: 1.3, 16: 1.9}  # what startup measured
ACCEPTED = {4: 1, 8: 2, 16: 3}  # accepted drafts of a budget-b tree: R(8) = 3/1.3, R(16) = 4/1.9


def calibrated(table: dict[int, float] = CALIBRATED, **cfg) -> BudgetController:
    """A controller started as calibrate() leaves it: the table filled, every entry stale.
    Exploration probes (one step at the top now and then) are pushed past the runs here, so
    every step at 16 after the start is a trial's."""
    cfg = {"explore_every": 1000, "explore_max": 1000, **cfg}
    ctl = BudgetController(BUCKETS, CostModel(window=9), ControllerConfig(**cfg))
    for b, s in table.items():
        ctl.observe_step(1, b, s)
    ctl.reset()
    return ctl


def serve(ctl: BudgetController, true_cost: dict[int, float], steps: int,
          accepted: dict[int, int] = ACCEPTED, burst: range = range(0),
          slow: float = 1.0) -> list:  # fmt: skip
    """`steps` decisions for one request, rounds accepting `accepted`; steady steps feed back
    the true cost, `slow` times it during the decisions of `burst` (a burst of slow host steps:
    a neighbour on the host, a page-in)."""
    chosen, run, last = [], 0, None
    for i in range(steps):
        b = ctl.choose(["r"])
        chosen.append(b)
        if b:
            ctl.observe_round("r", b, path_for(accepted, b))
        run, last = (run + 1 if b == last else 1), b
        if run >= 3:
            ctl.observe_step(1, b, true_cost[b] * (slow if i in burst else 1.0))
    return chosen


def test_an_overstated_stale_cost_is_tried_and_replaced():
    true = {**CALIBRATED, 16: 1.32}  # budget 16 really costs about what 8 does: R(16) = 4/1.32
    ctl = calibrated(min_dwell=4)
    chosen = serve(ctl, true, 200)
    assert ctl.cost_trials >= 1
    assert ctl.current == 16
    assert chosen[100:].count(16) >= 0.9 * 100  # stays: its fresh cost shows the better rate
    assert ctl.cost.estimate(1, 16) == pytest.approx(1.32)
    assert ctl.info()["cost_trials"] == ctl.cost_trials
    # the same start without trials never leaves 8: nothing re-measures 16's cost
    still = calibrated(min_dwell=4, cost_trials=False)
    chosen = serve(still, true, 200)
    assert still.current == 8 and chosen[100:].count(16) == 0
    assert still.cost.estimate(1, 16) == pytest.approx(1.9)


def test_a_new_group_does_not_cut_a_cost_trial_short():
    """A cost trial measures a cost (the device's, whichever requests run its steps): a new
    group arriving in its dwell, whose prior's best bucket is another one, waits for the
    dwell instead of switching at once (`new_batch_at_once`; cut short, the cost stayed stale
    and the trial's mark blocked another for `cost_fresh_steps` decisions: a helper's review)."""
    true = {**CALIBRATED, 16: 1.32}
    ctl = calibrated(min_dwell=6)
    run, last, rid = 0, None, "r"
    for _ in range(200):
        trials = ctl.cost_trials
        b = ctl.choose([rid])
        if b:
            ctl.observe_round(rid, b, path_for(ACCEPTED, b))
        run, last = (run + 1 if b == last else 1), b
        if run >= 3:
            ctl.observe_step(1, b, true[b])
        if ctl.cost_trials > trials:
            break
    assert ctl.cost_trials == 1 and ctl.current == 16
    assert ctl.rate(["x"], 8) > 1.05 * ctl.rate(["x"], 16)  # a new request's prior: 8 best
    ctl.forget(rid)
    rid, dwell = "new", []
    for _ in range(ctl.cfg.min_dwell):
        b = ctl.choose([rid])
        dwell.append(b)
        ctl.observe_round(rid, b, path_for(ACCEPTED, b))
        run, last = (run + 1 if b == last else 1), b
        if run >= 3:
            ctl.observe_step(1, b, true[b])
    assert dwell == [16] * ctl.cfg.min_dwell
    assert ctl.cost.estimate(1, 16) == pytest.approx(1.32)  # measured: the trial did its job


def test_an_accurate_cost_costs_one_short_trial_per_window():
    ctl = calibrated(min_dwell=4, cost_fresh_steps=100)
    chosen = serve(ctl, CALIBRATED, 300)
    assert ctl.current == 8
    # 16's lower bound (8's fresh 1.3) makes it look 33% better: tried, measured at 1.9, left;
    # tried again only once its measurement is older than the window
    assert 1 <= ctl.cost_trials <= 3
    runs_at_16 = sum(1 for i, b in enumerate(chosen) if b == 16 and (i == 0 or chosen[i - 1] != 16))
    assert runs_at_16 == ctl.cost_trials + 1  # the start at the top, then each trial
    assert chosen.count(16) <= 1 + ctl.cost_trials * 12  # a trial lasts about one dwell


NOTHING = {4: 0, 8: 0, 16: 0}  # text no drafter predicts: rounds commit their bonus token only


def plain_trials(chosen: list[int]) -> list[int]:
    """Decision indices where a run of plain steps began after a speculating one."""
    return [i for i in range(1, len(chosen)) if chosen[i] == 0 and chosen[i - 1] != 0]


def test_a_stalled_calibration_of_plain_decoding_is_tried_and_left():
    """Calibration timed plain decoding during a stall (2.0 for a true 1.0: the CPU engine
    measured 16 ms for 8 under a neighbour's load), so on unpredictable text the rounds (1 token
    per 1.3) look better than plain (1 per 2.0) and nothing runs plain to correct it. A plain
    trial (its stale cost at half itself would win) measures it; the usual rule then leaves
    the rounds. Without trials (floor 1: the stale cost taken as is) it never does."""
    stalled = {**CALIBRATED, 0: 2.0}
    ctl = calibrated(stalled, min_dwell=4)
    chosen = serve(ctl, CALIBRATED, 300, NOTHING)
    assert ctl.cost.estimate(1, 0) == pytest.approx(1.0)  # re-measured
    assert chosen[150:].count(0) >= 0.95 * 150 and ctl.current == 0
    # /server_info: the trial found 1.0 for an estimate of 2.0 (not confirmed: the gap stays
    # at cost_fresh_steps); cost_trials counts it
    assert ctl.info()["plain_trial_gaps"] == {"1": 256} and ctl.info()["cost_trials"] >= 1
    still = calibrated(stalled, min_dwell=4, stale_plain_floor=1.0)
    chosen = serve(still, CALIBRATED, 300, NOTHING)
    assert chosen.count(0) == 0 and still.cost.estimate(1, 0) == pytest.approx(2.0)


def test_a_plain_trial_only_measures_and_confirmed_trials_come_less_often():
    """Where rounds win (1 accepted draft at 4: 2 tokens per 1.3 against plain's 1 per 1.0,
    within the 2x a stale plain cost may be off) each trial is PLAIN_TRIAL_STEPS plain steps,
    after which the controller is back at its bucket; each trial confirms the cost, so the gap
    to the next doubles (100, 200, 400, ...); where rounds win by more than 2x, no trial."""
    ctl = calibrated(min_dwell=4, cost_fresh_steps=100, cost_trials=True)
    chosen = serve(ctl, CALIBRATED, 1600, {4: 1, 8: 1, 16: 1})
    starts = plain_trials(chosen)
    assert len(starts) >= 3
    runs = [next(k for k, b in enumerate(chosen[i:]) if b) for i in starts]  # plain steps
    assert runs == [PLAIN_TRIAL_STEPS] * len(starts)
    # back where it was: the bucket before the trial is the one after it
    assert all(chosen[i - 1] == chosen[i + PLAIN_TRIAL_STEPS] for i in starts), starts
    # an acceptance trial at 8 keeps its dwell (min_dwell 4): none starts beside a plain trial,
    # whose restored state would judge it after one round
    # (a later single step at 8 is the exploration probe due every 1000 steps)
    runs_at_8 = [len(list(g)) for b, g in itertools.groupby(chosen) if b == 8]
    assert runs_at_8 and runs_at_8[0] >= 4, runs_at_8
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert all(g2 >= 1.8 * g1 for g1, g2 in zip(gaps, gaps[1:], strict=False)), gaps
    assert ctl.cost.estimate(1, 0) == pytest.approx(1.0)
    busy = calibrated(min_dwell=4, cost_fresh_steps=100)
    chosen = serve(busy, CALIBRATED, 600)  # ACCEPTED: 8 runs 3 per 1.3, > 2x plain
    assert plain_trials(chosen) == []


def test_a_plain_trial_resumes_the_decision_state_and_an_unmeasured_one_is_not_judged():
    """A trial restores the dwell and pending switch it found, starts no acceptance trial
    beside it (whose dwell the restore would cut to one round), and when none of its steps was
    measured (prefills came, the batch size changed) the gap to the next stays as it was."""
    ctl = calibrated({**CALIBRATED, 0: 2.0}, min_dwell=4)
    ctl.current, ctl.since_switch = 4, 9
    ctl.observe_round("r", 16, path_for(NOTHING, 16))  # every bucket's gain measured: 0
    ctl.observe_step(1, 4, 1.3)  # 4 fresh: the rate a plain trial is weighed against
    # the case must hold on PLAIN_TRIAL_PATIENCE trial checks in a row (every 4th decision):
    # a dip in acceptance passes, a trap stays
    for _ in range(4 * PLAIN_TRIAL_PATIENCE - 1):
        assert ctl.choose(["r"]) == 4 and not ctl.plain_trials.running
    ctl.since_switch = 9  # as at the decision that starts it
    assert ctl.choose(["r"]) == 4 and ctl.plain_trials.running
    assert ctl._trial_from is None  # no acceptance trial started beside it
    chosen = [ctl.choose(["r"]) for _ in range(PLAIN_TRIAL_STEPS)]  # no step observed
    assert chosen == [0] * PLAIN_TRIAL_STEPS and ctl.current == 4
    ctl.choose(["r"])  # the trial ends: state restored (and this decision counted)
    assert not ctl.plain_trials.running and ctl.since_switch == 10  # 9 restored, +1 this decision
    assert 1 not in ctl.plain_trials.gap  # nothing measured: not judged
    assert ctl.cost.estimate(1, 0) == pytest.approx(2.0)


def test_no_trial_without_a_fresh_smaller_cost_nor_for_a_fresh_bucket():
    ctl = calibrated(min_dwell=0)
    ctl.current = 16
    ctl.observe_round("r", 16, path_for(ACCEPTED, 16))
    ctl.observe_step(1, 0, 1.0)  # plain decoding's cost fresh: no plain trial either
    cost_trial(ctl, ["r"], 0.1)  # nothing fresh yet: no lower bound, no trial
    assert ctl.current == 16 and ctl.cost_trials == 0
    ctl.observe_step(1, 16, 1.9)  # 16 fresh; 4 and 8 stale but no fresh cost below them
    cost_trial(ctl, ["r"], 0.1)
    assert ctl.current == 16 and ctl.cost_trials == 0


def test_lower_bound_and_freshness():
    m = CostModel(window=3)
    m.observe(1, 0, 0.5, at=10)  # plain decoding bounds nothing: another path
    m.observe(1, 4, 1.0, at=10)
    m.observe(1, 8, 1.2, at=2)
    m.observe(2, 8, 9.0, at=10)  # another batch size
    m.observe(1, 32, 3.0)  # not while serving (calibration): never fresh
    assert m.lower_bound(1, 16, now=12, fresh_steps=5) == pytest.approx(1.0)  # 8 too old
    assert m.lower_bound(1, 16, now=12, fresh_steps=20) == pytest.approx(1.2)
    assert m.lower_bound(1, 4, now=12, fresh_steps=20) == pytest.approx(1.0)
    assert m.lower_bound(1, 64, now=40, fresh_steps=5) is None
    assert m.is_fresh(1, 4, 12, 5) and not m.is_fresh(1, 8, 12, 5) and not m.is_fresh(1, 32, 12, 99)
    m.clear()
    assert m.lower_bound(1, 16, now=12, fresh_steps=20) is None


def test_frozen_costs_never_trial():
    ctl = BudgetController(BUCKETS, CostModel.given(CALIBRATED), ControllerConfig(min_dwell=0))
    serve(ctl, CALIBRATED, 100)
    assert ctl.cost_trials == 0


def test_bad_freshness_window_is_a_value_error():
    with pytest.raises(ValueError, match="cost_fresh_steps"):
        ControllerConfig(cost_fresh_steps=0)


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5])
def test_bad_stale_plain_floor_is_a_value_error_naming_it(bad):
    with pytest.raises(ValueError, match="stale_plain_floor"):
        ControllerConfig(stale_plain_floor=bad)
    with pytest.raises(ValueError, match="stale_plain_floor"):
        ControllerConfig().with_settings([f"stale_plain_floor={bad}"])


def test_a_plain_trial_ends_when_the_batch_changes_step_path():
    """A plain trial measures its own path's plain steps while they run: when the batch takes
    the other path meanwhile, the trial ends there (its decision state restored), instead of
    resuming hundreds of decisions later and restoring a dwell from then (review of the
    thirty-sixth session's step paths)."""
    from test_budget_controller import path_for
    from treeverify.engine.budget_controller import FAST, GENERAL
    from treeverify.engine.plain_trials import PLAIN_TRIAL_PATIENCE

    ctl = calibrated({**CALIBRATED, 0: 2.0}, min_dwell=4)  # plain overstated (a stall)
    ctl.current, ctl.since_switch = 4, 9
    ctl.observe_round("r", 16, path_for(NOTHING, 16))
    ctl.observe_step(1, 4, 1.3)
    for _ in range(4 * PLAIN_TRIAL_PATIENCE):
        ctl.choose(["r"], FAST)
    fast_trials = ctl.paths[FAST].plain_trials
    assert fast_trials.running
    saved = fast_trials.trial.since_switch
    ctl.choose(["r"], GENERAL)  # a sampled request joined: the other path's table
    assert not fast_trials.running
    assert ctl.since_switch == saved + 1  # the trial's state restored, then this decision
    for _ in range(50):
        b = ctl.choose(["r"], GENERAL)
        if b:
            ctl.observe_round("r", b, path_for(NOTHING, b))
    before = ctl.since_switch
    ctl.choose(["r"], FAST)
    assert not fast_trials.running and ctl.since_switch == before + 1


def test_a_burst_of_slow_plain_steps_is_tried_again_and_left():
    """On the H100 (869825f) bursts of 10-30 slow host steps (1-2.5 ms for 0.18) filled plain
    decoding's cost window while the DFlash engine decoded sampled prose plainly: its median
    went to 0.5-1.7 ms, the rounds looked better, and at more than twice the true cost no plain
    trial was weighed in (`stale_plain_floor`): no plain step in five passes, 0.51x plain. The
    lowest median plain decoding held (1.0 here) now weighs a trial in, and the trial's steps
    replace the burst's window. (A burst longer than the hold at plain decoding, BURST_RETRY
    decisions, still sends it to the rounds: the trials bring it back.)"""
    ctl = calibrated(min_dwell=4)
    burst = range(40, 110)
    chosen = serve(ctl, CALIBRATED, 700, NOTHING, burst=burst, slow=8.0)
    assert chosen[20:40].count(0) == 20  # plain decoding before the burst
    assert chosen[40:75].count(0) >= 34  # held at plain decoding through the hold's span
    assert chosen[75:110].count(0) <= 25  # the burst, past the hold, sent it to the rounds
    assert chosen[400:].count(0) >= 0.95 * 300 and ctl.current == 0  # and it came back
    assert ctl.cost.estimate(1, 0) == pytest.approx(1.0)
    assert ctl.cost.best[(1, 0)] == pytest.approx(1.0)
    # the weighing before this change (no lowest median: the floor alone), by hand: the
    # burst's median at half itself loses to the rounds, so no trial would run
    assert 1 / (0.5 * 8.0) < 1 / 1.3


def test_a_trial_restarts_its_entry_so_its_steps_set_the_median():
    m = CostModel(window=9)
    for _ in range(9):
        m.observe(1, 0, 8.0, at=1)  # a burst's full window
    m.restart(1, 0)
    assert m.estimate(1, 0) == pytest.approx(8.0)  # nothing measured yet: the old median
    for _ in range(3):
        m.observe(1, 0, 1.0, at=2)
    assert m.estimate(1, 0) == pytest.approx(1.0)  # three steps outvote the one kept sample
    m.restart(1, 16)  # an entry never measured: nothing to cut
    assert m.estimate(1, 16) is None
    frozen = CostModel.given({0: 1.0})
    frozen.restart(1, 0)
    assert frozen.estimate(1, 0) == 1.0 and frozen.best[(1, 0)] == 1.0


@pytest.mark.parametrize("burst", [range(20, 30), range(20, 40)])
def test_a_burst_at_a_round_bucket_is_tried_again(burst):
    """A burst while at the best bucket (8 here: 3 tokens per 1.3 against 16's 4 per 1.9)
    overstates its cost, the controller moves up to 16, and no cost trial looks down from
    there (their bound comes from fresh smaller buckets): before, it stayed at 16 for the
    remaining 3000 decisions (a helper's review of aecf875). A stale cost at BURST_FACTOR x the
    lowest median its entry held is weighed at that median: 8 is tried and wins again."""
    ctl = calibrated(min_dwell=8, explore_every=16, explore_max=256)
    chosen = serve(ctl, CALIBRATED, 3000, ACCEPTED, burst=burst, slow=8.0)
    tail = chosen[1000:]
    assert tail.count(8) > 0.8 * len(tail), {b: tail.count(b) for b in BUCKETS}
    assert ctl.cost.estimate(1, 8) == pytest.approx(1.3)


def test_a_new_step_path_keeps_no_lowest_median_of_the_fast_path():
    """A path first seen starts from a stale copy of the fast path's medians but not of their
    lowest values: the general path's plain steps cost ~3x the fast path's, and a borrowed
    lowest median weighed its plain trials as if plain decoding cost a third of itself."""
    m = CostModel(window=3)
    m.observe(1, 0, 0.2, at=1)
    copy = m.stale_copy()
    assert copy.estimate(1, 0) == pytest.approx(0.2) and copy.best == {}
    copy.observe(1, 0, 0.69, at=2)  # its own steps: the lowest median is theirs (with the
    assert copy.best[(1, 0)] == pytest.approx(0.445)  # copied sample in the window), not 0.2


def test_plain_decoding_holds_through_a_burst():
    """A burst raises the cost of what runs, here plain decoding, not of the rounds it is
    compared with: the controller left plain decoding for rounds that then cost the burst's
    factor too. At plain decoding an overstated cost holds the decision for BURST_RETRY
    decisions (`BurstHold`, engine/cost_bursts.py): through a 15-step burst, no switch to the
    rounds."""
    ctl = calibrated(min_dwell=4)
    chosen = serve(ctl, CALIBRATED, 200, NOTHING, burst=range(60, 75), slow=8.0)
    assert chosen[20:60].count(0) >= 38 and ctl.current == 0
    assert ctl.switches <= 1  # the start's (the top, then plain), none at the burst
    assert chosen[60:120].count(0) >= 57  # a probe or two at most
    assert ctl.info()["burst_holds"] > 0  # /server_info, /metrics: what held it
    ctl.reset()
    assert ctl.info()["burst_holds"] == 0
    m = CostModel(window=3)
    for s in (1.0, 1.0, 4.0, 4.0):
        m.observe(1, 0, s)
    assert m.overstated_entries() == {"1:0": 4.0}  # /server_info's overstated_costs


def test_a_lasting_rise_of_plain_decodings_cost_is_tried_ever_less_often():
    """A plain step that really got dearer (a long context) stays overstated against its
    lowest median: the trials of an overstated cost back off (32, 64, ... decisions, up to the
    freshness window), so rounds that now win are not cut by a plain trial every 32 decisions
    for good, and a rise that ends is seen within a window."""
    ctl = calibrated(min_dwell=4)
    dear = {**CALIBRATED, 0: 4.0}  # plain 4x from here on: a round (1 per 1.3) wins
    serve(ctl, CALIBRATED, 100, NOTHING)  # at plain decoding
    chosen = serve(ctl, dear, 3000, NOTHING)
    assert chosen[:30].count(0) >= 28  # held: maybe a burst
    starts = plain_trials(chosen[60:])  # in the rounds since: the trials of plain decoding
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert 8 <= len(starts) <= 16, starts  # 32, 64, 128, then one a window (256)
    assert gaps[1] >= 1.8 * gaps[0] and gaps[2] >= 1.8 * gaps[1], gaps
    assert all(240 <= g <= 300 for g in gaps[4:]), gaps
    assert chosen[1000:].count(0) <= 0.04 * 2000


def test_the_hold_is_not_left_by_a_cost_trial_to_a_bucket_a_burst_overstated():
    """An earlier long burst left the round buckets' costs overstated; in a later short burst
    at plain decoding a cost trial weighed them at their lowest medians against the burst's
    plain rate and left plain decoding inside the hold (a helper's review: 3-8% over all-plain
    decoding in this replay). During the hold such buckets get no trial."""
    ctl = calibrated(min_dwell=4)
    serve(ctl, CALIBRATED, 1000, NOTHING, burst=range(40, 110), slow=8.0)
    assert ctl.current == 0 and ctl.cost.overstated(1, 4)  # the earlier burst's leftovers
    for _ in range(3):
        switches = ctl.switches
        chosen = serve(ctl, CALIBRATED, 300, NOTHING, burst=range(60, 75), slow=8.0)
        assert chosen[60:120].count(0) >= 58 and ctl.switches == switches


@pytest.mark.parametrize("steady", [0, 8])
def test_trials_wait_for_a_batch_size_that_holds(steady):
    """`trial_steady_batch`: a batch size that changes every few decisions (a draining group's
    tail) gets no cost trial until one size has held that long; once it holds, the trial comes
    as before (the same overstated 16 as test_an_overstated_stale_cost_is_tried_and_replaced)."""
    true = {**CALIBRATED, 16: 1.32}
    ctl = calibrated(min_dwell=4, trial_steady_batch=steady)
    run, last = 0, None
    for i in range(60):  # one request, then two, in turns every 4 decisions
        ids = ["r"] if (i // 4) % 2 == 0 else ["r", "q"]
        b = ctl.choose(ids)
        for rid in ids:
            if b:
                ctl.observe_round(rid, b, path_for(ACCEPTED, b))
        run, last = (run + 1 if (b, len(ids)) == last else 1), (b, len(ids))
        if run >= 3:  # a steady step's cost, as serve() feeds them (two requests: 20% more)
            ctl.observe_step(len(ids), b, true[b] * (1.0 + 0.2 * (len(ids) - 1)))
    assert (ctl.cost_trials == 0) == bool(steady), ctl.cost_trials
    serve(ctl, true, 100)  # one request from now on: the size holds
    assert ctl.cost_trials >= 1
    with pytest.raises(ValueError, match="trial_steady_batch"):
        ControllerConfig(trial_steady_batch=-1)


def _serve_batch(ctl: BudgetController, ids: list[str], steps: int) -> list[int]:
    """`steps` decisions for the requests `ids` (rounds accept 1 draft: 2 tokens per 1.3,
    within 2x plain's 1 per 1.0), steady steps feeding back the true cost at len(ids)."""
    chosen, run, last = [], 0, None
    for _ in range(steps):
        b = ctl.choose(ids)
        chosen.append(b)
        if b:
            for r in ids:
                ctl.observe_round(r, b, path_for({4: 1, 8: 1, 16: 1}, b))
        run, last = (run + 1 if b == last else 1), b
        if run >= 3:
            ctl.observe_step(len(ids), b, CALIBRATED[b])
    return chosen


@pytest.mark.parametrize("per_batch", [False, True], ids=["engine", "per-batch-size"])
def test_a_plain_trial_answers_for_every_batch_size(per_batch):
    """A group's draining tail (3 requests, then 2: batch sizes without a plain cost of their
    own, derived from calibration's size 1) had a trial at each size. A derived estimate waits
    out the engine's last trial: after a trial at 3 requests, 2 requests get none within the
    gap; with `plain_trials_per_batch` (as before) they get their own. A size with its own cost
    (1: calibration's) keeps its own spacing."""
    ctl = calibrated(min_dwell=4, cost_fresh_steps=100, plain_trials_per_batch=per_batch)
    chosen = _serve_batch(ctl, ["a", "b", "c"], 60)
    (start,) = plain_trials(chosen)  # the first trial, at 3 requests
    assert chosen[start : start + PLAIN_TRIAL_STEPS] == [0] * PLAIN_TRIAL_STEPS
    later = _serve_batch(ctl, ["a", "b"], 40)  # within 100 decisions of that trial
    assert (plain_trials([4] + later) != []) == per_batch, later
    alone = _serve_batch(ctl, ["a"], 30)  # size 1: calibrated, stale, its own spacing
    assert plain_trials([4] + alone) != [], alone
