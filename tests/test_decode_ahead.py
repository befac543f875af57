"""Plain greedy decode steps launched ahead (engine/decode_ahead.py) on the CPU: the body a GPU
captures, run eagerly, against the same engine reading each step first.

Two engines with the same requests step in lockstep, one launching each plain step before the
previous one is read and one without: after every step they must hold the same tokens, the same
K/V in every committed slot, and a block manager whose pages agree with its tables (holds
included). The requests finish at different steps (the launched step is taken by those still
running), one arrives late and one is aborted (the launched step is discarded), the pool is
small enough to preempt. Steps the lookahead must not take (sampled, logprobs, penalties, a
drafter reading hidden states) take the general path. The GPU version (captured, replayed,
overlapped) is in test_decode_ahead_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from lockstep import (
    add_pairs,
    assert_same_state,
    cycle_budgets,
    kv_rows,
    record_budgets,
    replay_budgets,
    step_in_lockstep,
)
from treeverify.engine.config import EngineConfig
from treeverify.engine.llm import LLM
from treeverify.engine.sampling_params import SamplingParams

CODE = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "import os\n\n\ndef list_files(path):\n    for name in os.listdir(path):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
    "for i in range(10):\n    print(",
]


def _engine(**kw) -> LLM:
    kw.setdefault("num_pages", 96)
    return LLM("tiny-code", max_num_seqs=4, **kw)


def _assert_same(a_llm, a, b_llm, b, msg: str) -> None:
    assert a.output_token_ids == b.output_token_ids, msg
    assert a.finish_reason == b.finish_reason, msg
    assert a.num_cached_tokens == b.num_cached_tokens, msg
    if not a.is_finished:
        for x, y in zip(kv_rows(a_llm, a), kv_rows(b_llm, b), strict=True):
            # (the launched step runs the batch bucket's padded rows: not bit-equal on the CPU)
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5, msg=msg)


@pytest.mark.parametrize("holes", ["1", "0"], ids=["holes", "no-holes"])
@pytest.mark.parametrize("chunk", [None, 8], ids=["whole-prefill", "chunked-prefill"])
def test_steps_launched_ahead_equal_read_first_step_by_step(monkeypatch, chunk, holes):
    """`chunk`: the late prompt's prefill over several steps, beside decodes launched ahead.
    `holes` (TREEVERIFY_AHEAD_HOLES): a finished request's row becomes a hole and the next step
    is launched ahead at once, or that step is staged and read first."""
    monkeypatch.setenv("TREEVERIFY_AHEAD_HOLES", holes)
    knobs = dict(chunked_prefill_size=chunk)
    ahead, first = _engine(decode_lookahead=True, **knobs), _engine(**knobs)
    assert ahead.ahead is not None and first.ahead is None
    lens = [40, 9, 23]  # finishing at different steps: the others take the launched step
    pairs = []
    for prompt, n in zip(CODE[:3], lens, strict=True):
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        pairs.append((ahead.add_request(prompt, sp), first.add_request(prompt, sp)))
    steps, taken_beside_prefill = 0, False
    while ahead.has_unfinished() or first.has_unfinished():
        used = ahead.ahead.ahead_used
        if steps == 6:  # arrives mid-decode: its prefill runs after the step launched ahead
            sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=["\n"])
            pairs.append((ahead.add_request(CODE[3], sp), first.add_request(CODE[3], sp)))
        if steps == 14:
            assert ahead.abort(pairs[0][0].request_id) and first.abort(pairs[0][1].request_id)
        ahead.step()
        first.step()
        steps += 1
        if steps == 7:
            taken_beside_prefill = ahead.ahead.ahead_used == used + 1
        for a, b in pairs:
            _assert_same(ahead, a, first, b, f"step {steps}")
        ahead.block_manager.check(ahead.scheduler.running)  # holds agree with the tables
    info = ahead.ahead.info
    assert taken_beside_prefill
    assert info["ahead_used"] > 10 and info["ahead_partial"] >= 2 and info["ahead_discarded"] == 0
    assert info["holes"] == (holes == "1") and (info["holed_rows"] >= 1) == (holes == "1")
    assert ahead.block_manager.num_free_pages == ahead.block_manager.num_pages  # nothing leaked


def test_holes_keep_steps_launched_ahead_through_finishes(monkeypatch):
    """Four requests (bucket 4) finishing one by one: with holes the first finish (three left,
    still bucket 4) makes a hole and the next step is launched ahead at once, where without
    them it is staged and read first; the later finishes leave requests that fit buckets 2 and
    1, so those steps are staged compact either way. Tokens: plain greedy decoding's."""
    sp = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (14, 9, 20, 5)]
    want = [o.token_ids for o in _engine().generate(CODE, sp)]
    used = {}
    for holes in ("0", "1"):
        monkeypatch.setenv("TREEVERIFY_AHEAD_HOLES", holes)
        llm = _engine(decode_lookahead=True)
        seqs = [llm.add_request(p, s) for p, s in zip(CODE, sp, strict=True)]
        while llm.has_unfinished():
            llm.step()
            llm.block_manager.check(llm.scheduler.running)
        assert [llm.output(s).token_ids for s in seqs] == want
        info = llm.ahead.info
        used[holes] = info["ahead_used"]
        assert info["holed_rows"] == (1 if holes == "1" else 0)
        assert llm.block_manager.num_free_pages == llm.block_manager.num_pages
    assert used["1"] == used["0"] + 1  # the step after the first finish


