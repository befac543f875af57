"""The Python API's bad inputs (a new user's audit, thirty-fifth session): each is a ValueError
naming the argument, raised before anything is queued, and the engine keeps serving. Before: an
out-of-vocabulary prompt id failed inside the step and left the engine unable to schedule
again; a string prompt was split into one prompt per character; a prompt past the model's
context ran on; a mismatched params list queued the first request anyway."""

from __future__ import annotations

import math

import pytest

from treeverify.engine.llm import LLM
from treeverify.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module", params=[None, "DDTREE"], ids=["plain", "ddtree"])
def llm(request):
    return LLM("tiny-code", device="cpu", num_pages=128, speculative_algorithm=request.param)


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("prompts,params,match", [
    ([[10**7]], GREEDY, "prompt: token id 10000000"),
    ([[-1, 5]], GREEDY, "prompt: token id -1"),
    ([[1.5, 5]], GREEDY, "prompt: token ids must be ints"),
    ([[True, 5]], GREEDY, "prompt: token ids must be ints"),
    ([[]], GREEDY, "prompt: must not be empty"),
    ([[5] * 1020], SamplingParams(max_tokens=10), "max_tokens: 10 .* context of 1024"),
    ([1, 2, 3], GREEDY, "prompts: got a list of ints"),
    ([], GREEDY, "prompts"),
    (["a", "b"], [GREEDY], "params: 1 SamplingParams for 2 prompts"),
    (["a"], {"temperature": 0}, "params: expected a SamplingParams"),
    (["ok", "\ud800"], GREEDY, "surrogates"),
])  # fmt: skip
def test_bad_input_is_named_and_the_engine_keeps_serving(llm, prompts, params, match):
    good = llm.generate([[1, 2, 3]], GREEDY)[0].token_ids
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, params)
    assert not llm.has_unfinished()  # nothing of the bad call was queued
    assert llm.generate([[1, 2, 3]], GREEDY)[0].token_ids == good


def test_one_string_is_one_prompt(llm):
    out = llm.generate("def f(n):\n", GREEDY)
    assert len(out) == 1 and out[0].token_ids == llm.generate(["def f(n):\n"], GREEDY)[0].token_ids


def test_logprobs_has_one_entry_per_token_with_or_without_speculation(llm):
    out = llm.generate(["def add(a, b):\n"], SamplingParams(temperature=0, max_tokens=12,
                                                            ignore_eos=True))[0]  # fmt: skip
    assert len(out.logprobs) == len(out.token_ids) == 12  # DDTREE gave [None]: one a round
    assert all(x is None for x in out.logprobs)


@pytest.mark.parametrize("kw,match", [
    ({"temperature": math.inf}, "temperature"),
    ({"stop": None}, "stop"),
    ({"stop": {"a": 1}}, "stop"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
])  # fmt: skip
def test_sampling_params_name_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_generate_queues_nothing_when_a_later_prompt_cannot_fit_the_kv_pool():
    """Every prompt is checked before any is queued, the KV pool's bound included: a prompt
    the pool cannot hold, after one that fits, left the first queued (run by the next call)."""
    llm = LLM("tiny-llama", num_pages=64, page_size=16)  # 1024 KV slots
    with pytest.raises(ValueError, match=r"max_tokens: 4 \+ the prompt's 2000 tokens"):
        llm.generate(["def f(", [1] * 2000], SamplingParams(temperature=0, max_tokens=4))
    assert not llm.has_unfinished()
    out = llm.generate(["abc"], SamplingParams(temperature=0, max_tokens=3))
    assert len(out) == 1 and len(out[0].token_ids) == 3


def test_sampling_params_changed_after_construction_are_checked_again():
    """SamplingParams is a mutable dataclass: a field set after construction is checked when
    the engine takes the request (a temperature of -1 ran silently greedy; a top_k of 2**63
    failed the engine's step)."""
    llm = LLM("tiny-llama", num_pages=32, page_size=16)
    for name, value in (("temperature", -1.0), ("top_k", 2**63), ("max_tokens", "5")):
        sp = SamplingParams(max_tokens=3)
        setattr(sp, name, value)
        with pytest.raises(ValueError, match=name):
            llm.generate(["x"], sp)
        assert not llm.has_unfinished()
    assert len(llm.generate(["x"], SamplingParams(max_tokens=2))[0].token_ids) == 2


@pytest.mark.parametrize(
    "knobs,name",
    [({"num_pages": 10**9}, "num_pages"), ({"num_pages": 4, "page_size": 10**12}, "num_pages"),
     ({"max_num_seqs": 10**9}, "max_num_seqs")],
)  # fmt: skip
def test_a_pool_or_batch_too_big_for_memory_is_a_value_error_before_allocating(knobs, name):
    """num_pages = 10**9 got the process OOM-killed (22 GB of page lists before the cache was
    tried); the pool's bytes are now checked against the free memory first, and max_num_seqs
    (tables allocated at startup) has a cap."""
    with pytest.raises(ValueError, match=name):
        LLM("tiny-llama", **knobs)


def test_speculative_knobs_without_an_algorithm_are_refused_through_config_too():
    """Refused as keywords of LLM(), they were silently dropped when given in an EngineConfig
    (LLM(config=...)): the config refuses them itself now."""
    from treeverify.engine.config import EngineConfig

    for knobs in ({"speculative_ddtree_budget": 8}, {"speculative_draft_model_path": "ngram"}):
        with pytest.raises(ValueError, match=next(iter(knobs))):
            LLM(config=EngineConfig("tiny-llama", **knobs))


@pytest.mark.parametrize(
    "name, kwargs, exc, says",
    [("tiny-llama", {"dtype": "fp16"}, ValueError, "dtype"),  # was "Invalid device string"
     ("", {}, ValueError, "name_or_path"),  # was the current directory
     ("tiny-llama", {"device": "xpu9"}, ValueError, "device"),
     (__file__, {}, FileNotFoundError, "is a file")],  # was "not found"
)  # fmt: skip
def test_load_model_names_the_bad_argument(name, kwargs, exc, says):
    from treeverify.models import load_model

    with pytest.raises(exc, match=says):
        load_model(name, **kwargs)


def test_stop_token_ids_outside_the_vocabulary_and_undecodable_text_name_their_argument():
    """A stop id past the vocabulary never matches (silently); a lone surrogate raised a
    UnicodeEncodeError naming nothing."""
    llm = LLM("tiny-llama", num_pages=32, page_size=16)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(["x"], SamplingParams(max_tokens=2, stop_token_ids=[10**12]))
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(["\ud800"], SamplingParams(max_tokens=2))
    assert not llm.has_unfinished()
