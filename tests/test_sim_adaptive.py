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

from treeverify.engine.budget_controller import BudgetController, CostModel, budget_buckets

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "bench_results" / "2026-12-01-cpu-accept_traces-tiny-code.json"


@pytest.fixture(scope="module")
def sim():
    spec = importlib.util.spec_from_file_location("_sim", ROOT / "scripts" / "sim_adaptive.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
    rng = random.Random(0)
    data["texts"]["unpredictable"] = [
        {"paths": [[0] if rng.random() > 0.1 else [0, 1] for _ in range(256)]} for _ in range(8)
    ]
    for text, traces in data["texts"].items():
        plain = sim.replay(traces, 128, costs, 0)["tokens_per_s"]
        best = max(sim.replay(traces, 128, costs, b)["tokens_per_s"] for b in buckets)
        ctl = BudgetController(buckets, CostModel.given(costs))
        got = sim.replay(traces, 128, costs, ctl)["tokens_per_s"]
        assert got >= 0.95 * plain, text  # never (much) below plain decoding
        assert got >= 0.85 * best, (text, got / best)  # replayed 0.89-0.98 at tuning time
