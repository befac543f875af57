"""Whole rounds launched ahead (RoundGraphs lookahead) on the CPU, on the trained tiny-code pair.

With lookahead each step launches the next round before reading its own, and the next step takes
that round when it schedules the same requests at the same budget; the round graph advanced its
own inputs (roots, prefix lengths, ring ends, the nodes' slots from the page table), and the block
manager held the pages it writes. On the CPU the same body runs eagerly in the same order, so
these tests check the bookkeeping a GPU relies on: two engines, lookahead on and off, step in
lockstep with equal tokens, equal K/V in every committed slot (each through its own page table:
held pages change which pages a request gets) and equal drafter context rows; through arrivals,
finishes, stops, preemption, aborts and budget switches outputs equal plain decoding, and every
held page comes back. The GPU version (captured, overlapped) is in test_round_graphs_gpu.py.
"""

from __future__ import annotations

import pytest

from lockstep import assert_same_state, cycle_budgets, record_budgets, replay_budgets
from treeverify.engine.llm import LLM
from treeverify.engine.sampling_params import SamplingParams
from treeverify.engine.sequence import Sequence, SequenceStatus

CODE = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "import os\n\n\ndef list_files(path):\n    for name in os.listdir(path):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
]


def _engine(lookahead: bool, **kw) -> LLM:
    kw.setdefault("speculative_algorithm", "DDTREE")
    kw.setdefault("num_pages", 96)
    kw.setdefault("max_num_seqs", 4)
    return LLM("tiny-code", round_lookahead=lookahead, **kw)


def _check_pages(llm: LLM) -> None:
    """Pages and requests agree exactly (held pages included) and no hold outlives its request."""
    live = [s for s in llm.scheduler.running if s.status is SequenceStatus.RUNNING]
    llm.scheduler.block_manager.check(live)


@pytest.mark.parametrize(
    "algorithm,budget,late",
    [("DDTREE", 16, False), ("CHAIN", 6, False), ("DDTREE", 16, True)],
)
def test_lookahead_equals_rounds_read_first_step_by_step(algorithm, budget, late):
    """`late`: a request arrives while the others decode: the step with its prefill takes the
    round in flight and launches none; the next (a new batch) discards nothing it needs."""
    knobs = dict(speculative_algorithm=algorithm, speculative_ddtree_budget=budget,
                 speculative_adaptive=False)  # fmt: skip
    if algorithm == "CHAIN":
        knobs["speculative_num_draft_tokens"] = budget
    if late:
        knobs["chunked_prefill_size"] = 8
    ahead, plain = _engine(True, **knobs), _engine(False, **knobs)
    assert ahead.rounds.lookahead and not plain.rounds.lookahead
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    first = CODE[:-1] if late else CODE
    pairs = [(ahead.add_request(p, sp), plain.add_request(p, sp)) for p in first]
    steps = 0
    while ahead.has_unfinished():
        if late and steps == 3:
            pairs.append((ahead.add_request(CODE[-1], sp), plain.add_request(CODE[-1], sp)))
        ahead.step()
        plain.step()
        steps += 1
        _check_pages(ahead)
        for a, b in pairs:
            assert a.output_token_ids == b.output_token_ids, f"step {steps}"
            assert a.num_cached_tokens == b.num_cached_tokens
            if a.is_finished:
                continue
            assert_same_state(ahead, a, plain, b, f"step {steps}")
    assert not plain.has_unfinished()
    info = ahead.rounds.info
    assert info["ahead_used"] > 10, info  # most rounds ran ahead of their step
    # the batch only shrank or grew here: a prefill step takes the round in flight and
    # launches none, finishes leave the survivors their rows; nothing was thrown away
    assert info["ahead_discarded"] == 0, info
    assert info["ahead_partial"] >= 1, info  # requests finished on different steps
    sa, sp_ = ahead.spec_stats, plain.spec_stats
    assert sa["rounds"] == sp_["rounds"] and sa["avg_spec_accept_length"] > 1.5
    assert sa["accept_length_histogram"] == sp_["accept_length_histogram"]
    assert ahead.scheduler.block_manager.num_free_pages == ahead.scheduler.block_manager.num_pages


