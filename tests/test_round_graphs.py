"""Whole rounds, greedy and sampled (engine/round_graphs.py), on the CPU: the body a GPU captures,
run eagerly, against the general path (draft, build, verify, accept one by one) on the trained
tiny-code pair. Two engines with the same requests step in lockstep, one with whole rounds and one
without: after every step they must hold the same tokens, the same K/V in every committed slot and
the same drafter context rows (the whole round writes its accepted rows into the rings on the
device; the general path gathers them on the host and projects them). Rounds the whole-round path
must not take (top-p sampling, logprobs, penalties) take the general one. The GPU version (captured,
replayed) is in test_round_graphs_gpu.py.
"""

from __future__ import annotations

import pytest

from lockstep import assert_same_state
from treeverify.engine.llm import LLM
from treeverify.engine.sampling_params import SamplingParams

CODE = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "import os\n\n\ndef list_files(path):\n    for name in os.listdir(path):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
]


def _engine(**kw) -> LLM:
    kw.setdefault("speculative_algorithm", "DDTREE")
    return LLM("tiny-code", num_pages=96, max_num_seqs=4, **kw)


@pytest.mark.parametrize(
    "algorithm,budget,late,temperature",
    [("DDTREE", 16, False, 0), ("DDTREE", 5, False, 0), ("CHAIN", 6, False, 0),
     ("DDTREE", 16, True, 0), ("DDTREE", 16, False, 0.8), ("CHAIN", 6, True, 1.0)],
)  # fmt: skip
def test_whole_rounds_equal_the_general_path_step_by_step(algorithm, budget, late, temperature):
    """`late`: the last request arrives while the others decode, so steps mix its prefill
    chunks with rounds (the whole round replays, the prefill runs its own forward after it).
    `temperature` > 0: seeded sampled requests, each node drawn inside the whole round as the
    general path's `draw_nodes` draws it (engine/sample_noise.py)."""
    knobs = dict(speculative_algorithm=algorithm, speculative_ddtree_budget=budget,
                 speculative_adaptive=False)  # fmt: skip
    if algorithm == "CHAIN":
        knobs["speculative_num_draft_tokens"] = budget
    extra = dict(chunked_prefill_size=8) if late else {}  # the late prompt over several steps
    whole, general = _engine(**knobs, **extra), _engine(disable_round_graphs=True, **knobs, **extra)
    assert whole.rounds is not None and general.rounds is None
    sp = SamplingParams(temperature=temperature, seed=7, max_tokens=48, ignore_eos=True)
    first = CODE[:-1] if late else CODE
    pairs = [(whole.add_request(p, sp), general.add_request(p, sp)) for p in first]
    steps, mixed = 0, 0
    while whole.has_unfinished():
        if late and steps == 3:
            pairs.append((whole.add_request(CODE[-1], sp), general.add_request(CODE[-1], sp)))
        replays = whole.rounds.replays
        prefilling = any(a.num_cached_tokens < a.num_prompt_tokens for a, _ in pairs)
        whole.step()
        general.step()
        steps += 1
        mixed += prefilling and whole.rounds.replays > replays
        for a, b in pairs:
            assert a.output_token_ids == b.output_token_ids, f"step {steps}"
            assert a.num_cached_tokens == b.num_cached_tokens and a.block_table == b.block_table
            if a.is_finished:
                continue
            assert_same_state(whole, a, general, b, f"step {steps}")
    assert not general.has_unfinished()
    assert whole.rounds.replays > 0  # the rounds took the whole-round path
    sw, sg = whole.spec_stats, general.spec_stats
    assert sw["rounds"] == sg["rounds"] and sw["avg_spec_accept_length"] > 1.3  # real drafts
    assert sw["accept_length_histogram"] == sg["accept_length_histogram"]
    assert mixed >= (3 if late else 0)  # steps whose rounds replayed beside prefill chunks


@pytest.mark.parametrize(
    "algorithm,budget,late,temperature", [("DDTREE", 16, True, 0), ("CHAIN", 6, False, 1.0)]
)
def test_whole_rounds_without_the_round_glue_equal_the_general_path(monkeypatch, algorithm,
                                                                    budget, late,
                                                                    temperature):  # fmt: skip
    """TREEVERIFY_ROUND_GLUE=0 (the A/B's other side): the switch reaches the engine's
    RoundState, and the lockstep holds. On the CPU both settings run stage_trees / path_rows as
    torch ops; on a GPU 1 runs them as one kernel each (test_round_graphs_gpu.py compares)."""
    monkeypatch.setenv("TREEVERIFY_ROUND_GLUE", "0")
    assert not _engine().rounds.state.glue
    test_whole_rounds_equal_the_general_path_step_by_step(algorithm, budget, late, temperature)


