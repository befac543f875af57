"""Scheduler: continuous batching, chunked prefill, preemption, stops, abort (no torch).

A fake model stands in for the runner: the next token is a fixed function of all tokens so far,
so a request's output must not depend on batching, chunking or preemption.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treeverify.engine import (
    BlockManager,
    SamplingParams,
    ScheduledBatch,
    Scheduler,
    Sequence,
    SequenceStatus,
)

V = 50  # fake vocabulary; tokens 0..V-1


def fake_next(tokens: list[int]) -> int:
    h = 7
    for t in tokens:
        h = (h * 31 + t) % 1_000_003
    return h % V


def solo_output(prompt: list[int], max_tokens: int) -> list[int]:
    toks = list(prompt)
    for _ in range(max_tokens):
        toks.append(fake_next(toks))
    return toks[len(prompt) :]


class Harness:
    """Runs steps with the fake model and checks the KV pool the scheduler implies."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.pool: dict[int, tuple[str, int, int]] = {}  # slot -> (request, position, token)
        self.batches = []
        self.finished: list[Sequence] = []

    def step(self):
        s = self.sched
        bm = s.block_manager
        batch = s.schedule()
        assert batch.num_tokens <= s.max_num_batched_tokens
        assert len(s.running) <= s.max_num_seqs
        assert [q.arrival for q in s.running] == sorted(q.arrival for q in s.running)
        assert all(c.num_tokens <= s.chunked_prefill_size for c in batch.prefills)
        assert all(c.num_tokens == 1 for c in batch.decodes)
        bm.check(list(s.running))
        for p in batch.preempted:  # only ever the newest gives way
            assert p.status is SequenceStatus.PREEMPTED and p in s.waiting
            assert all(q.arrival < p.arrival for q in s.running)
        flat = batch.input_ids
        assert len(flat) == len(batch.positions) == len(batch.slot_mapping) == batch.num_tokens
        assert sum(batch.query_lens) == batch.num_tokens
        assert [flat[i] for i in batch.sample_indices] == [q.last_token_id for q in batch.sampled]
        assert batch.context_lens == [c.start + c.num_tokens for c in batch.chunks]
        for c in batch.chunks:
            q = c.seq
            assert c.seq.status is SequenceStatus.RUNNING
            assert c.start == q.num_cached_tokens
            for i, (slot, tok) in enumerate(zip(c.slots, c.token_ids, strict=True)):
                self.pool[slot] = (q.request_id, c.start + i, tok)
        sampled = batch.sampled
        for q in sampled:  # every earlier position's KV is this sequence's own and intact
            for p in range(q.num_tokens):
                assert self.pool[bm.slot(q, p)] == (q.request_id, p, q.all_token_ids[p])
        done = s.postprocess(batch, [fake_next(q.all_token_ids) for q in sampled])
        self.batches.append(batch)
        self.finished += done
        return batch, done

    def run(self, max_steps: int = 10_000):
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                break
            self.step()
        assert not self.sched.has_unfinished(), "did not finish"
        assert self.sched.block_manager.num_free_pages == self.sched.block_manager.num_pages
        return self.finished


def make(num_pages=64, page_size=4, **kw) -> Scheduler:
    return Scheduler(BlockManager(num_pages, page_size), **kw)


def req(rid, n_prompt, max_tokens=4, start=1, **sp) -> Sequence:
    prompt = [(start + i) % V for i in range(n_prompt)]
    return Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens, **sp))


def test_decodes_fill_the_token_budget_exactly_oldest_first():
    """The budget kept as decodes are added (not re-summed per sequence): with 5 decodes and 3
    tokens of budget, the 3 oldest run; then with a preemption in the decode loop (the newest
    gives its pages to an older one), every decode left still runs."""
    s = make(num_pages=64, page_size=4, max_num_batched_tokens=64)
    h = Harness(s)
    for i in range(5):
        s.add(req(f"r{i}", 3, max_tokens=20, start=i))
    h.step()  # the five prefills
    s.max_num_batched_tokens = 3
    batch, _ = h.step()
    assert [c.seq.request_id for c in batch.decodes] == ["r0", "r1", "r2"]
    tight = make(num_pages=5, page_size=4, max_num_batched_tokens=64)  # a page a request
    ht = Harness(tight)
    for i in range(5):
        tight.add(req(f"t{i}", 3, max_tokens=10, start=i))
    ht.step()
    batch, _ = ht.step()  # 4 tokens a page: position 3 fits, no new page yet
    batch, _ = ht.step()  # position 4 needs a page each: the newest are preempted
    assert batch.preempted and batch.decodes
    running = [q.request_id for q in tight.running]
    assert [c.seq.request_id for c in batch.decodes] == running


