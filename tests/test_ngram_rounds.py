"""Whole greedy rounds with the n-gram drafter (engine/ngram_rings.py) on the CPU: the body a GPU
would capture, run eagerly.

The rings' draft equals the host drafter's logits bit for bit, through appends, a window that
slides, a rollback and an eviction; an engine with n-gram whole rounds steps in lockstep with
one whose n-gram rounds take the general path (same tokens, same K/V in every committed slot,
each ring holding exactly its sequence's newest tokens), with rounds launched ahead too; under
the adaptive controller and with stops outputs equal plain greedy decoding (through preemption
and aborts: test_round_graphs.py's ngram case)."""

from __future__ import annotations

import random

import pytest
import torch

from lockstep import kv_rows
from treeverify.engine.llm import LLM
from treeverify.engine.ngram_rings import NgramTokenRings
from treeverify.engine.sampling_params import SamplingParams
from treeverify.spec.ngram import NgramDrafter

CODE = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "import os\n\n\ndef list_files(path):\n    for name in os.listdir(path):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
]


class _Seq:
    """What `prepare` reads of a sequence: its id and token list."""

    def __init__(self, rid: str, tokens: list[int]):
        self.request_id, self.all_token_ids = rid, tokens

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.all_token_ids[-1]


def _repetitive(rng: random.Random, n: int, vocab: int) -> list[int]:
    out: list[int] = []
    while len(out) < n:
        if out and rng.random() < 0.6:
            a = rng.randrange(len(out))
            out += out[a : a + rng.randint(2, 9)]
        else:
            out.append(rng.randrange(vocab))
    return out[:n]


def test_ring_drafts_equal_the_host_drafter_as_histories_change():
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    vocab, window, depth = 50, 24, 5
    host = NgramDrafter(vocab, window=window)
    rings = NgramTokenRings(vocab, window, host.max_n, host.floor)
    rings.fix(2, torch.device("cpu"))  # two rings for three requests: one is evicted
    hist = {r: _repetitive(rng, rng.randint(1, 40), vocab) for r in "abc"}
    for step in range(30):
        rids = rng.sample("abc", 2)
        for r in rids:
            if rng.random() < 0.15 and len(hist[r]) > 3:  # rolled back (a recompute)
                hist[r] = hist[r][: rng.randint(1, len(hist[r]) - 1)]
            else:
                hist[r] += _repetitive(rng, rng.randint(1, 30), vocab)  # appended, or slides
        seqs = [_Seq(r, hist[r]) for r in rids]
        rings.prepare(seqs, torch.device("cpu"))
        meta = torch.tensor(rings.draft_meta(rids, [s.last_token_id for s in seqs], 3))
        got = rings.draft(meta, depth)  # (3, L, V): two requests and a padding one
        for i, s in enumerate(seqs):
            want = host.propose(s.all_token_ids, depth)  # (L, V)
            assert torch.equal(got[i], want), (seed, step, s.request_id)
            first, held = rings.history(s.request_id)
            assert held == s.all_token_ids[first:-1], (seed, step)
        assert torch.isfinite(got[2]).all()
    assert len(rings) == 3


def _engine(**kw) -> LLM:
    kw.setdefault("speculative_algorithm", "DDTREE")
    kw.setdefault("num_pages", 96)
    kw.setdefault("max_num_seqs", 4)
    return LLM("tiny-code", speculative_draft_model_path="ngram", **kw)


@pytest.mark.parametrize("lookahead", [False, True], ids=["read-first", "lookahead"])
@pytest.mark.parametrize("algorithm,budget", [("DDTREE", 16), ("CHAIN", 6)])
def test_ngram_whole_rounds_equal_the_general_path_step_by_step(algorithm, budget, lookahead):
    knobs = dict(speculative_algorithm=algorithm, speculative_ddtree_budget=budget,
                 speculative_adaptive=False)  # fmt: skip
    if algorithm == "CHAIN":
        knobs["speculative_num_draft_tokens"] = budget
    whole = _engine(round_lookahead=lookahead, **knobs)
    general = _engine(ngram_whole_rounds=False, **knobs)
    assert whole.rounds is not None and general.rounds is None
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    pairs = [(whole.add_request(p * 2, sp), general.add_request(p * 2, sp)) for p in CODE]
    steps = 0
    while whole.has_unfinished():
        whole.step()
        general.step()
        steps += 1
        for a, b in pairs:
            assert a.output_token_ids == b.output_token_ids, f"step {steps}"
            if a.is_finished:
                continue
            for x, y in zip(kv_rows(whole, a), kv_rows(general, b), strict=True):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5, msg=f"step {steps}")
            held = whole.spec.source.context.history(a.request_id)
            if held is not None:  # the ring: exactly the sequence's tokens before its root
                first, tokens = held
                assert tokens == a.all_token_ids[first : first + len(tokens)], f"step {steps}"
    assert not general.has_unfinished()
    assert whole.rounds.replays > 0 and whole.spec_stats["avg_spec_accept_length"] > 1.5
    if lookahead:
        assert whole.rounds.ahead_used > 0
    assert (
        whole.spec_stats["accept_length_histogram"] == general.spec_stats["accept_length_histogram"]
    )
    assert len(whole.spec.source.context) == 0  # finished requests gave their rings back


def test_ngram_whole_rounds_without_the_round_glue(monkeypatch):
    """TREEVERIFY_ROUND_GLUE=0: the switch reaches the engine's RoundState and the n-gram rings'
    lockstep holds (on the CPU both settings run RoundState.path_rows as torch ops)."""
    monkeypatch.setenv("TREEVERIFY_ROUND_GLUE", "0")
    assert not _engine().rounds.state.glue
    test_ngram_whole_rounds_equal_the_general_path_step_by_step("DDTREE", 16, True)


@pytest.mark.parametrize("lookahead", [False, True], ids=["read-first", "lookahead"])
def test_ngram_whole_rounds_with_adaptive_budgets_and_stops_equal_plain_greedy(lookahead):
    """The controller's budgets (switches and probes, budget 0 included) and stop strings / EOS
    inside a round's committed tokens: outputs equal plain greedy decoding."""
    prompts = [CODE[0] * 2, CODE[2], "# a short docstring\n"]
    for sp in (SamplingParams(temperature=0, max_tokens=40),
               SamplingParams(temperature=0, max_tokens=40, stop=["\n\n", "return"])):  # fmt: skip
        want = [(o.token_ids, o.text, o.finish_reason)
                for o in LLM("tiny-code", num_pages=96).generate(prompts, sp)]  # fmt: skip
        llm = _engine(round_lookahead=lookahead)  # adaptive: the default for DDTREE
        got = [(o.token_ids, o.text, o.finish_reason) for o in llm.generate(prompts, sp)]
        assert got == want
        assert llm.rounds.replays > 0 and len(llm.spec.source.context) == 0
