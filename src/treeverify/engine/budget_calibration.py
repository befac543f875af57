"""Startup for the adaptive budget: which engines get a controller, and the cost curve measured
on this device before the first request (a few timed decode steps of one request per bucket,
through the same step loop, graphs and drafter that serving uses)."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from treeverify.engine.budget_controller import CLOCKS, BudgetController, CostModel
from treeverify.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from treeverify.engine.config import EngineConfig
    from treeverify.engine.llm import LLM

WARM_STEPS = 2  # the prefill and a bucket's first decode step (one-time allocations) go untimed
TIMED_STEPS = 3  # median of these per bucket


def make_controller(config: EngineConfig) -> BudgetController | None:
    """A controller for DDTREE unless speculative_adaptive is False; CHAIN has no budget buckets.
    `speculative_cost_seconds`: a fixed cost curve (seconds per step at batch 1 for every bucket)
    instead of the one `calibrate` measures; `speculative_cost_clock`: "wall" or "process"
    (budget_controller.CLOCKS). The values were validated by the config."""
    if not config.adaptive:
        return None
    costs = config.speculative_cost_seconds
    if costs is None:
        ctl = BudgetController(config.budget_buckets)
        ctl.clock = CLOCKS[config.speculative_cost_clock]
        return ctl
    return BudgetController(config.budget_buckets, CostModel.given(dict(costs)))


def calibrate(llm: LLM, prompt_len: int = 16) -> dict[int, float]:
    """Seconds per decode step of one request at every bucket; seeds the controller's cost
    table (batch size 1; other sizes borrow its shape until measured) and returns it."""
    ctl = llm.controller
    if ctl.cost.frozen:  # a given curve
        return {b: ctl.cost.estimate(1, b) for b in ctl.buckets}
    vocab = llm.vocab_size
    prompt = [(7 * i + 3) % vocab for i in range(prompt_len)]
    per_bucket: dict[int, float] = {}
    for budget in ctl.buckets:
        ctl.pinned = budget
        params = SamplingParams(temperature=0, max_tokens=(WARM_STEPS + TIMED_STEPS + 2) *
                                (budget + 2), ignore_eos=True)  # fmt: skip
        seq = llm.add_request(prompt, params, request_id=f"calibrate-{budget}")
        times = []
        while not seq.is_finished and len(times) < WARM_STEPS + TIMED_STEPS:
            t0 = ctl.clock()
            llm.step()
            times.append(ctl.clock() - t0)
        if not seq.is_finished:
            llm.abort(seq.request_id)
        llm.output(seq)  # drops its logprob bookkeeping
        per_bucket[budget] = statistics.median(times[WARM_STEPS:] or times)
    ctl.pinned = None
    ctl.cost.clear()  # the timed steps above fed it warm-up steps too
    for budget, seconds in per_bucket.items():
        ctl.observe_step(1, budget, seconds)
    ctl.reset()
    llm.spec.reset_stats()
    llm._next_id = 0
    llm.startup["budget_cost_seconds"] = {str(b): round(s, 6) for b, s in per_bucket.items()}
    return per_bucket
