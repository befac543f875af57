"""EngineConfig: one frozen set of knobs, validated once, derived sizes computed once; LLM(**kw)
and LLM(config=...) build the same engine."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from treeverify.engine.config import EngineConfig
from treeverify.engine.llm import LLM
from treeverify.engine.sampling_params import SamplingParams


def test_derived_sizes_follow_the_knobs():
    rng = random.Random()
    for _ in range(20):
        budget = rng.randint(1, 300)
        seqs, mbt = rng.randint(1, 80), rng.randint(1, 4096)
        cfg = EngineConfig(speculative_algorithm="DDTREE", speculative_ddtree_budget=budget,
                           speculative_adaptive=False, max_num_seqs=seqs,
                           max_num_batched_tokens=mbt)  # fmt: skip
        assert cfg.spec_budgets == (budget,) and cfg.budget_buckets == ()
        assert cfg.tree_size == budget + 1 and cfg.tree_sizes == (budget + 1,)
        assert cfg.max_forward_tokens == mbt + seqs * budget
        assert cfg.max_chunk == max(mbt, budget + 1)
        cap = max(mbt, budget + 1)  # rows a step holds: a decode batch past it never runs
        sizes = cfg.prefill_graph_sizes  # one request's prefill chunks: (1, n) buckets, last
        shaped = [(b, n) for b, n in cfg.graph_buckets if n not in sizes]
        assert cfg.graph_buckets == (*shaped, *((1, n) for n in sizes))
        assert set(sizes) <= {32, 64, 128, 256, 512} and budget + 1 not in sizes
        assert all(n <= mbt for n in sizes) and (512 in sizes or mbt < 512 or budget == 511)
        assert max(b for b, _ in shaped) == max(
            [b for b in cfg.graph_batch_sizes if b <= cap] or [1]
        )
        assert max(cfg.graph_batch_sizes) == min(32, seqs)
        assert all(b * n <= cap or b == 1 for b, n in shaped)
        assert {n for _, n in shaped} == {1, budget + 1}
    ada = EngineConfig(speculative_algorithm="DDTREE", speculative_ddtree_budget=16)
    assert ada.adaptive and ada.budget_buckets == (0, 4, 8, 16)
    assert ada.spec_budgets == (4, 8, 16) and ada.tree_sizes == (5, 9, 17)
    plain = EngineConfig()
    assert plain.max_budget == 0 and plain.tree_sizes == () and plain.tree_size == 0
    assert plain.prefill_graph_sizes == (32, 64, 128, 256, 512)
    assert {n for _, n in plain.graph_buckets} == {1, 32, 64, 128, 256, 512}
    assert EngineConfig(disable_prefill_graphs=True).prefill_graph_sizes == ()
    assert plain.capacity_tokens == 512 * 16  # the CPU's default pool


def test_auto_values_are_made_concrete_and_the_config_is_frozen():
    cfg = EngineConfig(num_pages=32, page_size=8)
    assert cfg.device == torch.device("cpu") and cfg.dtype == torch.float32
    assert cfg.attention_backend == "torch" and cfg.capacity_tokens == 256
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.page_size = 4
    given = EngineConfig(speculative_algorithm="DDTREE", speculative_ddtree_budget=4,
                         speculative_cost_seconds={0: 1.0, 4: 2.0})  # fmt: skip
    with pytest.raises(TypeError):
        given.speculative_cost_seconds[4] = 0.5  # read-only: it cannot drift either
    assert dataclasses.replace(given) == given  # replace (resolved) re-validates, same value


def test_a_chain_needs_its_depth_resolved():
    cfg = EngineConfig(speculative_algorithm="CHAIN", speculative_ddtree_budget=8)
    with pytest.raises(RuntimeError, match="speculative_num_draft_tokens is not resolved"):
        cfg.tree_sizes  # noqa: B018
    assert cfg.to_json()["derived"]["tree_sizes"] is None
    assert cfg.resolved(speculative_num_draft_tokens=3).tree_sizes == (4,)
    assert cfg.resolved(speculative_num_draft_tokens=30).tree_sizes == (9,)
    with pytest.raises(ValueError, match="resolved"):
        cfg.resolved(page_size=4)
    gpu = EngineConfig(device="cuda")  # no GPU needed to describe one
    assert gpu.num_pages is None and gpu.dtype == torch.bfloat16 and gpu.attention_backend == "cuda"
    with pytest.raises(RuntimeError, match="num_pages is not resolved"):
        gpu.capacity_tokens  # noqa: B018


@pytest.mark.parametrize(
    ("knobs", "name"),
    [
        ({"num_pages": 0}, "num_pages"),
        ({"page_size": -1}, "page_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 1.5}, "max_num_batched_tokens"),
        ({"chunked_prefill_size": 0}, "chunked_prefill_size"),
        ({"cuda_graph_max_bs": 0}, "cuda_graph_max_bs"),
        ({"attention_backend": "flash"}, "attention_backend"),
        ({"dtype": "bf16"}, "dtype"),
        ({"device": "gpu:x"}, "device"),
        ({"mem_fraction_static": 1.5}, "mem_fraction_static"),
        ({"speculative_algorithm": "EAGLE"}, "speculative_algorithm"),
        ({"speculative_algorithm": "DDTREE", "speculative_ddtree_budget": 0},
         "speculative_ddtree_budget"),
        ({"speculative_algorithm": "DDTREE", "speculative_ddtree_budget": 2000},
         "speculative_ddtree_budget"),
        ({"speculative_num_draft_tokens": 0}, "speculative_num_draft_tokens"),
        ({"speculative_algorithm": "CHAIN", "speculative_adaptive": True},
         "speculative_adaptive"),
        ({"speculative_algorithm": "DDTREE", "speculative_cost_clock": "cpu"},
         "speculative_cost_clock"),
        ({"speculative_algorithm": "DDTREE", "speculative_ddtree_budget": 8,
          "speculative_cost_seconds": {0: 1.0, 4: 1.0}}, "speculative_cost_seconds"),
        ({"speculative_algorithm": "DDTREE", "speculative_ddtree_budget": 4,
          "speculative_cost_seconds": {0: 1.0, 4: 0.0}}, "speculative_cost_seconds"),
        # a new user's audit (thirty-fifth session): each was accepted, or failed later
        # without naming the argument
        ({"seed": "a"}, "seed"),
        ({"seed": -1}, "seed"),
        ({"disable_cuda_graph": "no"}, "disable_cuda_graph"),  # "no" counted as True
        ({"speculative_algorithm": "DDTREE", "speculative_adaptive": "yes"},
         "speculative_adaptive"),
        ({"dtype": torch.int32}, "dtype"),
        ({"speculative_algorithm": "DDTREE", "speculative_draft_model_path": 5},
         "speculative_draft_model_path"),
        ({"attention_backend": "cuda", "device": "cpu"}, "attention_backend"),
    ],
)  # fmt: skip
def test_bad_knobs_are_named_before_anything_loads(knobs, name):
    with pytest.raises(ValueError, match=name):
        EngineConfig(**knobs)
    with pytest.raises(ValueError, match=name):
        LLM("tiny-llama", **knobs)


def test_llm_from_knobs_equals_llm_from_config():
    knobs = dict(num_pages=64, page_size=8, max_num_seqs=4, speculative_algorithm="DDTREE",
                 speculative_ddtree_budget=4, speculative_adaptive=False)  # fmt: skip
    a = LLM("tiny-llama", **knobs)
    b = LLM(config=EngineConfig("tiny-llama", **knobs))
    assert a.config == b.config
    assert a.config.speculative_num_draft_tokens == 4  # resolved: the n-gram drafter's depth
    assert a.config.capacity_tokens == 64 * 8 and a.capacity_tokens == 64 * 8
    rng = random.Random()
    prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 20))] for _ in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert [o.token_ids for o in a.generate(prompts, sp)] == [
        o.token_ids for o in b.generate(prompts, sp)
    ]
    c = LLM(config=b.config, speculative_algorithm=None)  # knobs given too override the config
    assert c.config.speculative_algorithm is None and c.config.page_size == 8
    with pytest.raises(TypeError, match="num_page"):
        LLM("tiny-llama", num_page=3)


@pytest.mark.parametrize("knobs", [
    {"speculative_ddtree_budget": 32},
    {"speculative_num_draft_tokens": 3},
    {"speculative_draft_model_path": "ngram"},
])  # fmt: skip
def test_speculative_knobs_without_an_algorithm_are_named(knobs):
    # were silently dropped; a config may still carry them (speculation turned off by override)
    with pytest.raises(ValueError, match=f"{next(iter(knobs))}: set without"):
        LLM("tiny-llama", **knobs)


def test_no_gpu_and_unknown_models_are_named():
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device: 'cuda'"):
            LLM("tiny-llama", device="cuda")  # was torch's AssertionError deep in the load
        EngineConfig(device="cuda")  # describing a GPU engine needs no GPU
    with pytest.raises(FileNotFoundError, match="tiny-code"):  # lists the built-in models
        LLM("tiny-cod")


def test_a_draft_depth_past_the_drafter_and_a_pool_too_small_to_calibrate_are_named():
    with pytest.raises(ValueError, match="speculative_num_draft_tokens: expected 1..15"):
        LLM("tiny-code", speculative_algorithm="DDTREE", speculative_num_draft_tokens=100)
    with pytest.raises(ValueError, match="num_pages: the KV pool holds 64 tokens"):
        LLM("tiny-code", speculative_algorithm="DDTREE", num_pages=4)  # named 'calibrate-1-0'
