"""Startup for the adaptive budget: which engines get a controller, and the cost curve measured
on this device before the first request (decode steps of one request at every bucket in turn,
pass after pass, through the same step loop, graphs and drafter that serving uses)."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from treeverify.engine.budget_controller import CLOCKS, BudgetController, CostModel
from treeverify.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from treeverify.engine.config import EngineConfig
    from treeverify.engine.llm import LLM

WARM_PASSES = 2  # passes over every bucket untimed: one-time allocations, clocks ramping up
TIMED_PASSES = 5  # then this many passes, each bucket one step per pass: the median per bucket


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
    table (batch size 1; other sizes borrow its shape until measured) and returns it.

    The buckets are timed interleaved (one step at each bucket, pass after pass, through the
    serving step loop), not one bucket after the other: a drift during calibration (GPU clocks
    ramping up from idle after graph capture, a neighbour on a shared CPU) then lands on every
    bucket alike. Timed one bucket after the other (before 2026-12-01), the table put budget 16
    at 2.49 ms on the H200 while a fixed budget-16 engine's rounds took ~1.6 ms, and the
    controller, believing it, ran budgets 0 and 64 and never 16."""
    ctl = llm.controller
    if ctl.cost.frozen:  # a given curve
        return {b: ctl.cost.estimate(1, b) for b in ctl.buckets}
    vocab = llm.vocab_size
    prompt = [(7 * i + 3) % vocab for i in range(prompt_len)]
    top = ctl.buckets[-1]
    room = llm.model_config.max_position_embeddings - prompt_len - top - 2  # positions left
    params = SamplingParams(temperature=0, max_tokens=max(1, min(4 * (top + 2), room)),
                            ignore_eos=True)  # fmt: skip
    times: dict[int, list[float]] = {b: [] for b in ctl.buckets}
    seq, requests = None, 0
    for timed in [False] * WARM_PASSES + [True] * TIMED_PASSES:
        for budget in ctl.buckets:
            for _ in range(3):  # a new request's first step is its prefill: step again
                if seq is None or seq.is_finished:
                    if seq is not None:
                        llm.output(seq)  # drops its logprob bookkeeping
                    seq = llm.add_request(prompt, params, request_id=f"calibrate-{requests}")
                    requests += 1
                ctl.pinned = budget
                t0 = ctl.clock()
                llm.step()
                seconds = ctl.clock() - t0
                if llm._step_budget == budget:  # a decode-only step at this budget
                    if timed:
                        times[budget].append(seconds)
                    break
    if seq is not None:
        if not seq.is_finished:
            llm.abort(seq.request_id)
        llm.output(seq)
    ctl.pinned = None
    per_bucket = {b: statistics.median(t) for b, t in times.items() if t}
    ctl.cost.clear()  # the steps above fed it warm-up steps too
    for budget, seconds in per_bucket.items():
        ctl.observe_step(1, budget, seconds)
    ctl.reset()
    llm.spec.reset_stats()
    llm._next_id = 0
    llm.startup["budget_cost_seconds"] = {str(b): round(s, 6) for b, s in per_bucket.items()}
    return per_bucket
