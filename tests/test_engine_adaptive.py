"""The adaptive tree budget in the engine (tiny-llama, n-gram drafter, CPU): it falls back to plain
decoding where drafts are never accepted, comes back up where they are, and greedy output stays
identical to plain decoding whatever budgets it picks. The cost curve is given (synthetic), not
timed, so the decisions depend on measured acceptance only."""

from __future__ import annotations

import random

import pytest

from treeverify.engine.budget_controller import SAMPLED
from treeverify.engine.llm import LLM
from treeverify.engine.sampling_params import SamplingParams

COSTS = {0: 1.0, 4: 1.2, 8: 1.3, 16: 1.5}  # seconds per step at batch 1, by budget
# what a stand-in postprocess adds to the controller's clock (not slept: a timed threshold failed
# on a loaded host): far above any real step, so a span holds it or not, whatever the host
POSTPROCESS_SECONDS = 1000.0


def adaptive_llm(**kw) -> LLM:
    return LLM("tiny-llama", speculative_algorithm="DDTREE", speculative_ddtree_budget=16,
               speculative_num_draft_tokens=6, speculative_cost_seconds=COSTS, **kw)  # fmt: skip


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ,.") for _ in range(n))


def repeating_text(rng: random.Random) -> str:
    words = rng.sample(["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"], 5)
    return " ".join(words * 8)


def in_its_loop(llm: LLM, text: str) -> list[int]:
    """The prompt plus the model's own greedy continuation: a random-weight model soon repeats
    itself, so from here on its output is predictable for the n-gram drafter."""
    ids = llm.tokenizer.encode(text)
    plain = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True, speculative=False)
    return ids + llm.generate([ids], plain)[0].token_ids


def test_falls_back_to_plain_then_comes_back_when_drafts_pay():
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")  # fresh text each run; this reproduces one
    rng = random.Random(seed)
    llm = adaptive_llm()
    ctl = llm.controller
    assert ctl.buckets == (0, 4, 8, 16) and ctl.cost.frozen
    # Sampled at T=1 from a random-weight model: the n-gram drafter never guesses right, but
    # for chance hits. Leaving the rounds takes plain decoding ahead on ~30 decisions in a row
    # (plain_margin), so in ~1 run in 10 the first 80 tokens end with it just arrived (fewer
    # than 40 plain steps) or still dwelling a bucket up after late chance hits: more such
    # text, up to five requests, until it has run 40 plain steps.
    for _ in range(5):
        llm.generate([random_text(rng, 40)],
                     SamplingParams(temperature=1.0, seed=rng.randrange(1 << 30), max_tokens=80,
                                    ignore_eos=True))  # fmt: skip
        if ctl.current == 0 and ctl.steps_by_budget[0] >= 40:
            break
    assert ctl.current == 0
    assert ctl.steps_by_budget[0] >= 40
    assert ctl.global_estimate(16, SAMPLED) < 0.5  # chance hits only
    # the sampled requests taught their class's engine-wide curve, not the greedy one
    assert ctl.global_estimate(16) is None
    assert not ctl.classes  # finished requests' classes forgotten with them
    # Predictable text, greedy: a probe one bucket up finds the drafts accepted.
    # (A probe may land where the loop changes phase and find nothing: cap the back-off at 16
    # steps so a few probes come in this short run.)
    ctl.cfg.explore_max = 16
    prompt = in_its_loop(llm, repeating_text(rng))
    before, committed = dict(ctl.steps_by_budget), llm.spec.stats.committed
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=240, ignore_eos=True))
    assert ctl.current > 0
    plain_steps = ctl.steps_by_budget[0] - before[0]
    assert plain_steps <= 90  # one of the first five probes brings it back
    assert llm.spec.stats.committed - committed > plain_steps  # most tokens from rounds
    info = llm.spec_stats["adaptive"]
    assert info["current"] == ctl.current and info["switches"] >= 2
    assert info["accept_curve"]["4"] > 0.5
    assert info["accept_curve_by_class"]["greedy"] == info["accept_curve"]
    assert info["accept_curve_by_class"]["sampled"]["16"] < 0.5


