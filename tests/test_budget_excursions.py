"""engine/budget_excursions.py: what a round entered from plain decoding and left at once costs
beyond two plain steps (a probe's real price, /server_info's `excursion_extra_seconds`), from
every decode step's wall time; and the engine feeding it every step."""

from __future__ import annotations

import random

import pytest

from treeverify.engine.budget_excursions import Excursions
from treeverify.engine.llm import LLM
from treeverify.engine.sampling_params import SamplingParams


def test_a_plain_round_plain_pattern_is_priced_beyond_two_plain_steps():
    ex = Excursions()
    plain = 0.25e-3
    for _ in range(3):
        ex.observe(8, 0, plain, plain)
    ex.observe(8, 64, 2.0e-3, plain)  # the probe's round, read first
    assert ex.extra(8) is None  # not priced until the step after it is seen
    ex.observe(8, 0, 0.6e-3, plain)  # the plain step after it, read first
    assert ex.extra(8) == pytest.approx(2.0e-3 + 0.6e-3 - 2 * plain)
    assert ex.count == 1 and ex.info() == {8: pytest.approx(2.1e-3)}


def test_only_a_round_between_plain_steps_of_the_same_batch_counts():
    ex, plain = Excursions(), 1e-3
    ex.observe(1, 16, 5e-3, plain)  # a round with no plain step before it
    ex.observe(1, 0, 1e-3, plain)
    ex.observe(1, 16, 5e-3, plain)
    ex.observe(1, 16, 5e-3, plain)  # two rounds in a row: a switch, not an excursion
    ex.observe(1, 0, 1e-3, plain)
    ex.observe(1, 8, 5e-3, plain)
    ex.observe(1, None, 1e-3, plain)  # a prefill joined: not comparable
    ex.observe(2, 8, 5e-3, plain)  # after a mixed step nothing was plain before it
    ex.observe(2, 0, 1e-3, plain)
    ex.observe(2, 8, 5e-3, plain)
    ex.observe(3, 0, 1e-3, plain)  # the batch changed during it
    ex.observe(3, 8, 5e-3, None)
    ex.observe(3, 0, 1e-3, None)  # plain's cost unknown yet: nothing priced
    assert ex.count == 0 and ex.extra(1) is None and ex.info() == {}


def test_a_batch_size_without_a_price_takes_the_largest_one_below():
    """Batch sizes move with a server's traffic: a size with no excursion of its own is priced
    at the largest size below it that has one (an underestimate: probes spaced no further than
    measured), and sizes below every measured one have no price."""
    ex, plain = Excursions(), 1.0
    for n, extra in ((2, 1.0), (6, 3.0)):
        ex.observe(n, 0, plain, plain)
        ex.observe(n, 8, plain + extra, plain)
        ex.observe(n, 0, plain, plain)
    assert ex.extra(2) == pytest.approx(1.0) and ex.extra(6) == pytest.approx(3.0)
    assert ex.extra(4) == pytest.approx(1.0) and ex.extra(8) == pytest.approx(3.0)
    assert ex.extra(1) is None
    assert ex.info() == {2: pytest.approx(1.0), 6: pytest.approx(3.0)}  # only what was measured


def test_the_price_is_the_median_of_the_last_few():
    ex, plain = Excursions(), 1.0
    for extra in (1.0, 9.0, 2.0, 3.0, 100.0, 4.0, 5.0):  # seconds beyond two plain steps
        ex.observe(1, 0, plain, plain)
        ex.observe(1, 4, plain + extra, plain)
        ex.observe(1, 0, plain, plain)
    assert ex.count == 7
    assert ex.extra(1) == pytest.approx(4.0)  # median of the last KEEP = 5: 2, 3, 100, 4, 5


def test_the_engine_reports_every_steps_wall_to_it():
    """A real CPU engine at plain decoding with probes every few decisions: each probe from
    plain decoding and back is priced, and /server_info shows it by batch size."""
    seed = random.randrange(1 << 30)
    llm = LLM("tiny-llama", speculative_algorithm="DDTREE", speculative_ddtree_budget=16,
              speculative_num_draft_tokens=6,
              speculative_cost_seconds={0: 1e-4, 4: 1.0, 8: 1.0, 16: 1.0},
              speculative_controller=("explore_every=4", "explore_max=8"))  # fmt: skip
    ctl = llm.controller
    sp = SamplingParams(temperature=1.0, seed=seed, max_tokens=60, ignore_eos=True)
    llm.generate(["the quick brown fox"], sp)
    probes_from_plain = [e for e in ctl.events.since(0) if e["kind"] == "probe" and e["from"] == 0]
    assert probes_from_plain, f"seed {seed}: no probe ran"
    assert ctl.excursions.count >= 1, seed
    info = llm.spec_stats["adaptive"]["excursion_extra_seconds"]
    assert set(info) == {"1"} and info["1"] >= 0.0, (seed, info)


