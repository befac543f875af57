"""models/fused_moe.py on a GPU: the dispatch (sorted rows, places, counts, offsets) equal to the
PyTorch ops, the combine to float summation order; a DeepseekMoE layer on the grouped-GEMM path
with TREEVERIFY_FUSED_MOE_DISPATCH on and off: the same counts, outputs within bf16 rounding."""

from __future__ import annotations

import pytest
import torch

from moe_reference import combine_reference, dispatch_reference
from treeverify.models import fused_moe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BF16 = torch.bfloat16


@pytest.mark.parametrize("t,k,e,hidden", [(1, 8, 64, 2048), (136, 8, 64, 2048), (3, 2, 5, 130)])
def test_dispatch_and_combine_on_the_gpu(t, k, e, hidden):
    g = torch.Generator(device="cuda").manual_seed(t + e)
    x = torch.randn(t, hidden, device="cuda", generator=g).to(BF16)
    idx = torch.randint(0, e, (t, k), device="cuda", generator=g)
    valid = torch.rand(t, device="cuda", generator=g) < 0.7
    got = fused_moe.dispatch(x, idx, valid, e)
    want = dispatch_reference(x, idx, valid, e)
    for name, a, b in zip(("xs", "pos", "counts", "valid_counts", "offs"), got, want,
                          strict=False):  # fmt: skip
        assert torch.equal(a, b), name
    y = torch.randn(t * k, hidden, device="cuda", generator=g).to(BF16)
    w = torch.rand(t, k, device="cuda", generator=g)
    out = fused_moe.combine(y, got[1], w, torch.float32)
    torch.testing.assert_close(out, combine_reference(y, want[5], w), rtol=1e-6, atol=1e-6)


def test_moe_layer_with_the_kernels_on_and_off(monkeypatch):
    from treeverify.models.moe import grouped_mm_supported
    from treeverify.models.random_shapes import build_random

    x = torch.randn(9, 1, device="cuda")  # probe for the grouped GEMM's availability
    if not grouped_mm_supported(x.to(BF16)):
        pytest.skip("torch._grouped_mm needs bf16 on sm_90+")
    calls = []
    real = fused_moe.dispatch
    monkeypatch.setattr(fused_moe, "dispatch", lambda *a: calls.append(1) or real(*a))
    outs = {}
    for flag in ("0", "1", "auto"):  # auto: 17 tokens x 6 experts is a small batch
        monkeypatch.setenv("TREEVERIFY_FUSED_MOE_DISPATCH", flag)
        _, model, _ = build_random("random:mla-moe", dtype=BF16, device="cuda", seed=7)
        moe = next(layer.mlp for layer in model.model.layers if layer.is_moe)
        assert moe.fused_dispatch == flag
        moe.impl = "grouped_mm"
        g = torch.Generator(device="cuda").manual_seed(11)
        h = torch.randn(17, model.config.hidden_size, device="cuda", generator=g).to(BF16)
        valid = torch.ones(17, dtype=torch.bool, device="cuda")
        valid[-3:] = False
        outs[flag] = moe(h, valid)
        assert len(calls) == {"0": 0, "1": 1, "auto": 2}[flag]  # a silent fallback fails
    (a, ca), (b, cb) = outs["0"], outs["1"]
    assert torch.equal(ca, cb)  # the valid rows' expert counts
    assert torch.isfinite(b).all()
    torch.testing.assert_close(b.float(), a.float(), rtol=1.6e-2, atol=1e-3)  # a bf16 rounding
    assert torch.equal(outs["auto"][0], b)  # the same kernels


