"""scripts/sim_adaptive.py: the replay's accounting, and the tuned controller on the recorded
tiny-code traces (bench_results/2026-12-01-cpu-accept_traces-tiny-code.json) at the H200's step
costs: within reach of the best fixed budget on code and prose, near plain decoding on text no
drafter predicts. A change to the controller that loses this shows here, on the CPU, before any
GPU run."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest

from treeverify.engine.budget_config import ControllerConfig
from treeverify.engine.budget_controller import BudgetController, CostModel, budget_buckets

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "bench_results" / "2026-12-01-cpu-accept_traces-tiny-code.json"


def _script(name: str):
    """scripts/<name>.py loaded as a module (the replay scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(f"_{name}", ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def sim():
    return _script("sim_adaptive")


def test_cut_and_fixed_budget_accounting(sim):
    assert sim.cut([0, 1, 3, 7, 20], 4) == [0, 1, 3]
    assert sim.cut([0, 1, 3, 7, 20], 64) == [0, 1, 3, 7, 20]
    rng = random.Random()
    n = rng.randrange(2, 6)  # every round at budget >= n - 1 accepts n - 1 drafts
    traces = [{"paths": [list(range(n))] * 300}]
    costs = {0: 1.0, 4: 2.0, 8: 2.5}
    fixed = sim.replay(traces, 100, costs, 8)
    rounds = -(-100 // n)
    assert fixed["rounds"] == rounds and fixed["tokens"] == rounds * n
    assert fixed["seconds"] == pytest.approx(2.5 * rounds)
    plain = sim.replay(traces, 100, costs, 0)
    assert plain["tokens"] == 100 and plain["seconds"] == pytest.approx(100.0)


def test_tuned_controller_on_recorded_traces(sim):
    data = json.loads(TRACES.read_text())
    costs, buckets = sim.H200_COSTS, budget_buckets(64)
    data["texts"]["unpredictable"] = sim.unpredictable(128)
    for text, traces in data["texts"].items():
        plain = sim.replay(traces, 128, costs, 0)["tokens_per_s"]
        best = max(sim.replay(traces, 128, costs, b)["tokens_per_s"] for b in buckets)
        ctl = BudgetController(buckets, CostModel.given(costs))
        got = sim.replay(traces, 128, costs, ctl)["tokens_per_s"]
        assert got >= 0.95 * plain, text  # never (much) below plain decoding
        assert got >= 0.85 * best, (text, got / best)  # replayed 0.89-0.98 at tuning time


def test_batched_replay_accounting_and_the_batch8_table(sim):
    """--batch: a group of requests steps together at one budget, each step costing the batch's
    curve (interpolated as the engine's CostModel does), the batch shrinking as requests finish;
    on the recorded traces with the H200's measured batch-8 curve (bc73abd: a budget-16 round
    3.5x a plain step), plain decoding is the best fixed budget and the controller stays near
    it (>= 0.95x)."""
    traces = [{"paths": [[0, 1, 2]] * 100}, {"paths": [[0, 1, 2]] * 100}, {"paths": [[0]] * 100}]
    model = sim.table({1: {0: 1.0, 4: 2.0}, 2: {0: 1.5, 4: 3.0}})
    got = sim.replay_batch(traces, 9, model, 4, batch=2)
    # group 1: two requests, 3 tokens a round: 3 steps of 2 (3.0 s each); group 2: one request,
    # 1 token a round: 9 steps of 1 (2.0 s each)
    assert got["steps_by_budget"] == {4: 12} and got["rounds"] == 6 + 9
    assert got["seconds"] == pytest.approx(3 * 3.0 + 9 * 2.0) and got["tokens"] == 27
    data = json.loads(TRACES.read_text())["texts"]
    one = {0: 0.465e-3, 4: 1.101e-3, 8: 1.049e-3, 16: 1.075e-3, 32: 1.205e-3, 64: 1.014e-3}
    eight = {0: 0.437e-3, 4: 1.463e-3, 8: 1.42e-3, 16: 1.518e-3, 32: 1.536e-3, 64: 2.532e-3}
    buckets = budget_buckets(64)
    for text in ("code", "prose"):
        plain = sim.replay_batch(data[text], 128, sim.table({1: one, 8: eight}), 0, 8)
        ctl = BudgetController(buckets, sim.table({1: one, 8: eight}))
        got = sim.replay_batch(data[text], 128, sim.table({1: one, 8: eight}), ctl, 8)
        assert got["tokens_per_s"] >= 0.95 * plain["tokens_per_s"], text


def test_queue_replay_refills_slots_and_charges_the_prefill(sim):
    """queue=True (bench_pair --queue): a finished request's slot goes to the next prompt at
    the next step, which pays one plain step at the new batch size (its prefill); groups
    (queue=False) wait for the whole group and charge no prefill."""
    traces = [{"paths": [[0, 1, 2]] * 100}, {"paths": [[0]] * 100}, {"paths": [[0, 1, 2]] * 100}]
    model = sim.table({1: {0: 1.0, 4: 2.0}, 2: {0: 1.5, 4: 3.0}})
    got = sim.replay_batch(traces, 6, model, 4, batch=2, queue=True)
    # steps 1-2: r0 (3 a round) and r1 (1): r0 done after 2 steps, r2 joins (prefill 1.5 s);
    # steps 3-4: r1 and r2, r2 done after 2; steps 5-6: r1 alone (2.0 s each), done at 6
    assert got["steps_by_budget"] == {4: 6} and got["tokens"] == 18
    assert got["seconds"] == pytest.approx(4 * 3.0 + 1.5 + 2 * 2.0)
    grouped = sim.replay_batch(traces, 6, model, 4, batch=2)
    # group 1: r0 and r1 for 6 steps (r0 done after 2); group 2: r2 alone, 2 steps
    assert grouped["steps_by_budget"] == {4: 8}
    assert grouped["seconds"] == pytest.approx(2 * 3.0 + 4 * 2.0 + 2 * 2.0)


def test_ceilings_bound_the_fixed_budgets_and_see_the_future(sim):
    """The ceilings' oracles: per request at its best fixed budget, at least every fixed budget
    (on these traces, whose requests commit ~128 tokens each); per step at the round's best
    budget, on a trace that alternates easy and hard positions, above any fixed budget."""
    costs = {0: 1.0, 4: 2.0, 16: 2.2}
    data = json.loads(TRACES.read_text())["texts"]["code"]
    got = sim.ceilings(data, 128, costs)
    for b in costs:
        assert got["per_request_best_fixed"] >= sim.replay(data, 128, costs, b)["tokens_per_s"]
    easy, hard = [0, 1, 2, 3, 5, 8, 13, 15], [0]  # 8 tokens at 16 (4 at 4); the root alone
    traces = [{"paths": [easy if i % 9 == 0 else hard for i in range(400)]}]
    oracle = sim.ceilings(traces, 128, costs)["per_step_oracle"]
    assert oracle > 1.2 * max(sim.replay(traces, 128, costs, b)["tokens_per_s"] for b in costs)


def test_a_switch_between_plain_and_rounds_costs_its_read_first_step(sim):
    """replay's switch_seconds: added once per plain <-> rounds change of path, not per
    change of budget between rounds (both launched ahead)."""
    traces = [{"paths": [[0, 1]] * 50}]
    costs = {0: 1.0, 4: 2.0, 8: 2.5}
    budgets = [0, 4, 8]  # plain, 4, 8, plain, ...: two changes of path per three steps
    free = sim.replay(traces, 30, costs, 4)
    charged = sim.replay(traces, 30, costs, 4, switch_seconds=0.5)
    assert charged["seconds"] == free["seconds"]  # one budget throughout: nothing charged
    ctl = BudgetController(budget_buckets(8), CostModel.given(costs))
    seq = [budgets[i % 3] for i in range(200)]
    it = iter(seq)
    ctl.choose = lambda ids: next(it)  # a scripted policy through the controller's interface
    got = sim.replay(traces, 30, costs, ctl, switch_seconds=0.5)
    steps = sum(got["steps_by_budget"].values())
    changes = sum((a == 0) != (b == 0) for a, b in zip(seq[: steps - 1], seq[1:steps], strict=True))
    base = sum(costs[b] for b in seq[:steps])
    assert changes > 0 and got["seconds"] == pytest.approx(base + 0.5 * changes)


def test_suite_of_trace_sets_at_the_defaults():
    """scripts/sim_adaptive_suite.py: today's defaults on the three trace sets the rule was
    tuned on and the four tuned cost tables (switches charged at the newest): at the best fixed
    budget on predictable text (0.989-1.002 when plain_margin was chosen), near plain decoding
    on unpredictable text, and back to speculation soon when code follows unpredictable text.
    The shipped drafter's traces (set 4) at the H200's table, reported apart: within 2% of the
    best fixed budget (0.990 / 0.989 when recorded); groups of 8 in turns at the H200's b=1 / b=8
    costs: an unpredictable group after a code group at plain decoding's speed (1.000x when
    new_batch_at_once was chosen)."""
    mod = _script("sim_adaptive_suite")
    from treeverify.engine.budget_config import ControllerConfig

    res = mod.evaluate(ControllerConfig())
    assert res["min_of_best_fixed"] >= 0.97, res["rows"]
    assert res["mean_of_best_fixed"] >= 0.985, res["rows"]
    assert res["unpredictable_min"] >= 0.95, res["rows"]
    # code after unpredictable text: probes from plain alternate the best-rated bucket and the
    # top (1.44x plain when chosen; 1.27x probing the top every time)
    assert res["rows"]["plain0.20 sequence2"] >= 1.35, res["rows"]
    assert min(res["set4_h200"].values()) >= 0.98, res["set4_h200"]
    # the drafter shipped since 96071ab (set 5), never tuned on: >= 0.98 at every table (0.988)
    assert res["set5_min_of_best_fixed"] >= 0.98, res["rows"]
    assert res["rows"]["groups b=8 3 unpredictable"] >= 0.98, res["rows"]
    # each plain <-> rounds switch charged as measured at b=8: the first unpredictable group
    # (probes while its class has no rounds yet) pays for them, 0.88x when recorded (the H100
    # ran 0.87x); the code groups stay well above plain decoding
    charged, free = (
        res["rows"]["groups charged b=8 1 unpredictable"],
        res["rows"]["groups b=8 1 unpredictable"],
    )
    assert charged < free, res["rows"]
    assert res["groups_charged_code_min"] >= 1.0, res["rows"]
    old = mod.evaluate(ControllerConfig(plain_margin=0.05))  # the rule before: dips went plain
    assert old["min_of_best_fixed"] < res["min_of_best_fixed"]


def test_the_controller_recovers_from_bursts_of_slow_host_steps(tmp_path):
    """scripts/sim_bursts.py: every trace set and the unpredictable text at the H100's costs,
    bursts of 20 steps at 8x every 400 (the shape an H100 host showed, thirty-seventh session).
    Before aecf875 a burst at plain decoding locked it out: 0.40x plain on the unpredictable text
    (0.915x without bursts); now plain decoding holds through a burst and an overstated cost
    is tried at once: 0.91x. Without bursts the rows are unchanged (the suite's own guard)."""
    mod = _script("sim_bursts")
    out = tmp_path / "bursts.json"
    assert mod.main(["--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    calm, bursts = rows["no bursts"]["summary"], rows["bursts"]["summary"]
    assert calm["unpredictable"] >= 0.9 and calm["min"] >= 0.93
    assert bursts["unpredictable"] >= 0.85  # 0.40 before
    assert bursts["min"] >= 0.93 and bursts["mean"] >= 0.97


def test_the_b8_sampled_queue_replays_the_h100s_probe_cycle():
    """scripts/sim_probe_cycle.py: bench_pair's b=8 queue on sampled text, one controller over
    passes. With budget 4 accepting ~0.5 drafts (the H100's sampled class at T=1: its prior at
    ~0.65 of plain decoding's rate, over `arrival_probe_factor`) every group of arrivals restarts
    the probes' interval, the probes come every `explore_max` decisions (two a 512-decision pass,
    each ~2.3 ms at b=8) and a restart follows a probe at once, as on the H100 (fifty-fifth
    session); at ~0.3 (under the factor) one probe a pass. Each probe costs ~3% of a pass. (With
    the bar of the time, `sampled_arrival_factor` 0: at its default since the fifty-seventh
    session, 0.8, the 0.5 traces sit under it too: the test after the next.)"""
    mod = _script("sim_probe_cycle")
    traces = mod.sampled_traces(0.5, n=4, tokens=64)
    assert all(len(t["paths"]) == 128 for t in traces)
    then = ControllerConfig(sampled_arrival_factor=0.0)
    near = mod.run(then, passes=3, first=0.5)[1:]  # after the first pass
    far = mod.run(then, passes=3, first=0.3)[1:]
    assert all(r["probes"] == 2 and r["restarts"] >= 1 for r in near)
    assert any(r["restarts_after_a_probe"] for r in near)
    assert all(r["probes"] == 1 and r["restarts"] == 0 for r in far)
    assert max(r["x_plain"] for r in near) < min(r["x_plain"] for r in far) - 0.02


def test_a_stricter_bar_for_sampled_arrivals_trades_the_cycle_for_sampled_code():
    """`sampled_arrival_factor` 0.8 (the default since the fifty-seventh session; 0 before):
    steps whose requests all sample weigh the prior against plain decoding at 0.8 instead of
    0.6. The cycle is gone (one probe a pass on the sampled text, ~0.97x plain against ~0.94x),
    but under the engine-wide curve decayed per round (the default until the fifty-sixth
    session) sampled code arriving after it (a sampled request the drafter predicts) was left at
    plain decoding far longer: a smaller share of the best fixed budget than with the old bar.
    Why it stayed off then; with the curve decayed per step the trade is gone (the next tests)."""
    mod = _script("sim_probe_cycle")
    # the trade as measured before `engine_decay_per_step` became the default (with it, the
    # old bar leaves sampled code at plain decoding as long: the next test)
    old = {"engine_decay_per_step": False, "sampled_arrival_factor": 0.0}
    old_bar = mod.run(ControllerConfig(**old), passes=3, code_after=True)
    strict = mod.run(ControllerConfig(**(old | {"sampled_arrival_factor": 0.8})), passes=3,
                     code_after=True)  # fmt: skip
    assert all(r["probes"] == 1 and r["restarts"] == 0 for r in strict[1:3])
    assert min(r["x_plain"] for r in strict[1:3]) > max(r["x_plain"] for r in old_bar[1:3])
    assert strict[-1]["x_best_fixed"] < old_bar[-1]["x_best_fixed"] - 0.05


def test_the_engine_curve_decayed_per_step_is_slower_to_take_sampled_code_after_prose():
    """`engine_decay_per_step` (default since the fifty-sixth session: the engine-wide curve
    remembers ~20 steps at any batch size, not ~20 rounds, ~2.5 steps at b=8): one probe's 8
    rounds of sampled code after sampled prose move the class's curve a twentieth, not most of
    the way, so the code stays at plain decoding longer (replay: ~0.91 -> ~0.80 of the best
    fixed budget on that pass). The price of the steadier prior that b=8 queues ran faster with
    (docs/ddtree.md); the sampled text itself is no worse. Under the old 0.6 arrival bar, as
    measured then: with the 0.8 bar (the default since the fifty-seventh session) the code after
    prose reads ~0.82 of the best fixed either way (the next test)."""
    mod = _script("sim_probe_cycle")
    bar = {"sampled_arrival_factor": 0.0}  # the arrival bar of the time (measured under it)
    per_step = mod.run(ControllerConfig(**bar), passes=3, code_after=True)
    per_round = mod.run(ControllerConfig(engine_decay_per_step=False, **bar), passes=3,
                        code_after=True)  # fmt: skip
    assert per_step[-1]["x_best_fixed"] < per_round[-1]["x_best_fixed"] - 0.05
    assert min(r["x_plain"] for r in per_step[1:3]) >= min(r["x_plain"] for r in per_round[1:3])


def test_the_default_sampled_bar_ends_the_probe_cycle_at_no_cost_to_sampled_code():
    """The defaults since the fifty-seventh session (`sampled_arrival_factor` 0.8 with
    `engine_decay_per_step`): one probe a pass on the sampled text, no interval restart, faster
    than the old bar (0.6) on every steady pass, and the sampled code arriving after it at least
    the share of the best fixed budget the old bar gave it (replay: 0.937 -> 0.970x plain,
    0.803 -> 0.817 of the best fixed; on the H100 ~3 probes a pass -> ~1)."""
    mod = _script("sim_probe_cycle")
    new = mod.run(ControllerConfig(), passes=3, code_after=True)
    old = mod.run(ControllerConfig(sampled_arrival_factor=0.0), passes=3, code_after=True)
    assert all(r["probes"] == 1 and r["restarts"] == 0 for r in new[1:3])
    assert min(r["x_plain"] for r in new[1:3]) > max(r["x_plain"] for r in old[1:3])
    assert new[-1]["x_best_fixed"] >= old[-1]["x_best_fixed"]


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
def test_bad_sampled_arrival_factor_is_a_value_error_naming_it(bad):
    with pytest.raises(ValueError, match="sampled_arrival_factor"):
        ControllerConfig(sampled_arrival_factor=bad)


def test_the_sampled_bar_applies_only_where_every_request_samples():
    """`near_plain` with `sampled_arrival_factor`: a step of sampled requests only is weighed at
    it; one greedy request among them keeps `arrival_probe_factor` (a greedy arrival's chance
    of predictable text is what the default bar is for)."""
    from treeverify.engine.budget_controller import GREEDY, SAMPLED
    from treeverify.engine.budget_probes import Probes

    ctl = BudgetController((0, 4, 8), CostModel(), ControllerConfig(sampled_arrival_factor=0.8))
    rates = {0: 100.0, 4: 70.0, 8: 65.0}  # budget 4 at 0.7 of plain decoding's rate
    for rid, cls in (("a", SAMPLED), ("b", SAMPLED), ("c", GREEDY)):
        ctl.note_request(rid, cls)
    assert ctl._all_sampled(["a", "b"]) and not ctl._all_sampled(["a", "c"])
    assert not Probes.near_plain(ctl, rates, ctl._all_sampled(["a", "b"]))  # 0.7 < 0.8
    assert Probes.near_plain(ctl, rates, ctl._all_sampled(["a", "c"]))  # 0.7 >= 0.6
    off = BudgetController((0, 4, 8), CostModel(), ControllerConfig(sampled_arrival_factor=0.0))
    off.note_request("a", SAMPLED)
    assert not off._all_sampled(["a"]) and Probes.near_plain(off, rates, False)


def test_a_probe_soon_after_leaving_the_rounds_brings_b8_code_back():
    """scripts/sim_trial_backoff.py (bench_pair's b=8 queue of code, a calibrated start,
    steady steps fed back, nine passes): the controller leaves the rounds on a dip (or a new
    group's tail-dragged prior) and, with probes from plain decoding spaced by their price
    (~100 decisions at b=8), stayed plain ~100 decisions a pass. `plain_probe_after=16` probes
    on the 16th decision after such a switch: on this mix (switches charged as measured at b=8)
    839 -> 368 plain steps, 0.927 -> 0.954 of the best fixed budget. (Over the four mixes the
    mean moves less, 0.915 -> 0.922: docs/ddtree.md.)"""
    mod = _script("sim_trial_backoff")
    code = mod.code_sets()["sets 1, 4, 5, 2"]
    old = {"engine_decay_per_step": False}  # as measured before it became the default (with
    # it this mix's plain stretches are gone already: 320 plain steps, none to save)
    base = mod.run(ControllerConfig(**old), code)
    soon = mod.run(ControllerConfig(plain_probe_after=16, **old), code)
    assert soon["steps_by_budget"][0] < 0.6 * base["steps_by_budget"][0]
    mean = lambda r: sum(r["x_best_fixed"][1:]) / (len(r["x_best_fixed"]) - 1)  # noqa: E731
    assert mean(soon) > mean(base) + 0.015


def test_the_probe_soon_waits_for_two_requests_and_a_switch_of_their_own():
    """`plain_probe_after` applies from `excursion_min_batch` requests up, where a probe from
    plain decoding is spaced by its excursion's price (a single request's probes keep their
    spacing: the b=1 rows of the replay suite are unchanged by it), and to a switch the
    requests' own rounds made (a new group moved on its class's prior keeps the usual spacing:
    the suite's unpredictable group after code paid a probe it did not need)."""
    from treeverify.engine.budget_probes import Probes

    ctl = BudgetController((0, 4, 8), CostModel(), ControllerConfig(plain_probe_after=16))
    for n, at_once, soon in ((1, False, False), (8, True, False), (8, False, True)):
        ctl.current, ctl.switches, ctl.probes.soon = 8, 3, None  # not the first switch
        ctl.probes.since, ctl.since_switch, ctl._pending = 40, 100, (0, 1)  # confirmed next
        ctl._consider(0, 2.0, 1.0, 2.0, n, at_once=at_once)
        assert ctl.current == 0
        assert ctl.probes.soon == (57 if soon else None), (n, at_once)
    ctl.cost.observe(8, 0, 1e-4)
    ctl.cost.observe(8, 8, 8e-4)  # a probe at 8 prices ~8 plain steps: 16 x 8 decisions
    assert Probes._threshold(ctl.probes, ctl, 8, 8, False) == 57  # the 16th decision after
    ctl.probes.probed(ctl, False)  # the probe: the next ones spaced as before
    assert ctl.probes.soon is None and Probes._threshold(ctl.probes, ctl, 8, 8, False) > 100
    ctl.probes.soon = 60
    ctl._move("switch", 8, 8, "back to the rounds before the probe")
    assert ctl.probes.soon is None  # moot at a round budget


@pytest.mark.parametrize("bad", [-1])
def test_bad_plain_probe_after_is_a_value_error_naming_it(bad):
    with pytest.raises(ValueError, match="plain_probe_after"):
        ControllerConfig(plain_probe_after=bad)
