"""models/fused_moe.py's dispatch and combine kernels on Triton's CPU interpreter
(TRITON_INTERPRET=1) against the PyTorch ops of moe.py's grouped-GEMM path: a stable argsort of
the (token, expert) pairs, the rows gathered in that order, the expert counts (all rows and valid
rows) and end offsets; then the outputs put back, weighted and summed over a token's k experts.

Fresh random data; experts repeat across tokens (and within one here, which the kernels allow);
batches from one decode token to several dispatch programs (pairs > BLOCK), a vocabulary of
experts that is not a power of two, a hidden size that is not a multiple of the column block.
tests/test_fused_moe_gpu.py runs them compiled on a GPU, inside the MoE layer.
"""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import cache_cleared, interpret_on_cpu

interpret_on_cpu("tests/test_fused_moe_gpu.py")

from moe_reference import combine_reference, dispatch_reference  # noqa: E402
from treeverify.models import fused_moe  # noqa: E402

interpreted_kernels = cache_cleared(fused_moe._kernels)  # decorated under the interpreter
BF16 = torch.bfloat16


@pytest.mark.parametrize("t,k,e,hidden", [(1, 8, 64, 256), (34, 8, 64, 200), (3, 2, 5, 130),
                                          (70, 1, 7, 64)])  # fmt: skip
@pytest.mark.parametrize("with_valid", [False, True], ids=["all-rows", "valid-rows"])
def test_dispatch_and_combine_equal_the_pytorch_ops(t, k, e, hidden, with_valid):
    g = torch.Generator().manual_seed(t * 100 + e)
    x = torch.randn(t, hidden, generator=g).to(BF16)
    idx = torch.randint(0, e, (t, k), generator=g)
    valid = torch.rand(t, generator=g) < 0.7 if with_valid else None
    assert fused_moe.fits(x, idx)
    xs, pos, counts, valid_counts, offs = fused_moe.dispatch(x, idx, valid, e)
    want = dispatch_reference(x, idx, valid, e)
    names = ("xs", "pos", "counts", "valid_counts", "offs")
    for name, got, exp in zip(names, (xs, pos, counts, valid_counts, offs), want, strict=False):
        assert torch.equal(got, exp), name
    assert (valid_counts is counts) == (valid is None)
    y = torch.randn(t * k, hidden, generator=g).to(BF16)  # the experts' outputs, sorted order
    w = torch.rand(t, k, generator=g)
    got = fused_moe.combine(y, pos, w, torch.float32)
    want_out = combine_reference(y, want[5], w)
    torch.testing.assert_close(got, want_out, rtol=1e-6, atol=1e-6)  # summation order only
    assert fused_moe.combine(y, pos, w, BF16).dtype == BF16
    # + the shared experts' output after the cast, rounded once more: exact in fp16 (the
    # interpreter's bf16 casts truncate, its fp16 ones round to nearest as the GPU's do)
    add = torch.randn(t, hidden, generator=g).to(torch.float16)
    with_add = fused_moe.combine(y, pos, w, torch.float16, add=add)
    assert torch.equal(with_add, (got.to(torch.float16).float() + add.float()).to(torch.float16))


def test_what_the_kernels_do_not_take():
    x = torch.randn(4, 32).to(BF16)
    idx = torch.randint(0, 8, (4, 2))
    assert fused_moe.fits(x, idx)
    assert not fused_moe.fits(x, idx.to(torch.int32))
    assert not fused_moe.fits(x.t(), torch.zeros(32, 1, dtype=torch.int64))  # x not contiguous
    big = torch.zeros(fused_moe.MAX_PAIRS + 1, 1, dtype=torch.int64)
    assert not fused_moe.fits(torch.zeros(fused_moe.MAX_PAIRS + 1, 8, dtype=BF16), big)


def test_which_batches_each_mode_takes():
    """TREEVERIFY_FUSED_MOE_DISPATCH: auto takes batches of at most AUTO_MAX_PAIRS pairs (where the
    kernels measured faster), 1 every batch that fits, 0 none; what does not fit never."""
    x = torch.randn(64, 32).to(BF16)
    small = torch.randint(0, 8, (64, fused_moe.AUTO_MAX_PAIRS // 64))  # exactly the bound
    large = torch.randint(0, 8, (64, fused_moe.AUTO_MAX_PAIRS // 64 + 1))
    assert fused_moe.takes("auto", x, small) and not fused_moe.takes("auto", x, large)
    assert fused_moe.takes("1", x, small) and fused_moe.takes("1", x, large)
    assert not fused_moe.takes("0", x, small)
    assert not fused_moe.takes("1", x, small.to(torch.int32))