def test_a_probe_chosen_but_never_run_is_not_priced(monkeypatch):
    """Pages short at every round (no bucket holds it, nothing drafted): the controller still
    chooses probes from plain decoding, but those steps decode plainly, so no excursion is
    priced (a phantom one read as a round costing a plain step dragged the median down: a
    helper's review)."""
    llm = LLM("tiny-llama", speculative_algorithm="DDTREE", speculative_ddtree_budget=16,
              speculative_num_draft_tokens=6,
              speculative_cost_seconds={0: 1e-4, 4: 1.0, 8: 1.0, 16: 1.0},
              speculative_controller=("explore_every=4", "explore_max=8"))  # fmt: skip
    ctl = llm.controller
    bucket_for, draft_batch = llm.rounds.bucket_for, llm.spec.draft_batch

    def short(real):  # once at plain decoding, no round finds its pages
        return lambda *a, **k: None if ctl.switches else real(*a, **k)

    monkeypatch.setattr(llm.rounds, "bucket_for", short(bucket_for))
    monkeypatch.setattr(llm.spec, "draft_batch", short(draft_batch))
    sp = SamplingParams(temperature=1.0, seed=random.randrange(1 << 30), max_tokens=60,
                        ignore_eos=True)  # fmt: skip
    llm.generate(["the quick brown fox"], sp)
    probes = [e for e in ctl.events.since(0) if e["kind"] == "probe" and e["from"] == 0]
    assert probes, ctl.events.since(0)  # chosen from plain decoding ...
    # ... and never run (the one round: the first decision's, at the top)
    assert llm.spec.stats.rounds <= 1
    assert ctl.excursions.count == 0 and ctl.excursions.info() == {}


def test_probes_from_plain_decoding_are_spaced_by_the_price_from_the_gate_on():
    """ControllerConfig.excursion_min_batch: from plain decoding with at least that many
    requests, a probe is due after the interval times (the probe's steady cost + the measured
    excursion extra) / plain's cost; below the gate, or with no price yet, the steady ratio as
    before; 0 never (the default is 2). Values that make no sense name the knob."""
    from treeverify.engine.budget_controller import BudgetController, ControllerConfig, CostModel

    costs = {0: 1.0, 4: 2.0, 8: 3.0}

    def ctl(gate: int) -> BudgetController:
        c = BudgetController((0, 4, 8), CostModel.given(costs),
                             ControllerConfig(excursion_min_batch=gate))  # fmt: skip
        for _ in range(4):  # an excursion at 8 requests: 3 + 1 - 2 x 1 = 2 beyond two plain
            c.excursions.observe(8, 0, 1.0, 1.0)
        c.excursions.observe(8, 8, 3.0, 1.0)
        c.excursions.observe(8, 0, 1.0, 1.0)
        assert c.excursions.extra(8) == pytest.approx(2.0)
        c.current = 0  # at plain decoding (a controller starts at its largest bucket)
        assert c.probes.interval == 16
        return c

    def first_due(c: BudgetController, n: int) -> int:
        for since in range(1, 400):
            c.probes.since = since
            if c.probes.due(c, n, 8):
                return since
        raise AssertionError("never due")

    assert first_due(ctl(0), 8) == 48  # 16 x 3 / 1: the steady table
    assert first_due(ctl(4), 8) == 80  # 16 x (3 + 2) / 1: the price
    assert first_due(ctl(4), 2) == 48  # below the gate (and no price measured at 2 anyway)
    assert first_due(ctl(9), 8) == 48
    assert ControllerConfig().excursion_min_batch == 2
    with pytest.raises(ValueError, match="excursion_min_batch"):
        ControllerConfig(excursion_min_batch=-1)
    # as a server sets it (--speculative-controller KNOB=VALUE): the knob and the type named
    assert ControllerConfig().with_settings(["excursion_min_batch=0"]).excursion_min_batch == 0
    with pytest.raises(ValueError, match="excursion_min_batch: expected an integer, got 'two'"):
        ControllerConfig().with_settings(["excursion_min_batch=two"])
