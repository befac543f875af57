"""The decode GEMV (models/gemv.py) on Triton's CPU interpreter against an fp32 reference, and the
dispatch rule of `linear` (tests/test_gemv_gpu.py runs the kernel compiled, eager and captured).

Fresh random bf16 data for every shape; the output buffer comes from the kernel, so a row or
feature it failed to write would hold whatever `empty` gave (checked against the reference)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if torch.cuda.is_available():
    pytest.skip("a GPU is present: test_gemv_gpu.py runs there", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel is decorated

from treeverify.models import gemv as gemv_mod  # noqa: E402


@pytest.fixture(autouse=True)
def interpreted_kernel():
    gemv_mod._kernel.cache_clear()
    yield
    gemv_mod._kernel.cache_clear()


@pytest.mark.parametrize(
    ("m", "n", "k", "bias"),
    [(1, 24, 64, False), (2, 13, 100, True), (3, 40, 300, False), (4, 8, 2048, True)],
)
def test_gemv_matches_fp32_reference(m, n, k, bias):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    got = gemv_mod.gemv(x, w, b)
    want = x.float() @ w.float().T + (b.float() if bias else 0.0)  # (M, N)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


def test_gemv_reads_strided_rows_of_x():
    x = torch.randn(2, 512).to(torch.bfloat16)[:, :256]  # row stride 512, unit column stride
    w = torch.randn(16, 256).to(torch.bfloat16)
    torch.testing.assert_close(gemv_mod.gemv(x, w).float(), x.float() @ w.float().T,
                               rtol=1e-2, atol=1e-2)  # fmt: skip


def test_dispatch_rule_and_bad_shapes():
    w = torch.randn(8, 64).to(torch.bfloat16)
    assert not gemv_mod.uses_gemv(torch.randn(1, 64).to(torch.bfloat16), w)  # the CPU: F.linear
    x = torch.randn(3, 64).to(torch.bfloat16)
    torch.testing.assert_close(gemv_mod.linear(x, w), torch.nn.functional.linear(x, w))
    with pytest.raises(ValueError, match="x: expected"):
        gemv_mod.gemv(torch.randn(5, 64).to(torch.bfloat16), w)
    with pytest.raises(ValueError, match="x: expected"):
        gemv_mod.gemv(torch.randn(1, 32).to(torch.bfloat16), w)
    lin = gemv_mod.Linear(64, 8, bias=True)
    assert set(lin.state_dict()) == {"weight", "bias"}  # checkpoints load as into nn.Linear