def test_steps_launched_ahead_through_preemption_equal_plain_greedy():
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    want = [o.token_ids for o in _engine().generate(CODE, sp)]
    llm = _engine(decode_lookahead=True, num_pages=18)  # 4 requests need ~24 pages: preempts
    seqs = [llm.add_request(p, sp) for p in CODE]
    while llm.has_unfinished():
        llm.step()
        llm.block_manager.check(llm.scheduler.running)
    assert [llm.output(s).token_ids for s in seqs] == want
    assert sum(s.num_preemptions for s in seqs) > 0
    assert llm.ahead.ahead_used > 0
    assert llm.block_manager.num_free_pages == llm.block_manager.num_pages


def test_a_full_engine_with_requests_waiting_still_launches_ahead():
    """At max_num_seqs the waiting requests cannot join next step: the running ones' steps go
    ahead until one finishes (then the next request's prefill discards the launched step)."""
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in _engine().generate(CODE, sp)]
    llm = LLM("tiny-code", num_pages=96, max_num_seqs=2, decode_lookahead=True)
    assert [o.token_ids for o in llm.generate(CODE, sp)] == want
    # two waves of two requests, ~22 steps each, nearly all taken from the step before (with
    # the other two waiting in the first wave: read first would give ~22)
    assert llm.ahead.ahead_used >= 40


def test_sampled_steps_are_launched_ahead_with_the_samplers_tokens():
    """A sampled request beside a greedy one: its steps launched ahead draw on the device what
    the sampler draws (engine/sample_noise.py's hash of key and position), so the tokens are the
    general path's, and seeded ones repeat."""
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True)]  # fmt: skip
    want = [o.token_ids for o in _engine().generate(CODE[:2], params)]
    llm = _engine(decode_lookahead=True)
    assert [o.token_ids for o in llm.generate(CODE[:2], params)] == want
    assert llm.ahead.ahead_used > 0
    greedy = [o.token_ids for o in _engine().generate(CODE[:2], params[0])]
    assert want[1] != greedy[1]  # it did sample (a seed whose draws leave the argmax)


def test_steps_the_lookahead_must_not_take_take_the_general_path():
    params = [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True, top_p=0.9),
        SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True, top_k=20),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, frequency_penalty=1.5),
    ]
    for sp in params[1:]:  # each beside a greedy request: the whole step reads first
        want = _engine().generate(CODE[:2], [params[0], sp])
        llm = _engine(decode_lookahead=True)
        got = llm.generate(CODE[:2], [params[0], sp])
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert got[1].logprobs == want[1].logprobs
        assert llm.ahead.replays == 0
    llm = _engine(decode_lookahead=True)  # greedy alone: launched ahead, logprobs all None
    out = llm.generate(CODE[:1], params[0])[0]
    assert llm.ahead.ahead_used > 0 and out.logprobs == [None] * 16