def test_lookahead_with_adaptive_budgets_equals_plain_greedy_decoding():
    """The controller switches budgets: the round launched ahead of a switch runs at the new
    budget (the controller chose it when the round was launched)."""
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [o.token_ids for o in LLM("tiny-code", num_pages=96).generate(CODE, sp)]
    llm = _engine(True)  # adaptive budgets (the default for DDTREE)
    got = [o.token_ids for o in llm.generate(CODE, sp)]
    assert got == want
    assert llm.rounds.info["ahead_used"] > 0
    assert len(llm.spec.source.context) == 0  # finished requests gave their rings back
    assert llm.scheduler.block_manager.num_free_pages == llm.scheduler.block_manager.num_pages


def test_lookahead_through_preemption_and_abort():
    """A pool too small for every request at once: holds that do not fit are not taken (the
    round is read first), requests are preempted and recomputed, one is aborted while its next
    round is in flight; outputs equal plain decoding and every page comes back."""
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [p * 2 for p in CODE]
    small = dict(num_pages=14, max_num_seqs=4)  # 224 slots: not enough for 3 x (~110 + 40 + 16)
    want = [o.token_ids for o in LLM("tiny-code", **small).generate(prompts, sp)]
    llm = _engine(True, speculative_adaptive=False, **small)
    seqs = [llm.add_request(p, sp) for p in prompts]
    victim = llm.add_request(CODE[0], sp)
    steps, aborted_in_flight = 0, False
    while llm.has_unfinished():
        llm.step()
        steps += 1
        _check_pages(llm)
        fl = llm.rounds.in_flight
        if not victim.is_finished and fl is not None and any(s is victim for s in fl.seqs):
            aborted_in_flight = llm.abort(victim.request_id)
    assert [s.output_token_ids for s in seqs] == want
    assert sum(s.num_preemptions for s in seqs + [victim]) > 0
    assert aborted_in_flight
    assert llm.rounds.info["ahead_used"] > 0 and len(llm.spec.source.context) == 0
    assert llm.scheduler.block_manager.num_free_pages == small["num_pages"]


def test_lookahead_stops_where_plain_decoding_stops():
    """EOS and stop strings end a request at round k while its round k + 1 is in flight: the
    others take their rows of k + 1 and the outputs are cut where plain decoding stops."""
    prompts = CODE + ["# a short docstring\n"]
    for sp in (SamplingParams(temperature=0, max_tokens=60),  # the model's EOS ends some
               SamplingParams(temperature=0, max_tokens=60, stop=["\n\n", "return"])):  # fmt: skip
        want = [(o.token_ids, o.text, o.finish_reason)
                for o in LLM("tiny-code", num_pages=96).generate(prompts, sp)]  # fmt: skip
        llm = _engine(True, speculative_adaptive=False)
        got = [(o.token_ids, o.text, o.finish_reason) for o in llm.generate(prompts, sp)]
        assert got == want
        info = llm.rounds.info  # finishes shrank the batch: survivors took their rows
        assert info["ahead_partial"] > 0, info
        assert llm.scheduler.block_manager.num_free_pages == 96


