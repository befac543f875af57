"""presence_penalty, frequency_penalty and logit_bias (engine, CPU, tiny-llama): the processed
logits equal a float64 recomputation from a full forward; speculative rounds (DDTree and CHAIN,
n-gram drafter) commit exactly plain decoding's tokens with them, and report the same logprobs;
without each tree node's own path in its counts they would not (negative control)."""

from __future__ import annotations

import random

import pytest
import torch

from treeverify.engine import logits_processor
from treeverify.engine.llm import LLM
from treeverify.engine.sampling_params import SamplingParams
from treeverify.models import TorchAttention

PROMPTS = [
    "abcabcabcabcabcabcabc",
    "The capital of France is Paris. The capital of France is",
    "def f(x):\n    return x\ndef g(x):\n",
]
SPEC = dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=8,
            speculative_num_draft_tokens=4, speculative_adaptive=False)  # fmt: skip


KW = dict(temperature=0, max_tokens=24, ignore_eos=True, logprobs=4)


def _small_frequency(f: float) -> SamplingParams:
    """Repetition goes on for a while, then the counts, within trees too, break it."""
    return SamplingParams(**KW, frequency_penalty=f)


def _params(rng: random.Random, plain: list[int]) -> list[SamplingParams]:
    """Per prompt: repetition encouraged (so trees are accepted), discouraged, and a mix with a
    ban on plain decoding's first token and a boost of another; then each prompt with a small
    frequency penalty."""
    kw = KW
    boost = (plain[0] + 1 + rng.randrange(255)) % 256  # any token but the banned one
    # encouraged: a repeat gains f * count - presence >= f / 2 (a presence penalty up to 1 with
    # f near 0.5 discouraged the first repeat: down to 8 multi-token rounds in the tight case)
    f = rng.uniform(0.5, 1.5)
    return [
        SamplingParams(**kw, frequency_penalty=-f, presence_penalty=rng.uniform(0, f / 2)),
        SamplingParams(**kw, frequency_penalty=rng.uniform(0.5, 2), presence_penalty=0.3),
        SamplingParams(**kw, presence_penalty=rng.uniform(-2, 2),
                       logit_bias={str(plain[0]): -100, boost: rng.uniform(1, 4)}),
    ] + [_small_frequency(rng.uniform(0.02, 0.05)) for _ in PROMPTS]  # fmt: skip


@pytest.fixture(scope="module")
def plain_llm():
    return LLM("tiny-llama")


@pytest.fixture(scope="module")
def case(plain_llm):
    seed = random.randrange(2**32)  # fresh penalties each run; the seed is in any failure
    rng = random.Random(seed)
    first = plain_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1))
    params = _params(rng, [o.token_ids[0] for o in first])
    print(f"penalty seed {seed}")
    return params, plain_llm.generate(PROMPTS * 2, params)


def _processed64(llm: LLM, ids: list[int], out: list[int], p: SamplingParams) -> torch.Tensor:
    """float64 processed logits of the token after ids + out, from a full forward."""
    with torch.inference_mode():
        t = torch.tensor(ids + out)
        x = llm.model(t, torch.arange(len(t)), attention=TorchAttention())[-1].double()
    count = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=x.numel()).double()
    x = x - p.frequency_penalty * count - p.presence_penalty * (count > 0).double()
    for tid, bias in p.logit_bias.items():
        x[tid] += bias
    return x


def _same_top(top: list[tuple[int, float]], ref: torch.Tensor, k: int) -> bool:
    """`top` is `ref`'s k best (ids and values within 1e-4; near-ties may swap order)."""
    best = ref.topk(k).values
    return len(top) == k and all(
        abs(v - float(ref[i])) < 1e-4 and abs(v - float(best[j])) < 1e-4
        for j, (i, v) in enumerate(top)
    )


def _tops_agree(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> bool:
    """Two top-k lists agree: values rank by rank, and any id in both, within 1e-4 (near-ties
    may swap ids)."""
    if len(a) != len(b):
        return False
    da, db = dict(a), dict(b)
    ranks = all(abs(u - v) < 1e-4 for (_, u), (_, v) in zip(a, b, strict=True))
    return ranks and all(abs(da[i] - db[i]) < 1e-4 for i in da.keys() & db.keys())


def test_processed_logits_equal_float64_recomputation(plain_llm, case):
    params, outs = case
    unprocessed = plain_llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    )
    assert all(o.token_ids != u.token_ids for o, u in zip(outs, unprocessed, strict=False))
    for o, p in zip(outs, params, strict=True):
        assert len(o.token_ids) == 24 and len(o.logprobs) == 24
        for t, (tok, lp) in enumerate(zip(o.token_ids, o.logprobs, strict=True)):
            x = _processed64(plain_llm, o.prompt_token_ids, o.token_ids[:t], p)
            assert x[tok] >= x.max() - 1e-4  # greedy picked the processed maximum
            ref = torch.log_softmax(x, -1)
            assert abs(lp.logprob - float(ref[tok])) < 1e-4
            assert _same_top(lp.top, ref, 4)
        for tid, bias in p.logit_bias.items():
            if bias == -100:
                assert tid not in o.token_ids  # banned