def test_ngram_engines_launch_their_plain_steps_ahead():
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [o.token_ids for o in _engine().generate(CODE[:2], sp)]
    llm = _engine(decode_lookahead=True, speculative_algorithm="DDTREE",
                  speculative_draft_model_path="ngram")  # fmt: skip
    cycle_budgets(llm, [0, 0, 0, 4, 0, 8, 0, 0])  # plain steps between rounds
    assert [o.token_ids for o in llm.generate(CODE[:2], sp)] == want
    assert llm.ahead.ahead_used > 0 and llm.spec_stats["rounds"] > 0
    # the controller's choice for the next step is made before launching: never a plain step
    # launched ahead of a round
    assert llm.ahead.ahead_discarded == 0


def _dflash_lockstep(ahead: LLM, first: LLM, prompts: list[str], lens, *,
                     same_state: bool = True) -> None:  # fmt: skip
    """The same greedy requests (max_tokens `lens`) through both engines step by step: equal
    tokens after every step, and the same round counts and accept lengths; with `same_state`,
    K/V and drafter context too (reading the context projects its pending rows: a test of the
    lazy projection compares rounds, whose drafts read the context, instead)."""
    pairs = add_pairs(ahead, first, prompts, lens)

    def same(steps: int) -> None:
        for a, b in pairs:
            _assert_same(ahead, a, first, b, f"step {steps}")
            if same_state and not a.is_finished:
                assert_same_state(ahead, a, first, b, f"step {steps}")
        for k in ("rounds", "avg_spec_accept_length"):  # a draft from another context differs
            assert ahead.spec_stats[k] == first.spec_stats[k], f"step {steps}: {k}"

    step_in_lockstep(ahead, first, pairs, same)


@pytest.mark.parametrize("ring", ["1", "0"], ids=["feed-ring", "copies"])
def test_dflash_engines_hand_plain_steps_launched_ahead_their_hidden_rows(monkeypatch, ring):
    """The drafter conditions on the target's hidden states of every committed token: a plain
    step launched ahead hands it the same rows as one read first (the drafter's context rings
    equal after every step), through switches between plain steps and rounds, and when a
    request other than the last finishes first (the launched step is taken by the others: a
    pick that is no leading run, its rows gathered). `ring`: the rows go through the context's
    feed ring as ids (TREEVERIFY_FEED_RING=1, the default) or as a copy a step (0)."""
    monkeypatch.setenv("TREEVERIFY_FEED_RING", ring)
    knobs = dict(speculative_algorithm="DDTREE", num_pages=128)  # tiny-code's own DFlash drafter
    ahead, first = _engine(decode_lookahead=True, **knobs), _engine(**knobs)
    cycle_budgets(ahead, [0, 0, 0, 16, 0, 0, 8, 0, 0, 0, 0, 0])
    replay_budgets(first, record_budgets(ahead))  # the budgets ahead ran, step for step
    used = ahead.ahead.ahead_used  # (startup's calibration took steps launched ahead too)
    # the second request finishes at its second token, a plain step whatever the drafter
    # accepts in the rounds (with 9 tokens its finish fell in a round once the drafter was
    # retrained): the step launched ahead then is taken by the other two
    _dflash_lockstep(ahead, first, CODE[:3], (48, 2, 40))
    assert ahead.ahead.ahead_used - used > 5 and ahead.spec_stats["rounds"] > 0
    assert ahead.ahead.ahead_partial >= 1  # a step taken without one of its requests
    ring_of = ahead.spec.source.context._ring
    assert (ring_of is not None and ring_of.writes > 5) == (ring == "1")


