"""The fused MoE routing kernel (models/fused_routing.py) on the CPU interpreter
(TRITON_INTERPRET=1) against `select_experts`, the PyTorch routing it replaces: DeepSeek-V3's
noaux_tc (sigmoid, biased choice, top-2 group sums), Kimi K2's (384 experts, no groups), the
random:mla-moe and tiny-kimi layouts, softmax greedy and group-limited greedy; fresh random
logits and biases, outputs poisoned before the kernel runs. tests/test_fused_routing_gpu.py runs
it compiled on a GPU."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from triton_interpreter import cache_cleared, interpret_on_cpu

interpret_on_cpu("tests/test_fused_routing_gpu.py")

from routing_draws import router_inputs  # noqa: E402
from treeverify.models import fused_routing  # noqa: E402
from treeverify.models.moe import select_experts  # noqa: E402
from treeverify.models.random_shapes import RANDOM_SHAPES  # noqa: E402
from treeverify.models.tiny import tiny_kimi_config  # noqa: E402

interpreted_kernel = cache_cleared(fused_routing._kernel)  # decorated under the interpreter
interpreted_logits = cache_cleared(fused_routing._logits_kernel)


def _configs():
    mla_moe = RANDOM_SHAPES["random:mla-moe"]()
    base = dataclasses.replace(mla_moe)  # noaux_tc, sigmoid, 64 experts, 8 groups keep 4, k 6
    return {
        "mla-moe": base,
        "deepseek-v3": dataclasses.replace(base, n_routed_experts=256, num_experts_per_tok=8),
        "kimi-k2": dataclasses.replace(
            base, n_routed_experts=384, num_experts_per_tok=8, n_group=1, topk_group=1
        ),  # fmt: skip
        "tiny-kimi": tiny_kimi_config(),
        "softmax-greedy": dataclasses.replace(
            base,
            scoring_func="softmax",
            topk_method="greedy",
            n_routed_experts=16,
            num_experts_per_tok=4,
            norm_topk_prob=False,
        ),  # fmt: skip
        "group-limited": dataclasses.replace(
            base, scoring_func="softmax", topk_method="group_limited_greedy"
        ),  # fmt: skip
    }


@pytest.mark.parametrize("name", list(_configs()))
@pytest.mark.parametrize("tokens", [1, 7])
def test_fused_routing_equals_select_experts(name, tokens):
    cfg = _configs()[name]
    seed = random.randrange(2**31)
    logits, bias = router_inputs(cfg, tokens, torch.Generator().manual_seed(seed))  # no near-tie
    want_idx, want_w = select_experts(logits, cfg, bias)
    got_idx, got_w = fused_routing.route(logits, cfg, bias)
    assert torch.equal(got_idx, want_idx), (name, seed)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6, msg=f"{name} seed {seed}")


def test_unfusable_groups_are_refused_by_name():
    cfg = dataclasses.replace(_configs()["mla-moe"], n_routed_experts=48)  # groups of 6
    assert not fused_routing.fusable(cfg)
    with pytest.raises(ValueError, match="cfg"):
        fused_routing.route(torch.randn(1, 48), cfg, torch.zeros(48))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 5])
def test_router_logits_equal_the_fp32_linear(dtype, tokens):
    """The one-launch router GEMV against F.linear in fp32: 70 experts (a partial last program),
    1000 hidden columns (a partial last tile), x in the model's dtype, fresh random values."""
    g = torch.Generator().manual_seed(random.randrange(2**31))
    x = torch.randn(tokens, 1000, generator=g).to(dtype)
    w = torch.randn(70, 1000, generator=g) * 0.02
    want = torch.nn.functional.linear(x.float(), w)
    got = fused_routing.logits(x, w)
    assert got.dtype == torch.float32 and got.shape == (tokens, 70)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_router_logits_name_a_mismatched_input():
    with pytest.raises(ValueError, match="x: expected"):
        fused_routing.logits(torch.randn(2, 64), torch.randn(8, 32))