def test_chunked_prefill_respects_budget():
    s = make(max_num_batched_tokens=8)
    s.add(req("a", 20, max_tokens=3))
    h = Harness(s)
    sizes = []
    for _ in range(3):
        b, _ = h.step()
        sizes.append([(c.start, c.num_tokens, c.samples) for c in b.prefills])
    assert sizes == [[(0, 8, False)], [(8, 8, False)], [(16, 4, True)]]
    (a,) = h.run()
    assert a.output_token_ids == solo_output(a.prompt_token_ids, 3)
    assert a.finish_reason == "length"


def test_chunked_prefill_size_caps_each_chunk_and_decodes_go_first():
    s = make(max_num_batched_tokens=16, chunked_prefill_size=5)
    s.add(req("a", 3, max_tokens=6))
    s.add(req("b", 12, max_tokens=2, start=9))
    h = Harness(s)
    b1, _ = h.step()
    assert [(c.seq.request_id, c.num_tokens) for c in b1.prefills] == [("a", 3), ("b", 5)]
    b2, _ = h.step()
    assert [c.seq.request_id for c in b2.decodes] == ["a"]
    assert [(c.seq.request_id, c.num_tokens) for c in b2.prefills] == [("b", 5)]
    outs = {q.request_id: q for q in h.run()}
    assert outs["a"].output_token_ids == solo_output(outs["a"].prompt_token_ids, 6)
    assert outs["b"].output_token_ids == solo_output(outs["b"].prompt_token_ids, 2)


def test_fifo_when_one_sequence_at_a_time():
    s = make(max_num_seqs=1)
    for rid in "cab":
        s.add(req(rid, 3, max_tokens=2))
    assert [q.request_id for q in Harness(s).run()] == ["c", "a", "b"]


def test_preemption_requeues_and_resumes_with_same_output():
    # 6 pages x 2 slots = 12 slots; two requests of 4 + 7 tokens need 10 slots each.
    s = make(num_pages=6, page_size=2, max_num_batched_tokens=64)
    a, b = s.add(req("a", 4, max_tokens=7)), s.add(req("b", 4, max_tokens=7, start=20))
    h = Harness(s)
    finished = h.run()
    assert [q.request_id for q in finished] == ["a", "b"]
    assert a.num_preemptions == 0 and b.num_preemptions >= 1  # older never yields to newer
    assert any(batch.preempted == [b] for batch in h.batches)
    # the re-prefill covers prompt + generated tokens in one chunk, then decoding goes on
    resume = [c for batch in h.batches for c in batch.prefills if c.seq is b and c.start == 0]
    assert len(resume) == 2 and resume[1].num_tokens > b.num_prompt_tokens
    for q in (a, b):
        assert q.output_token_ids == solo_output(q.prompt_token_ids, 7)
        assert q.finish_reason == "length" and q.num_output_tokens == 7


def test_preempted_sequence_waits_ahead_of_new_requests():
    s = make(num_pages=6, page_size=2)
    s.add(req("a", 4, max_tokens=7))
    s.add(req("b", 4, max_tokens=7))
    h = Harness(s)
    while not any(batch.preempted for batch in h.batches):
        h.step()
    c = s.add(req("c", 1, max_tokens=1))
    assert [q.request_id for q in s.waiting] == ["b", "c"]
    assert s.get("b").status is SequenceStatus.PREEMPTED
    h.run()
    firsts = [
        (i, c.seq.request_id)
        for i, batch in enumerate(h.batches)
        for c in batch.prefills
        if c.start == 0 and c.seq.request_id in "bc"
    ]
    assert [rid for _, rid in firsts] == ["b", "b", "c"]  # b re-admitted before c is admitted
    assert c.num_output_tokens == 1


def test_stop_token_eos_and_ignore_eos():
    prompt = [1, 2, 3]
    out = solo_output(prompt, 5)
    stop_at = out[2]
    s = make(eos_token_id=stop_at)
    a = s.add(Sequence("a", prompt, SamplingParams(max_tokens=5)))
    b = s.add(Sequence("b", prompt, SamplingParams(max_tokens=5, ignore_eos=True)))
    c = s.add(Sequence("c", prompt, SamplingParams(max_tokens=5, stop_token_ids=[out[1]])))
    Harness(s).run()
    assert a.finish_reason == "stop" and a.output_token_ids == out[: out.index(stop_at) + 1]
    assert a.stop_token_id == stop_at
    assert b.finish_reason == "length" and b.output_token_ids == out
    assert c.finish_reason == "stop" and c.output_token_ids == out[: out.index(out[1]) + 1]


def detok(ids: list[int]) -> str:
    return "".join(chr(ord("a") + t % 26) for t in ids)


