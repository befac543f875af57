"""The eager engine end to end on the tiny models (CPU, fp32): scheduler + block manager + paged
KV cache + tree_attention + sampler.

Greedy output equals a naive loop that recomputes the whole sequence with plain causal attention
each step; a request's output is the same alone or batched, with chunked prefill, and across
preemption and resumption; seeded sampling is reproducible and batch-invariant.
"""

from __future__ import annotations

import pytest
import torch

from treeverify.engine.llm import LLM
from treeverify.engine.sampling_params import SamplingParams
from treeverify.models import TorchAttention, load_model

MODELS = ["tiny-llama", "tiny-kimi"]
PROMPTS = [
    "The capital of France is",
    "Hello",
    "A much longer prompt that spans several KV pages: " + "abcdefgh" * 6,
    "x",
]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def naive_greedy(model_name: str, prompt: str, n: int) -> list[int]:
    _, model, tok = load_model(model_name)
    ids = tok.encode(prompt)
    out = []
    with torch.inference_mode():
        for _ in range(n):
            t = torch.tensor(ids + out)
            logits = model(t, torch.arange(len(t)), attention=TorchAttention())  # (T, V)
            out.append(int(logits[-1].argmax()))
    return out


@pytest.mark.parametrize("model", MODELS)
def test_greedy_equals_naive_full_recompute(model):
    outs = LLM(model).generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == naive_greedy(model, prompt, 12), prompt
        assert out.finish_reason == "length"


@pytest.mark.parametrize("model", MODELS)
def test_batching_chunking_and_preemption_keep_outputs(model):
    alone = [LLM(model).generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    batched = [o.token_ids for o in LLM(model).generate(PROMPTS, GREEDY)]
    assert batched == alone
    chunked = LLM(model, chunked_prefill_size=8, max_num_batched_tokens=16)
    assert [o.token_ids for o in chunked.generate(PROMPTS, GREEDY)] == alone
    # A pool too small for all four at once: the newest requests are preempted and recomputed.
    tight = LLM(model, num_pages=30, page_size=4)
    seqs = [tight.add_request(p, GREEDY) for p in PROMPTS]
    while tight.scheduler.has_unfinished():
        tight.step()
    assert sum(s.num_preemptions for s in seqs) > 0
    assert [s.output_token_ids for s in seqs] == alone


def test_seeded_sampling_is_reproducible_and_batch_invariant():
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=10,
                            ignore_eos=True, logprobs=3)  # fmt: skip
    one = LLM("tiny-llama").generate([PROMPTS[0]], params)[0]
    again = LLM("tiny-llama").generate([PROMPTS[0]], params)[0]
    batched = LLM("tiny-llama").generate(PROMPTS[:3], params)[0]
    assert one.token_ids == again.token_ids == batched.token_ids
    other = LLM("tiny-llama").generate(
        [PROMPTS[0]], SamplingParams(temperature=0.8, seed=99, max_tokens=10, ignore_eos=True)
    )[0]
    assert other.token_ids != one.token_ids  # the seed matters (10 draws agreeing by chance: no)
    assert len(one.logprobs) == 10
    for tok, info in zip(one.token_ids, one.logprobs, strict=True):
        assert info.token_id == tok and info.logprob <= 0 and len(info.top) == 3
        assert info.top[0][1] >= info.top[1][1] >= info.top[2][1]


def test_stop_string_and_max_tokens():
    llm = LLM("tiny-llama")
    free = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12,
                                                     ignore_eos=True))[0]  # fmt: skip
    stop = free.text[3:5]  # a string the greedy output is known to contain
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12,
                                                    ignore_eos=True, stop=[stop]))[0]  # fmt: skip
    assert out.finish_reason == "stop" and stop not in out.text
    assert free.text.startswith(out.text)