def test_a_joining_request_takes_the_round_in_flight_and_launches_none():
    """The step with a new request's prefill takes the round launched ahead (its batch changes
    next step, so launching another would be waste) and gives the held pages back; a sampled
    request then sends the batch down the general path. Greedy outputs are unchanged."""
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = LLM("tiny-code", num_pages=96).generate(CODE[:1], greedy)[0].token_ids
    llm = _engine(True, speculative_adaptive=False)
    seq = llm.add_request(CODE[0], greedy)
    while seq.num_output_tokens < 8:
        llm.step()
    bm = llm.scheduler.block_manager
    assert llm.rounds.in_flight is not None
    assert bm.num_held_slots(seq) > seq.num_slots  # pages held past its slots
    llm.add_request(CODE[1], SamplingParams(temperature=0.7, seed=1, max_tokens=20))
    used, replays = llm.rounds.info["ahead_used"], llm.rounds.replays
    llm.step()  # the round in flight + the prefill
    assert llm.rounds.info["ahead_used"] == used + 1 and llm.rounds.replays == replays
    assert llm.rounds.in_flight is None and bm.num_held_slots(seq) == 0
    while llm.has_unfinished():
        llm.step()
        _check_pages(llm)
    assert seq.output_token_ids == want
    assert llm.rounds.info["ahead_discarded"] == 0
    assert bm.num_free_pages == 96


def test_an_abort_keeps_the_survivors_rows_of_the_round_in_flight():
    """Aborting one of two requests while their next round runs: the next step (one request)
    takes the survivor's row of that round (not a wasted round), launches nothing ahead (the
    round's device state still has the aborted request's row) and gives the held pages back;
    the step after stages a fresh round."""
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = LLM("tiny-code", num_pages=96).generate(CODE[:1], greedy)[0].token_ids
    llm = _engine(True, speculative_adaptive=False)
    keep, gone = llm.add_request(CODE[0], greedy), llm.add_request(CODE[1], greedy)
    while keep.num_output_tokens < 8 or llm.rounds.in_flight is None:
        llm.step()
    assert llm.abort(gone.request_id)
    used = llm.rounds.info["ahead_used"]
    llm.step()  # the survivor takes its row of the round in flight; the next is read first
    info = llm.rounds.info
    assert info["ahead_partial"] == 1 and info["ahead_used"] == used + 1, info
    assert llm.rounds.in_flight is None
    while llm.has_unfinished():
        llm.step()
        _check_pages(llm)
    assert keep.output_token_ids == want
    assert llm.scheduler.block_manager.num_free_pages == 96


def test_spec_diverge_fault_reaches_rounds_launched_ahead(monkeypatch):
    """The planted fault wraps the host commit, which rounds launched ahead go through too: on
    a GPU (lookahead on by default) the gate's probes see it on the path production runs."""
    monkeypatch.setenv("TREEVERIFY_FAULT", "spec_diverge")
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in LLM("tiny-code", num_pages=96).generate(CODE[:1], sp)]
    llm = _engine(True, speculative_adaptive=False)
    got = [o.token_ids for o in llm.generate(CODE[:1], sp)]
    assert llm.rounds.info["ahead_used"] > 0 and got != want


def test_probes_and_switches_run_at_the_budget_the_controller_chose():
    """With lookahead the next step's budget is chosen when its round is launched, and that
    round is launched at it (another bucket's round, its stage written whole and its prefixes
    taken from the round before): every round runs at the budget the controller counted for its
    step (a probe at the top used to find the round in flight at the old budget and take it
    instead, so it never ran, and broke the lookahead for nothing), switches and probes keep
    the lookahead going, and greedy output still equals plain decoding."""
    from collections import Counter

    sp = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    want = [o.token_ids for o in LLM("tiny-code", num_pages=96).generate(CODE, sp)]
    # a fixed cost curve that puts the top dear: below it the controller probes it (with costs
    # measured on the host, a fast one kept every step at the top, where nothing is probed:
    # a CI rehearsal, fifty-seventh session)
    llm = _engine(True, speculative_cost_seconds={0: 1.0, 4: 1.1, 8: 1.2, 16: 2.0})
    ctl = llm.controller
    ctl.cfg.explore_every = 3  # probe often: the test needs several
    ran, observe = Counter(), ctl.observe_round

    def recording(request_id, budget, path):
        ran[budget] += 1
        return observe(request_id, budget, path)

    ctl.observe_round = recording
    assert [o.token_ids for o in llm.generate(CODE[:1], sp)] == want[:1]
    counted = Counter({b: n for b, n in ctl.steps_by_budget.items() if b and n})
    top = ctl.buckets[-1]
    assert ctl.explorations >= 2 and ran[top] >= 2, (ctl.info(), ran)  # probes ran at the top
    for b in set(ran) | set(counted):  # the last step's plan is counted, never run
        assert ran[b] <= counted[b] <= ran[b] + 1, (b, ran, counted)
    info = llm.rounds.info
    assert info["ahead_switched"] >= 2, info  # into a probe and back, launched ahead
    assert [o.token_ids for o in llm.generate(CODE, sp)] == want  # a batch of three too
    _check_pages(llm)
    assert llm.scheduler.block_manager.num_free_pages == llm.scheduler.block_manager.num_pages