def test_stop_string_truncates_text_and_records_where():
    prompt = [4, 5, 6]
    out = solo_output(prompt, 8)
    text = detok(out)
    stop = text[3:5]  # spans tokens 3 and 4
    s = make(detokenize=detok)
    a = s.add(Sequence("a", prompt, SamplingParams(max_tokens=8, stop=["zzzz", stop])))
    Harness(s).run()
    idx = text.find(stop)
    assert a.finish_reason == "stop" and a.stop_string == stop
    assert a.stop_text_index == idx and a.output_text == text[:idx]
    assert a.output_token_ids == out[: idx + len(stop)]
    with pytest.raises(ValueError, match="need the scheduler's detokenize"):
        make().add(Sequence("x", prompt, SamplingParams(stop=["q"])))


def test_multi_token_append_stops_inside_the_round():
    s = make(max_num_batched_tokens=64)
    a = s.add(Sequence("a", [1, 2], SamplingParams(max_tokens=10, stop_token_ids=[9])))
    batch = s.schedule()
    assert s.postprocess(batch, [[3, 4]]) == []
    assert a.num_cached_tokens == 2 and a.output_token_ids == [3, 4]
    batch = s.schedule()  # two tokens without KV: a 2-token chunk (a verifier would commit them)
    assert [(c.start, c.token_ids) for c in batch.prefills] == [(2, [3, 4])]
    assert s.postprocess(batch, [[5, 9, 7]]) == [a]
    assert a.output_token_ids == [3, 4, 5, 9] and a.finish_reason == "stop"
    batch = s.schedule()
    with pytest.raises(RuntimeError, match="before postprocess"):
        s.schedule()
    with pytest.raises(ValueError, match="not the one schedule"):
        s.postprocess(ScheduledBatch(), [])
    with pytest.raises(ValueError, match="1 token entries for 0 sampled"):
        s.postprocess(batch, [1])


def test_abort_frees_pages_everywhere():
    s = make(num_pages=8, page_size=4, max_num_seqs=1)
    bm = s.block_manager
    a, b = s.add(req("a", 6, max_tokens=5)), s.add(req("b", 3))
    batch = s.schedule()
    assert bm.num_free_pages == 6
    assert s.abort("b") and b.finish_reason == "abort" and b.is_finished  # from the queue
    assert s.abort("a")  # between schedule and postprocess
    assert bm.num_free_pages == 8 and not s.has_unfinished()
    assert s.postprocess(batch, [7]) == [] and a.output_token_ids == []
    assert not s.abort("a") and not s.abort("nope")
    bm.check([])


def test_add_validation():
    s = make(num_pages=2, page_size=4)
    s.add(req("a", 4, max_tokens=5))  # 4 + 5 - 1 = 8 slots: exactly the pool
    with pytest.raises(ValueError, match="needs 9 KV slots, the pool has 8"):
        s.add(req("b", 4, max_tokens=6))
    with pytest.raises(ValueError, match="already in the scheduler"):
        s.add(req("a", 1))
    with pytest.raises(ValueError, match="max_num_seqs"):
        make(max_num_seqs=0)
    with pytest.raises(ValueError, match="chunked_prefill_size"):
        make(chunked_prefill_size=0)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Sequence("e", [])


@given(
    reqs=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12)), min_size=1, max_size=8),
    num_pages=st.integers(4, 24),
    page_size=st.integers(1, 6),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(6, 40),
    chunk=st.one_of(st.none(), st.integers(1, 16)),
    late=st.integers(0, 8),
)
@settings(max_examples=120, deadline=None)
def test_random_workloads_finish_with_solo_outputs(
    reqs, num_pages, page_size, max_num_seqs, budget, chunk, late
):
    s = make(
        num_pages=num_pages,
        page_size=page_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        chunked_prefill_size=chunk,
    )
    cap = num_pages * page_size
    seqs = []
    for i, (n_prompt, max_tokens) in enumerate(reqs):
        n_prompt = min(n_prompt, cap)
        max_tokens = min(max_tokens, cap - n_prompt + 1)
        seqs.append(req(f"r{i}", n_prompt, max_tokens=max_tokens, start=3 * i))
    h = Harness(s)
    for q in seqs[:late]:
        s.add(q)
    for _ in range(3):  # some requests arrive while others run
        if s.has_unfinished():
            h.step()
    for q in seqs[late:]:
        s.add(q)
    finished = h.run()
    assert sorted(q.request_id for q in finished) == sorted(q.request_id for q in seqs)
    for q in seqs:
        assert q.finish_reason == "length"
        assert q.output_token_ids == solo_output(q.prompt_token_ids, q.sampling_params.max_tokens)