@pytest.mark.parametrize("costs", ["given", "measured"])
def test_greedy_output_equals_plain(costs):
    rng = random.Random()
    prompts = [repeating_text(rng), random_text(rng, 30), repeating_text(rng) + " " + "x" * 5]
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    want = [o.token_ids for o in LLM("tiny-llama").generate(prompts, sp)]
    kw = dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=16,
              speculative_num_draft_tokens=4)  # fmt: skip
    llm = adaptive_llm() if costs == "given" else LLM("tiny-llama", **kw)
    if costs == "measured":  # calibrated at startup: every bucket timed once
        assert set(llm.startup["budget_cost_seconds"]) == {"0", "4", "8", "16"}
    assert [o.token_ids for o in llm.generate(prompts, sp)] == want  # batched
    for p, w in zip(prompts, want, strict=True):  # alone: other budgets, other batch sizes
        assert llm.generate([p], sp)[0].token_ids == w
    assert sum(llm.controller.steps_by_budget.values()) > 0


def test_calibrated_curve_is_non_decreasing_in_the_budget():
    """Adjacent violators pooled to their mean above budget 0 (plain decoding, another path,
    left as measured): the H200 table that timed 16 above 32 (2026-12-01), a flat run, one that
    needs pooling across three budgets, and an already monotone one (unchanged)."""
    from treeverify.engine.budget_calibration import monotone_in_budget

    h200 = {0: 0.000398, 4: 0.000435, 8: 0.000438, 16: 0.000522, 32: 0.000491, 64: 0.000586}
    got = monotone_in_budget(h200)
    assert got[0] == h200[0] and got[4] == h200[4] and got[64] == h200[64]
    assert got[16] == got[32] == pytest.approx((0.000522 + 0.000491) / 2)
    got = monotone_in_budget({0: 9.0, 4: 3.0, 8: 2.0, 16: 1.0, 32: 5.0})
    assert got == {0: 9.0, 4: 2.0, 8: 2.0, 16: 2.0, 32: 5.0}
    fine = {0: 1.0, 4: 1.1, 8: 1.2, 16: 1.2}
    assert monotone_in_budget(fine) == fine


def test_calibration_times_every_bucket_at_each_batch_size():
    """On a GPU calibration also times batch 8 and the largest graph bucket (the CPU default is
    batch 1 only): here batch 1 and 3 on the CPU, every bucket at both, in the cost table."""
    from treeverify.engine.budget_calibration import calibrate

    llm = LLM("tiny-llama", speculative_algorithm="DDTREE", speculative_ddtree_budget=8,
              speculative_num_draft_tokens=4)  # fmt: skip
    assert set(llm.startup["budget_cost_seconds_by_batch"]) == {"1"}  # the CPU default
    per_bucket = calibrate(llm, batch_sizes=(1, 3))
    by_batch = llm.startup["budget_cost_seconds_by_batch"]
    assert set(llm.startup["budget_cost_seconds_measured"]) == {"1", "3"}  # before pooling
    for curve in by_batch.values():  # seeded non-decreasing above budget 0
        above = [curve[b] for b in ("4", "8")]
        assert above == sorted(above)
    assert set(by_batch) == {"1", "3"} and set(by_batch["3"]) == {"0", "4", "8"}
    assert set(per_bucket) == {0, 4, 8}
    table = llm.controller.cost.table
    assert all((n, b) in table for n in (1, 3) for b in (0, 4, 8))
    assert llm.controller.cost.estimate(2, 8) is not None  # between the two: interpolated
    assert not llm.has_unfinished() and llm.spec_stats["rounds"] == 0  # its requests are gone