def test_budgets_replayed_without_lookahead_give_the_same_tokens():
    """The budgets an engine with lookahead ran, step for step (a cycle of switches, each
    launched ahead in the other budget's bucket), replayed by one that launches nothing ahead:
    the same tokens (the GPU version, captured: test_round_graphs_gpu.py)."""
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    ahead = _engine(True)
    cycle_budgets(ahead, [16, 16, 4, 8, 8, 16, 4, 8])
    ran = record_budgets(ahead)
    got = [o.token_ids for o in ahead.generate(CODE, sp)]
    assert ahead.rounds.info["ahead_switched"] >= 2 and len(set(ran)) >= 2, ran
    replay = _engine(False)
    budgets = replay_budgets(replay, ran)
    assert [o.token_ids for o in replay.generate(CODE, sp)] == got, ran
    assert next(budgets, None) is None  # step for step


def _assert_in_flight_tables(llm: LLM, msg: str) -> None:
    """The step or round launched ahead reads its stage's page table on the device: it must be
    exactly its requests' tables (a stale page = K/V written to and read from a page the request
    no longer owns)."""
    for ahead, n in ((llm.rounds, None), (llm.ahead, 1)):
        fl = None if ahead is None else ahead.in_flight
        if fl is None:
            continue
        nodes = n if n is not None else llm.spec.nodes_for(fl.budget)
        table = ahead.graphs.stages[(fl.batch, nodes)].views["table"]  # (P, B)
        for i, seq in enumerate(fl.seqs):
            pages = seq.block_table
            assert table[: len(pages), i].tolist() == pages, f"{msg}: {seq.request_id}"


def test_a_table_regrown_after_a_commit_is_restaged_for_the_round_launched_ahead():
    """A large round reserves pages past what the next, smaller one needs; its commit gives the
    tail back and the next hold regrows the table to the same length, with whichever page is
    free first. Here another request's page is freed between steps (an abort outside the
    batch), so the regrown table differs from the staged one at equal length: it must be
    restaged (a review found the page-count check skipping it). Checked after every step: the
    launched round's device table equals its requests' tables, and the tokens plain greedy's.
    (The free steps are where that happens with the shipped drafter: the page-count check
    fails at step 39; the per-step check itself holds for any run.)"""
    prompts = CODE + ["def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n"]
    sp = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    want = [o.token_ids for o in LLM("tiny-code", num_pages=96).generate(prompts, sp)]
    for free_at in (38, 52):
        llm = _engine(True, speculative_ddtree_budget=32)
        cycle_budgets(llm, [0, 0, 32, 4, 4])
        bm = llm.scheduler.block_manager
        other = Sequence("other", [1, 2, 3])
        bm.allocate(other)  # a low page, held by a request outside the batch
        seqs = [llm.add_request(p, sp) for p in prompts]
        steps = 0
        while llm.has_unfinished():
            llm.step()
            steps += 1
            if steps == free_at:
                bm.free(other)
            _assert_in_flight_tables(llm, f"free at {free_at}, step {steps}")
        assert [s.output_token_ids for s in seqs] == want
