"""Startup for the adaptive budget: which engines get a controller, and the cost curve measured
on this device before the first request (decode steps of one request at every bucket in turn,
pass after pass, through the same step loop, graphs and drafter that serving uses)."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from treeverify.engine.budget_controller import CLOCKS, FAST, BudgetController, CostModel
from treeverify.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from treeverify.engine.config import EngineConfig
    from treeverify.engine.llm import LLM

WARM_PASSES = 2  # passes over every bucket untimed: one-time allocations, clocks ramping up
# then this many passes, each bucket one step per pass: the median per bucket. On a GPU a step
# is well under a millisecond, so fifteen samples cost next to nothing there.
TIMED_PASSES = 5
TIMED_PASSES_GPU = 15


def make_controller(config: EngineConfig) -> BudgetController | None:
    """A controller for DDTREE unless speculative_adaptive is False; CHAIN has no budget buckets.
    `speculative_cost_seconds`: a fixed cost curve (seconds per step at batch 1 for every bucket)
    instead of the one `calibrate` measures; `speculative_cost_clock`: "wall" or "process"
    (budget_controller.CLOCKS); `speculative_controller`: the controller's knobs. The values
    were validated by the config."""
    if not config.adaptive:
        return None
    costs, knobs = config.speculative_cost_seconds, config.controller_config
    if costs is None:
        ctl = BudgetController(config.budget_buckets, config=knobs)
        ctl.clock = CLOCKS[config.speculative_cost_clock]
        return ctl
    return BudgetController(config.budget_buckets, CostModel.given(dict(costs)), knobs)


def calibration_batches(llm: LLM) -> tuple[int, ...]:
    """Batch sizes `calibrate` times: 1 on the CPU; on a GPU also 8 and the largest graph bucket
    (up to max_num_seqs). A round's cost grows with batch x budget on the GPU (the verify forward
    over B x N tokens) while at batch 1 it is mostly host time and nearly flat in the budget: a
    batch-8 table borrowed from batch 1's shape put budget 32 barely above 16 and the controller
    ran 32 at batch 8 on the H200, 0.91x plain where a fixed 16 ran 1.08x (2026-12-01)."""
    cfg = llm.config
    if not cfg.on_gpu:
        return (1,)
    sizes = {1, 8, max(cfg.graph_batch_sizes)}
    return tuple(sorted(n for n in sizes if n <= cfg.max_num_seqs))


def calibrate(llm: LLM, prompt_len: int = 16,
              batch_sizes: tuple[int, ...] | None = None) -> dict[int, float]:  # fmt: skip
    """Seconds per decode step at every bucket, at each of `batch_sizes` requests decoding
    together (default `calibration_batches`); seeds the controller's cost table (other sizes
    interpolate between the measured ones) and returns batch 1's curve.

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
    per_request = prompt_len + params.max_tokens + top + 1  # KV slots a request may hold
    if per_request > llm.capacity_tokens:  # (the scheduler's error would name an internal
        # request, 'calibrate-1-0', not the knob to change)
        raise ValueError(f"num_pages: the KV pool holds {llm.capacity_tokens} tokens; measuring "
                         f"the adaptive budget's step costs needs {per_request} (one request "
                         f"at budget {top}): more pages, a smaller speculative_ddtree_budget, "
                         f"or speculative_adaptive=False")  # fmt: skip
    raw: dict[int, dict[int, float]] = {}
    passes = TIMED_PASSES_GPU if llm.config.on_gpu else TIMED_PASSES
    for n in batch_sizes or calibration_batches(llm):
        if n > 1 and 2 * n * per_request > llm.capacity_tokens:
            continue  # would not fit beside itself: leave this size to interpolation
        raw[n] = _time_buckets(llm, n, prompt, params, passes)
    measured = {n: monotone_in_budget(c) for n, c in raw.items()}
    ctl.pinned = None
    ctl.use_path(FAST)  # greedy steps: the fast path's table (its steps above took it too)
    ctl.cost.clear()  # the steps above fed it warm-up steps too
    for n, per_bucket in measured.items():
        for budget, seconds in per_bucket.items():
            ctl.observe_step(n, budget, seconds)
    ctl.reset()
    llm.spec.reset_stats()
    llm._next_id = 0
    one = measured.get(1, {})

    def table(curves: dict[int, dict[int, float]]) -> dict:
        return {str(n): {str(b): round(s, 6) for b, s in c.items()} for n, c in curves.items()}

    llm.startup["budget_cost_seconds"] = {str(b): round(s, 6) for b, s in one.items()}
    llm.startup["budget_cost_seconds_by_batch"] = table(measured)
    llm.startup["budget_cost_seconds_measured"] = table(raw)  # before monotone_in_budget
    return one