def test_with_rounds_launched_ahead_only_steady_steps_teach_the_cost():
    """With lookahead a step that launches nothing ahead (a prefill joins, the plan is plain
    decoding) and the read-first step after it are not a budget's cost when the controller
    stays on it. Calibration times, and serving observes, steady steps only (a round launched
    ahead taken, the next launched); every bucket still gets a cost, greedy outputs equal plain
    decoding, and no page stays held."""
    from treeverify.engine.budget_calibration import calibrate

    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = ["def fibonacci(n):\n    if n < 2:\n", "import os\n\n\ndef walk(path):\n"]
    want = [o.token_ids for o in LLM("tiny-code", num_pages=96).generate(prompts, sp)]
    llm = LLM("tiny-code", speculative_algorithm="DDTREE", speculative_ddtree_budget=8,
              round_lookahead=True, num_pages=96)  # fmt: skip
    per_bucket = calibrate(llm, batch_sizes=(1,))
    assert set(per_bucket) == set(llm.controller.buckets)
    observed, unsteady, observe = [], [0], llm.controller.observe_step

    def recording(n, budget, seconds, path):
        assert llm._step_steady, (budget, llm.rounds.info)  # never a switch's step
        assert path == "fast"  # greedy: tokens picked in the graphs
        observed.append(budget)
        return observe(n, budget, seconds, path)

    llm.controller.observe_step = recording
    step = llm.step

    def counting_step():
        out = step()
        unsteady[0] += not llm._step_steady
        return out

    llm.step = counting_step
    pinned = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, speculative_budget=8)
    assert [o.token_ids for o in llm.generate(prompts, pinned)] == want  # rounds, not the CPU's
    assert [o.token_ids for o in llm.generate(prompts, sp)] == want  # the controller's choice
    assert 8 in observed  # overlapped rounds were observed
    assert unsteady[0] > 0  # ... and read-first / switch steps were left out
    assert llm.rounds.info["ahead_used"] > 0
    assert not llm.has_unfinished()
    assert llm.scheduler.block_manager.num_free_pages == 96


def test_adaptive_off_and_chain_refusal():
    llm = LLM("tiny-llama", speculative_algorithm="DDTREE", speculative_ddtree_budget=8,
              speculative_adaptive=False)  # fmt: skip
    assert llm.controller is None and llm.spec_stats["adaptive"] is None
    with pytest.raises(ValueError, match="speculative_adaptive"):
        LLM("tiny-llama", speculative_algorithm="CHAIN", speculative_adaptive=True)
    with pytest.raises(ValueError, match="speculative_cost_clock"):
        LLM("tiny-llama", speculative_algorithm="DDTREE", speculative_cost_clock="cpu")
    with pytest.raises(ValueError, match="speculative_cost_seconds"):
        LLM("tiny-llama", speculative_algorithm="DDTREE", speculative_ddtree_budget=8,
            speculative_cost_seconds={0: 1.0, 4: 1.0})  # fmt: skip