# the last: small pages and chunks, so rounds share steps with prefill and requests get
# preempted (their rows released, then rebuilt from their tokens)
TIGHT = dict(num_pages=40, page_size=4, chunked_prefill_size=8, max_num_batched_tokens=16)


@pytest.mark.parametrize("alg,budget,depth,tight", [
    ("DDTREE", 8, 4, False), ("CHAIN", 6, 6, False), ("DDTREE", 8, 4, True)])  # fmt: skip
def test_speculative_equals_plain_with_penalties(case, alg, budget, depth, tight):
    params, plain = case
    llm = LLM("tiny-llama", speculative_algorithm=alg, speculative_ddtree_budget=budget,
              speculative_num_draft_tokens=depth, **(TIGHT if tight else {}),
              speculative_adaptive=False if alg == "DDTREE" else None)  # fmt: skip
    # one request without processing in the same batches: it takes the null row
    extra = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    outs = llm.generate(PROMPTS * 2 + [PROMPTS[0]], params + [extra])
    assert [o.token_ids for o in outs[:-1]] == [o.token_ids for o in plain]
    # trees were accepted, not only bonuses: over 100 seeds, 17-35 rounds committed more than
    # one token, 17-29 in the tight case (mean accept length 1.17-1.73 with the penalties
    # drawn, so no bound on the mean)
    hist = llm.spec.stats.histogram
    assert sum(n for k, n in hist.items() if k > 1) >= 8, hist
    for o, ref in zip(outs, plain, strict=False):
        assert [lp.token_id for lp in o.logprobs] == ref.token_ids
        for a, b in zip(o.logprobs, ref.logprobs, strict=True):
            assert abs(a.logprob - b.logprob) < 1e-4
            assert _tops_agree(a.top, b.top)
    assert len(llm.processor._free) == llm.processor.null_row  # every row given back
    assert llm.block_manager.num_free_pages == llm.block_manager.num_pages


def test_sampled_speculative_logprobs_are_the_processed_target_rows(plain_llm):
    """Sampled rounds (the lossless walk): each committed token's reported logprob is the
    processed target distribution's at its own prefix (float64 full forward)."""
    rng = random.Random()
    p = SamplingParams(temperature=0.8, seed=rng.randrange(1 << 30), max_tokens=16,
                       ignore_eos=True, logprobs=2, frequency_penalty=rng.uniform(-1, 0),
                       logit_bias={rng.randrange(256): 3.0})  # fmt: skip
    llm = LLM("tiny-llama", **SPEC)
    outs = llm.generate(PROMPTS, p)
    assert llm.spec.stats.rounds > 0
    for o in outs:
        assert [lp.token_id for lp in o.logprobs] == o.token_ids
        for t, lp in enumerate(o.logprobs):
            x = _processed64(plain_llm, o.prompt_token_ids, o.token_ids[:t], p)
            assert abs(lp.logprob - float(torch.log_softmax(x, -1)[o.token_ids[t]])) < 1e-4


def test_tree_nodes_need_their_own_path_counted(plain_llm, monkeypatch):
    """Negative control: counting only the committed tokens at every tree node diverges."""
    params = [_small_frequency(f) for f in (0.02, 0.05) for _ in PROMPTS]
    plain = plain_llm.generate(PROMPTS * 2, params)

    def no_path(tokens, parents, max_depth):
        tok, valid = real(tokens, parents, max_depth)
        return tok, torch.zeros_like(valid)

    real = logits_processor.path_tokens
    monkeypatch.setattr(logits_processor, "path_tokens", no_path)
    llm = LLM("tiny-llama", **SPEC)
    outs = llm.generate(PROMPTS * 2, params)
    assert [o.token_ids for o in outs] != [o.token_ids for o in plain]


def test_bad_values_name_the_field():
    for kw, field in (({"presence_penalty": 2.5}, "presence_penalty"),
                      ({"frequency_penalty": float("nan")}, "frequency_penalty"),
                      ({"logit_bias": {"5": 101}}, "logit_bias"),
                      ({"logit_bias": {"x": 1}}, "logit_bias"),
                      ({"logit_bias": {"7": 1, 7: 2}}, "logit_bias"),
                      ({"logit_bias": {i: 1 for i in range(301)}}, "logit_bias")):  # fmt: skip
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)
    assert SamplingParams(logit_bias={"12": -3}).logit_bias == {12: -3.0}
    llm = LLM("tiny-llama")
    with pytest.raises(ValueError, match="logit_bias: token id 259"):
        llm.add_request("hi", SamplingParams(logit_bias={259: 1}))
