"""models/fused_ops.py's residual_stream: the forward's captured taps (what a DFlash drafter
conditions on), written into their columns by each add's own kernel on a GPU (the PyTorch ops on
the CPU), against each tapped layer's output concatenated in layer order. Fresh random bf16
data; the tapped buffer is the function's own, so every column must be written."""

from __future__ import annotations

import pytest
import torch

from treeverify.models.fused_ops import residual_stream
from treeverify.models.layers import RMSNorm

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class _Layer:
    def __init__(self, norm: RMSNorm):
        self.input_layernorm = norm


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("taps", [{3, 0}, {4}, set()])
def test_residual_stream_taps_equal_the_layer_outputs_side_by_side(device, taps):
    h, layers, t = 256, 5, 3
    g = torch.Generator(device=device).manual_seed(len(taps) + 5)
    norms = [RMSNorm(h, 1e-5).to(device=device, dtype=torch.bfloat16) for _ in range(layers + 1)]
    for n in norms:
        n.weight.data.normal_(1.0, 0.1, generator=g)
    adds = [torch.randn(t, h, device=device, generator=g).to(torch.bfloat16)
            for _ in range(layers)]  # fmt: skip
    outputs = []

    def body(i, layer, x, residual):  # the layer adds adds[i] after its own fused add
        outputs.append(residual + adds[i])  # layer i's output, as the stream's add makes it
        return adds[i], residual

    x = torch.randn(t, h, device=device, generator=g).to(torch.bfloat16)
    _, tapped = residual_stream(x, [_Layer(n) for n in norms[:layers]], norms[-1], body, taps)
    if not taps:
        assert tapped is None
        return
    assert tapped.shape == (t, len(taps) * h) and tapped.dtype == torch.bfloat16
    assert torch.equal(tapped, torch.cat([outputs[i] for i in sorted(taps)], -1))


@pytest.mark.parametrize("taps", [{-1}, {5}, {0, 7}])
def test_residual_stream_refuses_taps_outside_its_layers(taps):
    """A tap past the layers would leave its columns unwritten (uninitialised memory handed
    to the drafter): a ValueError naming the argument instead."""
    norms = [RMSNorm(16, 1e-5) for _ in range(6)]
    with pytest.raises(ValueError, match=r"taps: expected layer indices in \[0, 5\)"):
        residual_stream(torch.randn(2, 16), [_Layer(n) for n in norms[:5]], norms[-1],
                        lambda i, layer, x, r: (x, r), taps)  # fmt: skip