@pytest.mark.parametrize("tokens", [1, 2, 9])
def test_moe_layer_routed_experts_as_gemvs(monkeypatch, tokens):
    """TREEVERIFY_MOE_GEMV on a GPU: a decode-sized batch's routed experts by the two expert
    GEMVs (counted: a silent fallback fails) equal the grouped-GEMM path within bf16 rounding,
    the same expert counts; auto takes 1-2 tokens at k = 6, not 9 (54 pairs)."""
    from treeverify.models import moe_gemv
    from treeverify.models.moe import grouped_mm_supported
    from treeverify.models.random_shapes import build_random

    probe = torch.randn(9, 1, device="cuda").to(BF16)
    if not grouped_mm_supported(probe):
        pytest.skip("torch._grouped_mm needs bf16 on sm_90+")
    calls = []
    real = moe_gemv.routed
    monkeypatch.setattr(moe_gemv, "routed", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    # the routed experts alone (the shared experts as GEMV pairs, on by default since e6a3f84,
    # round differently from the dense shared MLP: their own test compares them)
    monkeypatch.setenv("TREEVERIFY_MOE_GEMV_SHARED", "0")
    outs = {}
    for flag in ("0", "auto", "1"):
        monkeypatch.setenv("TREEVERIFY_MOE_GEMV", flag)
        _, model, _ = build_random("random:mla-moe", dtype=BF16, device="cuda", seed=5)
        moe = next(layer.mlp for layer in model.model.layers if layer.is_moe)
        moe.impl = "grouped_mm"
        g = torch.Generator(device="cuda").manual_seed(13 + tokens)
        h = torch.randn(tokens, model.config.hidden_size, device="cuda", generator=g).to(BF16)
        valid = torch.ones(tokens, dtype=torch.bool, device="cuda")
        valid[-1] = tokens == 1  # a padding row past the first
        before = len(calls)
        outs[flag] = moe(h, valid)
        ran = len(calls) > before
        assert ran == (flag == "1" or (flag == "auto" and tokens * 6 <= moe_gemv.AUTO_MAX_PAIRS))
    (a, ca), (b, cb) = outs["0"], outs["1"]
    assert torch.equal(ca, cb)
    counter = torch.arange(ca.numel(), device="cuda")  # the model's running counts
    before = counter.clone()
    b2, none = moe(h, valid, counter)  # the last layer built: TREEVERIFY_MOE_GEMV=1
    assert none is None and torch.equal(counter, before + cb)  # added in place
    assert torch.equal(b2, b)
    assert torch.isfinite(b).all()
    # Another summation order rounds the bf16 intermediates (gate|up, the activation) apart, and
    # the down projection carries that on: a few elements a few bf16 ulps off, the mean not.
    torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=1e-2)
    assert (b.float() - a.float()).abs().mean() < 2e-4 * max(1.0, a.float().abs().max().item())


@pytest.mark.parametrize("n_shared", [1, 2])
@pytest.mark.parametrize("tokens", [1, 2])
@torch.no_grad()  # the engine's mode: under grad, linear() routes to F.linear (no backward)
def test_shared_experts_as_gemv_pairs_equal_their_own_mlp(monkeypatch, n_shared, tokens):
    """TREEVERIFY_MOE_GEMV_SHARED=1: the shared experts stacked after the routed ones and run as
    n_shared more pairs a token of the expert GEMVs equal the layer with their own MLP (bf16
    roundings apart), the same counts; with one shared expert its MLP's weights become views
    into the stack (no second copy) and its own forward still gives the same output."""
    import dataclasses

    from treeverify.models import moe_gemv
    from treeverify.models.moe import DeepseekMoE
    from treeverify.models.random_shapes import RANDOM_SHAPES

    cfg = dataclasses.replace(RANDOM_SHAPES["random:mla-moe"](), n_shared_experts=n_shared)
    seen = []
    real = moe_gemv.routed

    def counted(*a, **kw):
        seen.append(kw.get("stacked_shared", 0))
        return real(*a, **kw)

    monkeypatch.setattr(moe_gemv, "routed", counted)
    monkeypatch.setenv("TREEVERIFY_MOE_GEMV", "1")
    outs = {}
    g = torch.Generator(device="cuda").manual_seed(7 * n_shared + tokens)
    h = torch.randn(tokens, cfg.hidden_size, device="cuda", generator=g).to(BF16)
    for flag in ("0", "1"):
        monkeypatch.setenv("TREEVERIFY_MOE_GEMV_SHARED", flag)
        torch.manual_seed(3)  # the same weights both times
        moe = DeepseekMoE(cfg).cuda().to(BF16)
        moe.gate.float()
        moe.shared_experts.fuse()
        moe.impl = "grouped_mm"
        own = moe.shared_experts(h)  # before stacking: the shared MLP's own weights
        outs[flag] = moe(h)
        assert seen[-1] == (n_shared if flag == "1" else 0)
        assert torch.equal(moe.shared_experts(h), own)  # after: the same, views or not
    (a, ca), (b, cb) = outs["0"], outs["1"]
    assert torch.equal(ca, cb)
    torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=1e-2)
    assert (b.float() - a.float()).abs().mean() < 2e-4 * max(1.0, a.float().abs().max().item())
    sh = moe.shared_experts
    stack = moe.w_gate_up_all
    inside = stack.data_ptr() <= sh.gate_proj.weight.data_ptr() < stack.data_ptr() + stack.nbytes
    assert inside == (n_shared == 1)