@pytest.mark.parametrize("ring", ["1", "0"], ids=["feed-ring", "copies"])
def test_dflash_hidden_rows_of_steps_launched_over_a_hole(monkeypatch, ring):
    """TREEVERIFY_AHEAD_HOLES=1 in a DFlash engine held at plain decoding: the second of four
    requests finishes first, its row a hole of the next steps launched ahead; the drafter's
    context (its rings, fed the taken rows by a gather or by feed-ring ids) and every token
    equal the read-first engine's, step by step."""
    monkeypatch.setenv("TREEVERIFY_FEED_RING", ring)
    monkeypatch.setenv("TREEVERIFY_AHEAD_HOLES", "1")
    knobs = dict(speculative_algorithm="DDTREE", num_pages=128)
    ahead, first = _engine(decode_lookahead=True, **knobs), _engine(**knobs)
    cycle_budgets(ahead, [0])
    cycle_budgets(first, [0])
    _dflash_lockstep(ahead, first, CODE, (30, 9, 25, 28))
    assert ahead.ahead.holed_rows == 1 and ahead.spec_stats["rounds"] == 0


def test_lazy_context_rows_draft_what_eagerly_projected_rows_draft(monkeypatch):
    """TREEVERIFY_CONTEXT_LAZY=1: a DFlash engine's plain steps leave their feed-ring rows
    pending until a round reads them. Against the same engine projecting every 64 rows (the
    CPU's flush), step by step: equal tokens, and every round accepts as many (a draft from a
    wrong context would accept other lengths); the request that finishes before any round
    has its rows dropped unprojected, so fewer rows are projected in all."""
    knobs = dict(speculative_algorithm="DDTREE", num_pages=160, decode_lookahead=True)
    engines = {}
    for lazy in ("1", "0"):
        monkeypatch.setenv("TREEVERIFY_CONTEXT_LAZY", lazy)
        engines[lazy] = _engine(**knobs)
        assert engines[lazy].spec.source.context.lazy == (lazy == "1")
        cycle_budgets(engines[lazy], [0] * 45 + [16, 0, 0, 8])
    lazy, eager = engines["1"], engines["0"]
    _dflash_lockstep(lazy, eager, CODE[:3], (110, 44, 95), same_state=False)
    assert lazy.spec_stats["rounds"] >= 4 and lazy.ahead.ahead_used > 50
    projected = [e.spec_stats["draft_context"]["rows_projected_from_ring"] for e in (lazy, eager)]
    assert 0 < projected[0] < projected[1], projected  # (/server_info's speculative stats)
    assert (
        lazy.spec_stats["draft_context"]["lazy"] and not eager.spec_stats["draft_context"]["lazy"]
    )
    assert lazy.spec_stats["draft_context"]["ring_spills"] == 0


def test_taken_rows_are_views_for_a_leading_run_and_gathered_otherwise():
    """staging.take_rows, as a launched step takes the rows of its tapped hidden states: the
    first `width` (the bucket's padding dropped), or those of `pick` when some requests are
    gone. A leading run stays a view (no copy, no upload); any other pick is gathered by an
    index tensor, never by a Python list (on a GPU that indexes through pageable memory: a
    sync)."""
    from treeverify.kernels.staging import take_rows

    hidden = torch.randn(4, 6)  # (b, F)
    assert take_rows(hidden, range(4)) is hidden
    head = take_rows(hidden, range(2))
    assert head.data_ptr() == hidden.data_ptr() and torch.equal(head, hidden[:2])
    assert take_rows(hidden, [0, 1]).data_ptr() == hidden.data_ptr()
    picked = take_rows(hidden, [0, 2])
    assert torch.equal(picked, torch.stack([hidden[0], hidden[2]]))
    assert torch.equal(take_rows(hidden, [1]), hidden[1:2])


