"""`ControllerConfig.plain_quiet`: at plain decoding with the same requests, the decisions
between full ones return 0 on counters alone (engine/budget_controller.py `_open_quiet`,
`_quiet_decision`): the same budgets, probes and probe steps as the default, fewer full
decisions; a stretch ends at once on other requests or a round."""

from __future__ import annotations

import pytest

from test_budget_controller import synthetic
from treeverify.engine.budget_controller import ControllerConfig


def _plain_run(quiet: int, decisions: int, explore: int = 16):
    """Two requests the drafter never predicts, at fixed costs: (the budgets chosen, the
    decision indices of full decisions, the events as (step, kind, from, to))."""
    ctl = synthetic({0: 1e-4, 4: 3e-4, 8: 3.5e-4, 16: 4e-4}, plain_quiet=quiet,
                    explore_every=explore, explore_max=8 * explore)  # fmt: skip
    ids = ["a", "b"]
    full = []
    real = ctl._decide
    ctl._decide = lambda rids: full.append(ctl.step_index) or real(rids)
    chosen = []
    for _ in range(decisions):
        b = ctl.choose(ids)
        chosen.append(b)
        if b:
            for rid in ids:
                ctl.observe_round(rid, b, [0])  # nothing accepted
    events = [(e["step"], e["kind"], e["from"], e["to"]) for e in ctl.events.since(0)]
    return chosen, full, events, ctl


@pytest.mark.parametrize("quiet", [8, 16, 32])
def test_plain_quiet_makes_the_same_decisions_with_fewer_full_ones(quiet):
    """plain_quiet: at plain decoding the decisions between full ones return 0 on counters
    alone, ended before a probe falls due (fixed costs here: exactly when) and before a fade;
    the budgets, the probes and their steps are the default's, the full decisions fewer."""
    base, base_full, base_events, _ = _plain_run(0, 400)
    chosen, full, events, ctl = _plain_run(quiet, 400)
    assert 0 in base and any(base)  # plain decoding with probes in between
    assert chosen == base
    assert events == base_events
    assert len(full) < len(base_full) * 0.75, (len(full), len(base_full))
    assert ctl.probes.since >= 0 and ctl.steps_by_budget[0] == base.count(0)


def test_plain_quiet_decides_at_once_for_other_requests_and_after_a_round():
    """A request joining (other ids) or a round observed ends the quiet stretch: that
    decision is a full one."""
    chosen, full, _, ctl = _plain_run(16, 40, explore=10_000)
    assert chosen[-1] == 0 and ctl._quiet_left > 0
    n = len(full)
    ctl.choose(["a", "b", "c"])
    assert len(full) == n + 1
    ctl.choose(["a", "b", "c"])  # a quiet stretch may start again after it
    ctl.observe_round("a", 16, [0, 1, 2])  # a probe's round: the rates move
    before = len(full)
    ctl.choose(["a", "b", "c"])
    assert len(full) == before + 1


def test_plain_quiet_names_itself_when_wrong():
    with pytest.raises(ValueError, match="plain_quiet"):
        ControllerConfig(plain_quiet=-1)
    with pytest.raises(ValueError, match="plain_quiet"):
        ControllerConfig(plain_quiet=4)  # no fewer full decisions than without it
    with pytest.raises(ValueError, match="plain_quiet"):
        ControllerConfig(plain_quiet=65)
