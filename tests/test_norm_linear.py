"""models/norm_linear.py off the GPU: where no norm kernel applies, `add_norm_linear` is
add_rmsnorm (or rmsnorm) then `linear`, bit for bit, and a Llama with its norms folded
(TREEVERIFY_NORM_LINEAR=1: `forward_folded`, `folded_residual_stream`) gives the unfolded
model's logits and taps exactly: the folding only moves where each add and norm runs.
tests/test_norm_linear_gpu.py runs the kernels."""

from __future__ import annotations

import pytest
import torch

from treeverify.models import norm_linear
from treeverify.models.config import LlamaConfig
from treeverify.models.fused_ops import add_rmsnorm
from treeverify.models.layers import RMSNorm
from treeverify.models.llama import LlamaForCausalLM


def _norm(k: int, g: torch.Generator) -> RMSNorm:
    norm = RMSNorm(k, 1e-5)
    norm.weight.data = 1 + 0.3 * torch.randn(k, generator=g)
    return norm


def test_without_a_kernel_it_is_the_two_steps_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    x, residual = torch.randn(5, 64, generator=g), torch.randn(5, 64, generator=g)
    weight, bias = torch.randn(24, 64, generator=g), torch.randn(24, generator=g)
    norm = _norm(64, g)
    assert norm_linear.fused_kernel(x, residual, norm, weight, bias) is None  # the CPU
    tap = torch.zeros(5, 3 * 64)[:, 64:128]
    y, summed = norm_linear.add_norm_linear(x, residual, norm, weight, bias, tap=tap)
    h, want_sum = add_rmsnorm(x, residual, norm)
    assert torch.equal(summed, want_sum) and torch.equal(tap, want_sum)
    assert torch.equal(y, torch.nn.functional.linear(h, weight, bias))
    y, summed = norm_linear.add_norm_linear(x, None, norm, weight)
    assert summed is x and torch.equal(y, torch.nn.functional.linear(norm(x), weight))
    with pytest.raises(ValueError, match="tap"):
        norm_linear.add_norm_linear(x, None, norm, weight, tap=tap)


@pytest.mark.parametrize("taps", [frozenset(), frozenset({0, 2}), frozenset({1, 3})])
def test_a_folded_llama_gives_the_unfolded_logits_and_taps(monkeypatch, taps):
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip
    torch.manual_seed(3)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
        for name, p in model.named_parameters():
            if "norm" in name:  # non-trivial gammas: a norm folded into the wrong place shows
                p.copy_(1 + 0.3 * torch.randn_like(p))
    model.capture_layers = taps
    ids, pos = torch.randint(0, 96, (11,)), torch.arange(11)
    out = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("TREEVERIFY_NORM_LINEAR", flag)
        model.fuse_for_inference()
        assert model.fold_norms == (flag == "1")
        with torch.no_grad():
            out[flag] = (model(ids, pos), model.captured)
    assert torch.equal(out["0"][0], out["1"][0])
    if taps:
        assert out["0"][1].shape == (11, len(taps) * 64)
        assert torch.equal(out["0"][1], out["1"][1])
    else:
        assert out["0"][1] is None and out["1"][1] is None
