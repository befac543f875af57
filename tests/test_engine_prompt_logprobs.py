"""Prompt logprobs (engine, CPU, tiny-llama): every prompt token's logprob and top-k equal a
full forward of the model, with chunked prefill and preemption (re-prefill adds none twice);
max_tokens 0 generates nothing and still reports them."""

from __future__ import annotations

import random

import torch

from treeverify.engine.llm import LLM
from treeverify.engine.sampling_params import SamplingParams
from treeverify.models import TorchAttention


def _reference(llm: LLM, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        x = llm.model(torch.tensor(ids), torch.arange(len(ids)), attention=TorchAttention())
    return torch.log_softmax(x.double(), -1)  # (T, V)


def test_prompt_logprobs_equal_a_full_forward_across_chunks_and_preemption():
    rng = random.Random()
    llm = LLM("tiny-llama", num_pages=24, page_size=4, chunked_prefill_size=5,
              max_num_batched_tokens=12)  # fmt: skip
    # >= 20 tokens each: the three generating requests then need > 96 slots (24 pages of 4), so
    # one is always preempted (with 12-token prompts they could just fit: a flaky CI run)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(20, 30))] for _ in range(4)]
    params = [
        SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=3),
        SamplingParams(temperature=0, max_tokens=20, prompt_logprobs=0, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, prompt_logprobs=5, ignore_eos=True),
    ]
    seqs = [llm.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while llm.scheduler.has_unfinished():
        llm.step()
    assert sum(s.num_preemptions for s in seqs) > 0  # re-prefill exercised
    outs = [llm.output(s) for s in seqs]
    assert outs[0].token_ids == [] and outs[0].finish_reason == "length"
    assert outs[2].prompt_logprobs is None
    for o, sp in zip(outs, params, strict=True):
        if sp.prompt_logprobs is None:
            continue
        ids = o.prompt_token_ids
        ref = _reference(llm, ids)
        lps = o.prompt_logprobs
        assert len(lps) == len(ids) and lps[0].logprob is None and lps[0].token_id == ids[0]
        for i in range(1, len(ids)):
            assert lps[i].token_id == ids[i]
            assert abs(lps[i].logprob - float(ref[i - 1, ids[i]])) < 1e-4
            k = sp.prompt_logprobs
            best = ref[i - 1].topk(k).values.tolist()  # ids may swap at near-ties: values
            assert len(lps[i].top) == k
            for j, (t, v) in enumerate(lps[i].top):
                assert abs(v - float(ref[i - 1, t])) < 1e-4 and abs(v - best[j]) < 1e-4
    assert llm.block_manager.num_free_pages == llm.block_manager.num_pages
