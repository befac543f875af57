"""models/moe_gemv.py's expert GEMVs on Triton's CPU interpreter (TRITON_INTERPRET=1): a
decode-sized MoE batch's routed experts in pair order (gate|up GEMV, the activation on the down
GEMV's load, the weighted sum) against each pair's expert MLP in fp32, and the expert counts
against index_add. Fresh random weights and rows; sizes that are not multiples of the kernel's
row and column blocks; experts repeated across tokens. tests/test_fused_moe_gpu.py runs them
compiled on a GPU, inside the MoE layer."""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import cache_cleared, interpret_on_cpu

interpret_on_cpu("tests/test_fused_moe_gpu.py")

from moe_reference import dispatch_reference, routed_reference  # noqa: E402
from treeverify.models import fused_moe, moe_gemv  # noqa: E402

gemv_kernels = cache_cleared(moe_gemv._kernels)  # decorated under the interpreter
moe_kernels = cache_cleared(fused_moe._kernels)
BF16 = torch.bfloat16


@pytest.mark.parametrize("t,k,e,hidden,inter", [(1, 6, 16, 96, 72), (3, 2, 5, 130, 40)])
@pytest.mark.parametrize("with_valid", [False, True], ids=["all-rows", "valid-rows"])
def test_routed_experts_equal_each_pairs_mlp(t, k, e, hidden, inter, with_valid):
    g = torch.Generator().manual_seed(t * 31 + e)
    x = torch.randn(t, hidden, generator=g).to(BF16)
    idx = torch.randint(0, e, (t, k), generator=g)
    w = torch.rand(t, k, generator=g)
    w_gate_up = (torch.randn(e, 2 * inter, hidden, generator=g) / hidden**0.5).to(BF16)
    w_down = (torch.randn(e, hidden, inter, generator=g) / inter**0.5).to(BF16)
    valid = torch.rand(t, generator=g) < 0.7 if with_valid else None
    assert moe_gemv.takes("1", x, idx, w_gate_up)
    h = moe_gemv.expert_gemv(x, idx, w_gate_up)
    want_h = torch.stack([w_gate_up[int(idx.view(-1)[p])].float() @ x[p // k].float()
                          for p in range(t * k)])  # fmt: skip
    torch.testing.assert_close(h.float(), want_h, rtol=1e-2, atol=1e-2)  # one bf16 rounding
    out, valid_counts = moe_gemv.routed(x, idx, w, w_gate_up, w_down, valid)
    assert out.dtype == BF16 and out.shape == (t, hidden)
    want = routed_reference(x, idx, w, w_gate_up, w_down)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
    want_counts = dispatch_reference(x, idx, valid, e)[3]
    assert torch.equal(valid_counts, want_counts)
    # into a running counter in place (nothing returned), the shared experts' output added
    counter = torch.randint(0, 100, (e,), generator=g)
    before = counter.clone()
    shared = torch.randn(t, hidden, generator=g).to(BF16)
    out2, none = moe_gemv.routed(x, idx, w, w_gate_up, w_down, valid, counter, shared)
    assert none is None and torch.equal(counter, before + want_counts)
    torch.testing.assert_close(out2.float(), (out.float() + shared.float()), rtol=2e-2, atol=2e-2)


def test_which_batches_each_mode_takes():
    """TREEVERIFY_MOE_GEMV: auto takes batches of at most AUTO_MAX_PAIRS pairs, 1 up to
    MAX_PAIRS, 0 none; fp32 or non-contiguous operands never."""
    w_gate_up = torch.zeros(8, 64, 32, dtype=BF16)
    x = torch.randn(4, 32).to(BF16)
    small = torch.randint(0, 8, (4, moe_gemv.AUTO_MAX_PAIRS // 4))
    large = torch.randint(0, 8, (4, moe_gemv.AUTO_MAX_PAIRS // 4 + 1))
    assert moe_gemv.takes("auto", x, small, w_gate_up)
    assert not moe_gemv.takes("auto", x, large, w_gate_up)
    assert moe_gemv.takes("1", x, large, w_gate_up) and not moe_gemv.takes("0", x, small, w_gate_up)
    assert not moe_gemv.takes("1", x.float(), small, w_gate_up)
    assert not moe_gemv.takes("1", x.t().contiguous().t(), small, w_gate_up)
    big = torch.zeros(moe_gemv.MAX_PAIRS + 1, 1, dtype=torch.int64)
    assert not moe_gemv.takes("1", torch.zeros(moe_gemv.MAX_PAIRS + 1, 32, dtype=BF16), big,
                              w_gate_up)  # fmt: skip


@pytest.mark.parametrize("chunks", [1, 2])
def test_shared_experts_as_more_pairs_equal_the_shared_mlp(chunks):
    """TREEVERIFY_MOE_GEMV_SHARED: the shared MLP (intermediate chunks x I) stacked as `chunks`
    more experts after the routed ones and run as more pairs a token: the output equals the
    routed sum plus the shared MLP in fp32 (within bf16 roundings), the counts still count only
    the routed pairs (the shared chunks' indices never reach the counter)."""
    from treeverify.models.layers import MLP

    t, k, e, hidden, inter = 3, 2, 5, 130, 40
    g = torch.Generator().manual_seed(chunks * 7 + 1)
    x = torch.randn(t, hidden, generator=g).to(BF16)
    idx = torch.randint(0, e, (t, k), generator=g)
    w = torch.rand(t, k, generator=g)
    w_gate_up = (torch.randn(e, 2 * inter, hidden, generator=g) / hidden**0.5).to(BF16)
    w_down = (torch.randn(e, hidden, inter, generator=g) / inter**0.5).to(BF16)
    mlp = MLP(hidden, inter * chunks).to(BF16)
    for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        lin.weight.data = (torch.randn(lin.weight.shape, generator=g) * 0.1).to(BF16)
    rows = [slice(j * inter, (j + 1) * inter) for j in range(chunks)]
    gu_all = torch.cat([w_gate_up, torch.stack([torch.cat((mlp.gate_proj.weight[r],
                        mlp.up_proj.weight[r])) for r in rows])])  # fmt: skip
    d_all = torch.cat([w_down, torch.stack([mlp.down_proj.weight[:, r] for r in rows])])
    valid = torch.tensor([True, False, True])
    counter = torch.zeros(e, dtype=torch.int64)
    out, none = moe_gemv.routed(x, idx, w, gu_all, d_all, valid, counter, stacked_shared=chunks)
    assert none is None and out.shape == (t, hidden)
    assert torch.equal(counter, dispatch_reference(x, idx, valid, e)[3])
    want = routed_reference(x, idx, w, w_gate_up, w_down) + mlp.float()(x.float())
    torch.testing.assert_close(out.float(), want, rtol=3e-2, atol=3e-2)
    with pytest.raises(ValueError, match="shared"):
        moe_gemv.routed(x, idx, w, gu_all, d_all, valid, counter, x, stacked_shared=chunks)