def test_speculative_budget_pins_rounds_the_controller_would_not_run():
    """A request's speculative_budget bypasses the controller: on unpredictable sampled text the
    controller decodes plainly (budget 0), but a pinned request runs every step as a round at
    its budget, and its tokens equal plain decoding's (sampling is lossless, seeded). Budgets
    the engine did not capture, a pin with speculative=False and a pin on an engine without
    speculation are ValueErrors naming the field."""
    rng = random.Random()
    llm = adaptive_llm()
    text = random_text(rng, 40)
    seed = rng.randrange(1 << 30)

    def sampled(**kw) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=seed, max_tokens=40, ignore_eos=True, **kw)

    want = llm.generate([text], sampled(speculative=False))[0].token_ids
    # the controller learns: drafts never pay (but for chance hits, which in ~1e-3 of runs
    # leave it dwelling one or two buckets up at the end: then more such text brings it back)
    for _ in range(3):
        llm.generate([random_text(rng, 40)], sampled())
        if llm.controller.current == 0:
            break
    assert llm.controller.current == 0
    rounds, committed = llm.spec.stats.rounds, llm.spec.stats.committed
    assert llm.generate([text], sampled(speculative_budget=8))[0].token_ids == want
    assert llm.spec.stats.rounds - rounds >= 40 // 7  # at most 1 + depth 6 tokens per round
    # every token after the prefill's first came from a round (the ones past max_tokens are
    # committed, then cut)
    assert llm.spec.stats.committed - committed >= 39
    for bad, match in [(5, r"speculative_budget: expected one of \[4, 8, 16\], got 5"),
                       (32, "speculative_budget: expected one of")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            llm.add_request(text, sampled(speculative_budget=bad))
    with pytest.raises(ValueError, match="speculative_budget: set together with speculative"):
        sampled(speculative_budget=8, speculative=False)
    with pytest.raises(ValueError, match="speculative_budget: expected an int >= 1"):
        sampled(speculative_budget=0)
    with pytest.raises(ValueError, match="speculative_budget: this engine runs no speculative"):
        LLM("tiny-llama").add_request(text, sampled(speculative_budget=8))


def test_steps_read_first_teach_the_general_paths_costs_not_the_fast_ones():
    """A step whose tokens need the logits read first (here: logprobs) takes the general path
    and teaches that path's cost table; greedy steps without logprobs teach the fast one (on
    the H100 one table for both held plain-step costs of 0.7-6.8 ms from sampled text)."""
    llm = adaptive_llm(decode_lookahead=True)
    seen, observe = [], llm.controller.observe_step

    def recording(n, budget, seconds, path):
        seen.append(path)
        return observe(n, budget, seconds, path)

    llm.controller.observe_step = recording
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm.generate(["the quick brown fox"], greedy)
    assert seen and set(seen) == {"fast"}
    seen.clear()
    with_logprobs = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    out = llm.generate(["the quick brown fox"], with_logprobs)[0]
    assert seen and set(seen) == {"general"}
    assert llm.controller.path == "general" and set(llm.controller.paths) == {"fast", "general"}
    assert len(out.logprobs) == 24 and all(lp is not None for lp in out.logprobs)
    info = llm.controller.info()
    assert info["cost_path"] == "general"
    assert set(info["cost_seconds_batch1_by_path"]) == {"fast", "general"}


@pytest.mark.parametrize("whole", ["1", "0"], ids=["whole-step", "run-batch"])
def test_a_steady_steps_cost_spans_what_calibration_times(monkeypatch, whole):
    """TREEVERIFY_COST_WHOLE_STEP=1: the cost a steady step teaches the controller spans the
    whole engine step (schedule, run, postprocess), as calibration times one; 0: `run_batch`
    alone. A 20 ms postprocess (a stand-in for the host's bookkeeping; the real one is far
    quicker) shows in the taught cost only with the whole step. The postprocess moves the
    controller's clock 1000 s instead of sleeping: a timed threshold failed on a loaded 2-core
    host, where the steps themselves took 65-120 ms."""
    import time

    monkeypatch.setenv("TREEVERIFY_COST_WHOLE_STEP", whole)
    llm = adaptive_llm()
    jump = [0.0]
    llm.controller.clock = lambda: time.perf_counter() + jump[0]
    taught = []
    observe = llm.controller.observe_step
    llm.controller.observe_step = lambda n, b, s, path="fast": (taught.append(s),
                                                                observe(n, b, s, path))  # fmt: skip
    slow = llm.scheduler.postprocess

    def postprocess(*a, **k):
        jump[0] += POSTPROCESS_SECONDS
        return slow(*a, **k)

    llm.scheduler.postprocess = postprocess
    llm.generate(["the cat sat on the mat"], SamplingParams(temperature=0, max_tokens=12,
                                                             ignore_eos=True))  # fmt: skip
    assert taught, "no steady step"
    assert (min(taught) >= POSTPROCESS_SECONDS) == (whole == "1"), taught


@pytest.mark.parametrize("span", ["1", "0"], ids=["taught-span", "whole-step"])
def test_calibration_times_the_span_serving_teaches(monkeypatch, span):
    """TREEVERIFY_CALIBRATE_RUN_BATCH=1: calibration times each step by the span a steady step
    teaches the controller (`run_batch` alone by default), so its entries and the live ones
    share one unit; 0: the whole step (schedule, run, postprocess). A 20 ms postprocess (a
    stand-in for the host's bookkeeping) shows in every calibrated cost only with the whole
    step; with the taught span every cost stays under it, as the live ones do. (The
    postprocess moves the controller's clock instead of sleeping, as in the test above.)"""
    import time

    from treeverify.engine.budget_calibration import calibrate

    monkeypatch.setenv("TREEVERIFY_CALIBRATE_RUN_BATCH", span)
    llm = LLM("tiny-llama", speculative_algorithm="DDTREE", speculative_ddtree_budget=8,
              speculative_num_draft_tokens=4)  # fmt: skip
    jump = [0.0]
    llm.controller.clock = lambda: time.perf_counter() + jump[0]
    slow = llm.scheduler.postprocess

    def postprocess(*a, **k):
        jump[0] += POSTPROCESS_SECONDS
        return slow(*a, **k)

    llm.scheduler.postprocess = postprocess
    calibrate(llm, batch_sizes=(1,))
    measured = llm.startup["budget_cost_seconds_measured"]["1"]
    assert set(measured) == {"0", "4", "8"}
    assert all((s >= POSTPROCESS_SECONDS) == (span == "0") for s in measured.values()), measured
