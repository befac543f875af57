"""Speculative decoding in the engine (CPU, fp32, tiny models, n-gram drafter): DDTree and
CHAIN rounds commit exactly the tokens plain greedy decoding produces, with real acceptance,
across batching, chunked prefill, preemption and per-request opt-out, and leak no KV pages."""

from __future__ import annotations

import pytest

from treeverify.engine.llm import LLM
from treeverify.engine.sampling_params import SamplingParams

PROMPTS = [
    "abcabcabcabcabcabcabc",
    "The capital of France is Paris. The capital of France is",
    "def f(x):\n    return x\ndef g(x):\n    return x\ndef h(x):\n",
    "x",
]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _plain(model: str) -> list[list[int]]:
    return [o.token_ids for o in LLM(model).generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-kimi"])
def model_and_plain(request):
    return request.param, _plain(request.param)


@pytest.mark.parametrize(
    "alg,budget,depth", [("DDTREE", 8, 4), ("DDTREE", 32, 6), ("DDTREE", 1, 1), ("CHAIN", 6, 6)]
)
def test_speculative_greedy_equals_plain(model_and_plain, alg, budget, depth):
    model, plain = model_and_plain
    # A fixed budget: every step a round (the adaptive budget: test_engine_adaptive.py).
    llm = LLM(model, speculative_algorithm=alg, speculative_ddtree_budget=budget,
              speculative_num_draft_tokens=depth,
              speculative_adaptive=False if alg == "DDTREE" else None)  # fmt: skip
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain
    stats = llm.spec.stats
    assert stats.rounds > 0 and sum(stats.histogram.values()) == stats.rounds
    if budget >= 6:
        assert stats.avg_accept_length > 1.3  # repetitive prompts: the drafter pays off
    assert llm.block_manager.num_free_pages == llm.block_manager.num_pages  # nothing leaked


def test_speculation_with_chunking_preemption_and_opt_out(model_and_plain):
    model, plain = model_and_plain
    llm = LLM(model, num_pages=40, page_size=4, chunked_prefill_size=8, max_num_batched_tokens=16,
              speculative_algorithm="DDTREE", speculative_ddtree_budget=8,
              speculative_num_draft_tokens=4)  # fmt: skip
    params = [GREEDY, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                     speculative=False), GREEDY, GREEDY]  # fmt: skip
    seqs = [llm.add_request(p, sp) for p, sp in zip(PROMPTS, params, strict=True)]
    while llm.scheduler.has_unfinished():
        llm.step()
    assert [s.output_token_ids for s in seqs] == plain
    assert sum(s.num_preemptions for s in seqs) > 0
    assert llm.block_manager.num_free_pages == llm.block_manager.num_pages


def test_sampled_speculation_is_seeded_and_within_max_tokens():
    params = SamplingParams(temperature=0.7, top_k=20, seed=3, max_tokens=15, ignore_eos=True)
    kw = dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=8,
              speculative_num_draft_tokens=4)  # fmt: skip
    a = LLM("tiny-llama", **kw).generate(PROMPTS[:2], params)
    b = LLM("tiny-llama", **kw).generate(PROMPTS[:2], params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) == 15 and o.finish_reason == "length" for o in a)


def test_speculative_logprobs_equal_plain_decodings_per_request_k():
    """Logprobs of tokens committed by rounds come from the verify rows of their path nodes,
    gathered for every asking request at once with each request's own k (2, none, 5, 1): the
    same tokens, logprobs and alternatives plain decoding reports (fp32 on the CPU: a verify
    row and a decode row of the same prefix agree to rounding)."""
    ks = [2, None, 5, 1]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=k)
              for k in ks]  # fmt: skip
    plain = LLM("tiny-llama").generate(PROMPTS, params)
    llm = LLM("tiny-llama", speculative_algorithm="DDTREE", speculative_ddtree_budget=8,
              speculative_adaptive=False)  # fmt: skip
    spec = llm.generate(PROMPTS, params)
    assert llm.spec.stats.avg_accept_length > 1.3  # rounds committed several tokens at once
    for k, a, b in zip(ks, plain, spec, strict=True):
        assert a.token_ids == b.token_ids
        if k is None:
            assert b.logprobs is None or all(x is None for x in b.logprobs)
            continue
        assert len(b.logprobs) == len(b.token_ids)
        for tok, x, y in zip(b.token_ids, a.logprobs, b.logprobs, strict=True):
            assert y.token_id == tok and x.token_id == tok
            assert y.logprob == pytest.approx(x.logprob, abs=1e-4)
            assert len(y.top) == k
            assert [v for _, v in y.top] == pytest.approx([v for _, v in x.top], abs=1e-4)
            # the same alternatives, but for near-ties (two rounding paths may order those
            # differently): a token in one list only sits within 1e-4 of the other's k-th value
            want, got = dict(x.top), dict(y.top)
            for t in want.keys() ^ got.keys():
                assert abs(want.get(t, got.get(t)) - x.top[-1][1]) < 1e-4, (x.top, y.top)