def test_whole_rounds_equal_plain_greedy_decoding():
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [o.token_ids for o in LLM("tiny-code", num_pages=96).generate(CODE, sp)]
    llm = _engine()  # adaptive budgets (the default for DDTREE): every bucket's body
    got = [o.token_ids for o in llm.generate(CODE, sp)]
    assert got == want
    assert llm.rounds.replays > 0
    assert len(llm.spec.source.context) == 0  # finished requests gave their rings back


def test_sampled_whole_rounds_commit_plain_sampled_decodings_tokens():
    """Seeded sampled requests (T 0.7 and 1.0) through whole rounds at adaptive budgets commit
    exactly what plain sampled decoding draws (the same hashed draw per position)."""
    params = [SamplingParams(temperature=t, seed=s, max_tokens=40, ignore_eos=True)
              for t, s in ((0.7, 3), (1.0, 4), (0.7, 5))]  # fmt: skip
    want = [o.token_ids for o in LLM("tiny-code", num_pages=96).generate(CODE, params)]
    for lookahead in (False, True):  # rounds read first; each launched before the last is read
        llm = _engine(round_lookahead=lookahead)
        assert [o.token_ids for o in llm.generate(CODE, params)] == want, lookahead
        assert llm.rounds.replays > 0 and llm.rounds.sampling
        assert (llm.rounds.ahead_used > 0) == lookahead


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, seed=5, top_p=0.9, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, logprobs=2, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, presence_penalty=0.5, max_tokens=24, ignore_eos=True),
    ],
    ids=["top-p", "logprobs", "penalty"],
)
def test_rounds_the_whole_round_cannot_serve_take_the_general_path(params):
    llm = _engine(speculative_adaptive=False)
    ref = _engine(speculative_adaptive=False, disable_round_graphs=True)
    got = llm.generate(CODE[:2], params)
    want = ref.generate(CODE[:2], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.rounds.replays == 0 and llm.spec_stats["rounds"] > 0


def test_ngram_whole_rounds_can_be_turned_off():
    llm = _engine(speculative_draft_model_path="ngram", ngram_whole_rounds=False)
    assert llm.rounds is None  # n-gram rounds on the general path (the GPU's default for now)


def test_spec_diverge_fault_reaches_whole_rounds(monkeypatch):
    """The planted fault wraps the host commit both paths share: a whole round commits the
    wrong bonus too, so the gate's probe sees it on the path production runs."""
    monkeypatch.setenv("TREEVERIFY_FAULT", "spec_diverge")
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in LLM("tiny-code", num_pages=96).generate(CODE[:1], sp)]
    llm = _engine(speculative_adaptive=False)
    got = [o.token_ids for o in llm.generate(CODE[:1], sp)]
    assert llm.rounds.replays > 0 and got != want


@pytest.mark.parametrize(
    "drafter,lookahead", [(None, False), ("ngram", True)], ids=["dflash", "ngram-lookahead"]
)
def test_whole_rounds_through_preemption_and_abort(drafter, lookahead):
    """A pool too small for every request at once: rounds cannot reserve, requests are
    preempted and recomputed (their context rings restart from position 0), one is aborted
    mid-generation; greedy outputs still equal plain decoding's, and every ring is given back.
    Also with the n-gram drafter's token rings (engine/ngram_rings.py), rounds launched ahead."""
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [p * 2 for p in CODE]
    small = dict(num_pages=12, max_num_seqs=4)  # 192 slots: not enough for 3 x (~110 + 40 + 16)
    want = [o.token_ids for o in LLM("tiny-code", **small).generate(prompts, sp)]
    llm = LLM("tiny-code", speculative_algorithm="DDTREE", speculative_adaptive=False,
              speculative_draft_model_path=drafter, round_lookahead=lookahead, **small)  # fmt: skip
    seqs = [llm.add_request(p, sp) for p in prompts]
    victim = llm.add_request(CODE[0], sp)
    steps = 0
    while llm.has_unfinished():
        llm.step()
        steps += 1
        if steps == 6:
            assert llm.abort(victim.request_id)
    assert [s.output_token_ids for s in seqs] == want
    assert sum(s.num_preemptions for s in seqs + [victim]) > 0
    assert llm.rounds.replays > 0 and len(llm.spec.source.context) == 0


def test_whole_rounds_stop_where_plain_decoding_stops():
    """EOS and stop strings inside a round's committed tokens: the round's tokens are cut where
    plain decoding stops (the scheduler's stop checks see every committed token)."""
    prompts = CODE + ["# a short docstring\n"]
    for sp in (SamplingParams(temperature=0, max_tokens=60),  # the model's EOS ends some
               SamplingParams(temperature=0, max_tokens=60, stop=["\n\n", "return"])):  # fmt: skip
        want = [(o.token_ids, o.text, o.finish_reason)
                for o in LLM("tiny-code", num_pages=96).generate(prompts, sp)]  # fmt: skip
        llm = _engine(speculative_adaptive=False)
        got = [(o.token_ids, o.text, o.finish_reason) for o in llm.generate(prompts, sp)]
        assert got == want
        assert llm.rounds.replays > 0