def test_decode_lookahead_defaults_off_on_the_cpu_and_follows_the_switch(monkeypatch):
    monkeypatch.setenv("TREEVERIFY_DECODE_LOOKAHEAD", "1")
    assert not EngineConfig().plain_lookahead  # the CPU: nothing to overlap unless asked
    assert EngineConfig(decode_lookahead=True).plain_lookahead
    cfg = EngineConfig(device="cuda", num_pages=8)
    assert cfg.plain_lookahead and cfg.to_json()["derived"]["decode_lookahead"]
    assert not EngineConfig(device="cuda", num_pages=8, disable_cuda_graph=True).plain_lookahead
    monkeypatch.setenv("TREEVERIFY_DECODE_LOOKAHEAD", "maybe")
    with pytest.raises(ValueError, match="TREEVERIFY_DECODE_LOOKAHEAD"):
        _ = EngineConfig(device="cuda", num_pages=8).plain_lookahead


@pytest.mark.parametrize("drafter", ["ngram", None], ids=["ngram", "dflash"])
def test_plain_steps_and_rounds_both_launched_ahead_hand_over_cleanly(drafter):
    """Both lookaheads on (whole rounds and plain steps), budgets switching between 0 and
    rounds every few steps, requests finishing at different steps (the controller's plan for
    the next step then no longer matches and it chooses again): each path gives the other's
    held pages back before holding its own, so the block manager stays consistent and every
    token equals plain greedy decoding."""
    sp = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (30, 13, 22)]
    want = [o.token_ids for o in _engine().generate(CODE[:3], sp)]
    llm = _engine(decode_lookahead=True, round_lookahead=True, speculative_algorithm="DDTREE",
                  speculative_draft_model_path=drafter)  # fmt: skip
    cycle_budgets(llm, [0, 0, 8, 8, 0, 16, 16, 16, 0, 4])
    seqs = [llm.add_request(p, s) for p, s in zip(CODE[:3], sp, strict=True)]
    while llm.has_unfinished():
        llm.step()
        llm.block_manager.check(llm.scheduler.running)
    assert [llm.output(s).token_ids for s in seqs] == want
    assert llm.ahead.ahead_used > 0 and llm.rounds.ahead_used > 0


def test_a_partial_take_gives_back_the_holds_of_the_sequences_it_leaves():
    """engine/launch_ahead.py `_taken`: a step launched ahead for A, B, C and taken by A and C
    (B left out of this engine step) gives B's held page back at once, not at B's next
    launched step; A's and C's holds are the taker's to manage."""
    from treeverify.engine.block_manager import BlockManager
    from treeverify.engine.launch_ahead import LaunchAhead
    from treeverify.engine.sequence import Sequence

    bm = BlockManager(num_pages=16, page_size=4)
    seqs = [Sequence(f"r{i}", list(range(1, 4 + i)), SamplingParams()) for i in range(3)]
    for seq in seqs:
        bm.allocate(seq)
        bm.hold(seq, seq.num_tokens + 3)  # a page past its slots, for the step launched ahead
    assert all(bm.num_held_slots(s) for s in seqs)
    free = bm.num_free_pages

    class Steps(LaunchAhead):
        def __init__(self):
            self.bm = bm
            self._init_in_flight()

    steps = Steps()
    fl = type("InFlight", (), {"seqs": seqs})()
    steps._in_flight = fl
    steps._taken(fl, [0, 2])
    assert steps.in_flight is None and steps.ahead_used == 1 and steps.ahead_partial == 1
    assert bm.num_held_slots(seqs[1]) == 0 and bm.num_free_pages > free  # B's page back
    assert bm.num_held_slots(seqs[0]) and bm.num_held_slots(seqs[2])


def test_a_ring_the_graphs_write_needs_what_reserves_its_ids():
    """A DecodeAhead whose captured steps write the feed ring (TREEVERIFY_RING_IN_GRAPH) is
    refused without the context's `ring_reserve`: its launches would write rows no id names."""
    import torch

    from treeverify.engine.decode_ahead import DecodeAhead
    from treeverify.engine.feed_ring import FeedRing

    llm = _engine(decode_lookahead=True)
    ring = FeedRing(16, 4, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="reserve: required"):
        DecodeAhead(llm.ahead.graphs, llm.block_manager, [1], capture=True, ring=ring)
