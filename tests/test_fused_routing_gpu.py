"""The fused MoE routing kernel (models/fused_routing.py) compiled on a GPU: equal to
`select_experts` on fresh random logits for the DeepSeek-V3, Kimi K2 and random:mla-moe layouts
(prefill- and decode-sized), and an MLA+MoE engine with it on (the default) gives
the same greedy tokens with CUDA graphs as eagerly (the kernel captures). Skipped without a GPU;
the CPU interpreter runs the kernel in test_fused_routing_interpret.py."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from routing_draws import router_inputs
from treeverify.models import fused_routing
from treeverify.models.moe import Router, select_experts
from treeverify.models.random_shapes import RANDOM_SHAPES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("layout", ["mla-moe", "deepseek-v3", "kimi-k2"])
@pytest.mark.parametrize("tokens", [1, 33, 2048])
def test_fused_routing_equals_select_experts_on_the_gpu(layout, tokens):
    base = RANDOM_SHAPES["random:mla-moe"]()
    cfg = {
        "mla-moe": base,
        "deepseek-v3": dataclasses.replace(base, n_routed_experts=256, num_experts_per_tok=8),
        "kimi-k2": dataclasses.replace(
            base, n_routed_experts=384, num_experts_per_tok=8, n_group=1, topk_group=1
        ),  # fmt: skip
    }[layout]
    seed = random.randrange(2**31)
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits, bias = router_inputs(cfg, tokens, g, device="cuda")  # no near-tie decides a row
    want_idx, want_w = select_experts(logits, cfg, bias)
    got_idx, got_w = fused_routing.route(logits, cfg, bias)
    assert torch.equal(got_idx, want_idx), (layout, seed)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tokens", [1, 6, 64, 65])
def test_router_logits_equal_the_fp32_linear_on_the_gpu(tokens):
    """The router GEMV (models/fused_routing.py `logits`) on random:mla-moe's shape, bf16 rows
    against the fp32 router weight; 65 rows take the F.linear path (LOGITS_MAX_ROWS)."""
    g = torch.Generator(device="cuda").manual_seed(random.randrange(2**31))
    x = torch.randn(tokens, 2048, generator=g, device="cuda").bfloat16()
    w = torch.randn(64, 2048, generator=g, device="cuda") * 0.02
    want = torch.nn.functional.linear(x.float(), w)
    got = fused_routing.logits(x, w)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_an_engine_with_fused_routing_captures_and_matches_eager(monkeypatch):
    from treeverify.engine.llm import LLM
    from treeverify.engine.sampling_params import SamplingParams

    monkeypatch.delenv("TREEVERIFY_FUSED_ROUTING", raising=False)  # on by default on a GPU
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["The capital of France is", "def main():\n    return"]
    outs = {}
    for graphs in (True, False):
        llm = LLM("tiny-kimi", device="cuda", num_pages=64, disable_cuda_graph=not graphs)
        routers = [m for m in llm.model.modules() if isinstance(m, Router)]
        assert routers and all(r.fused for r in routers)
        assert llm.startup["moe_routing"].startswith("MoE routing: one Triton kernel")
        outs[graphs] = [o.token_ids for o in llm.generate(prompts, sp)]
        del llm
    assert outs[True] == outs[False]


def test_an_mla_moe_engine_with_triton_pdl_equals_eager(monkeypatch):
    """TREEVERIFY_TRITON_PDL=1 (models/pdl.py): the decode path's Triton kernels (norms, rope,
    routing, the expert GEMVs, combine, the MLA pack) go out by programmatic dependent launch
    inside the captured graphs; greedy tokens equal the eager engine's (which launches the same
    kernels the same way outside graphs) and the engine with PDL off."""
    from treeverify.engine.llm import LLM
    from treeverify.engine.sampling_params import SamplingParams
    from treeverify.models import pdl

    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["The capital of France is", "def main():\n    return"]
    outs = {}
    for flag, graphs in (("1", True), ("1", False), ("0", True)):
        monkeypatch.setenv("TREEVERIFY_TRITON_PDL", flag)
        pdl._flags.cache_clear()
        llm = LLM("tiny-kimi", device="cuda", num_pages=64, disable_cuda_graph=not graphs)
        outs[(flag, graphs)] = [o.token_ids for o in llm.generate(prompts, sp)]
        del llm
    pdl._flags.cache_clear()
    assert outs[("1", True)] == outs[("1", False)] == outs[("0", True)]