def monotone_in_budget(seconds: dict[int, float]) -> dict[int, float]:
    """The measured medians made non-decreasing in the budget (least squares: adjacent
    violators pooled to their mean), budget 0 left as measured. A larger tree is never cheaper
    (a longer verify forward, a larger tree build, the same draft), so a larger budget timed
    below a smaller one is noise, and it steers the controller: on the H200 budget 16 timed at
    0.522 ms and 32 at 0.491 made 16 look worse than both its neighbours. Plain decoding
    (budget 0) runs another path (not launched ahead) and may cost more than small rounds."""
    budgets = sorted(b for b in seconds if b > 0)
    pools: list[tuple[float, int]] = []  # (mean, budgets pooled), in budget order
    for b in budgets:
        mean, count = seconds[b], 1
        while pools and pools[-1][0] > mean:  # a violator: pool it with the run before
            m, c = pools.pop()
            mean, count = (m * c + mean * count) / (c + count), c + count
        pools.append((mean, count))
    out = {b: s for b, s in seconds.items() if b <= 0}
    order = iter(budgets)
    for mean, count in pools:
        for _ in range(count):
            out[next(order)] = mean
    return out


def _time_buckets(llm: LLM, n: int, prompt: list[int], params: SamplingParams,
                  passes: int) -> dict:  # fmt: skip
    """Median seconds of a decode-only step of n requests at each bucket (interleaved passes);
    finished requests are replaced, and steps with a prefill in them are not timed. Only a
    steady step is timed (`LLM._step_steady`): with whole rounds launched ahead
    (engine/round_graphs.py) the first step at a new budget takes the round launched at the
    old one and the second is read first; serving at a budget runs overlapped steps, the third
    on. (Timing the first step at each budget put budget 16 at its read-first 0.83 ms on the
    H200 where its overlapped rounds take ~0.65 ms, and the controller ran budget 8.)
    TREEVERIFY_CALIBRATE_RUN_BATCH=1: each step timed by the span it teaches the controller
    (`LLM.taught_seconds`: `run_batch` alone unless TREEVERIFY_COST_WHOLE_STEP=1), where the
    whole step put a stale budget 16 above a live 32 at b=8 on the H100 (~50-60 us of
    schedule and postprocess in one, not the other; docs/performance.md)."""
    ctl = llm.controller
    times: dict[int, list[float]] = {b: [] for b in ctl.buckets}
    live: list = []
    requests = 0
    for timed in [False] * WARM_PASSES + [True] * passes:
        for budget in ctl.buckets:
            for _ in range(6):  # prefills, the switch's first steps: step again
                for seq in [s for s in live if s.is_finished]:
                    llm.output(seq)  # drops its logprob bookkeeping
                    live.remove(seq)
                while len(live) < n:
                    rid = f"calibrate-{n}-{requests}"
                    live.append(llm.add_request(prompt, params, request_id=rid))
                    requests += 1
                ctl.pinned = budget
                t0 = ctl.clock()
                llm.step()
                seconds = ctl.clock() - t0
                if llm.calibrate_taught_span:  # the span a steady step teaches (one unit)
                    seconds = llm.taught_seconds
                # a decode-only step of them all at this budget, at its steady cost
                if llm._step_budget == budget and llm._step_steady:
                    if timed:
                        times[budget].append(seconds)
                    break
    for seq in live:
        if not seq.is_finished:
            llm.abort(seq.request_id)
        llm.output(seq)
    return {b: statistics.median(t) for b, t in times.items() if t}
