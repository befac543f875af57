"""The decode GEMV (models/gemv.py) compiled on a GPU: against an fp32 reference on the shapes
the engine runs (the 1B shape's projections, odd sizes, bias), eager and replayed from a CUDA
graph with new inputs, and `linear`'s dispatch (more rows than GEMV_MAX_ROWS, weights over
GEMV_MAX_BYTES, unaligned operands: cuBLAS)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from treeverify.models import gemv as gemv_mod  # noqa: E402

SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (1000, 1000), (24, 64)]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_matches_fp32_reference(n, k, m, dtype):
    x = torch.randn(m, k, device="cuda").to(dtype)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
    b = torch.randn(n, device="cuda").to(dtype) if n % 3 == 0 else None
    # the kernel runs on any shape; `linear` takes it up to the size caps (larger: cuBLAS won)
    assert gemv_mod.uses_gemv(x, w) == (n * k * 2 <= gemv_mod.GEMV_MAX_BYTES)
    got = gemv_mod.gemv(x, w, b)
    want = x.float() @ w.float().T + (b.float() if b is not None else 0.0)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    # as close to fp32 as cuBLAS's own bf16 result
    err = (got.float() - want).abs().max()
    ref = (torch.nn.functional.linear(x, w, b).float() - want).abs().max()
    assert err <= 2 * ref + 1e-3


def test_gemv_in_a_cuda_graph_replays_new_inputs():
    n, k = 3072, 2048
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    gemv_mod.linear(x, w)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemv_mod.linear(x, w)
    for _ in range(3):
        x.copy_(torch.randn(1, k, device="cuda").to(torch.bfloat16))
        y.fill_(float("nan"))
        graph.replay()
        torch.testing.assert_close(y, gemv_mod.linear(x, w), rtol=0, atol=0)  # same kernel


def test_unaligned_operands_take_cublas():
    w = torch.randn(64, 128, device="cuda").to(torch.bfloat16)
    x = torch.randn(1, 136, device="cuda").to(torch.bfloat16)[:, 4:132]  # starts 8 B in
    assert not gemv_mod.uses_gemv(x, w)
    torch.testing.assert_close(gemv_mod.linear(x, w), torch.nn.functional.linear(x, w))


def test_more_rows_than_the_gemv_take_cublas():
    w = torch.randn(64, 128, device="cuda").to(torch.bfloat16)
    x = torch.randn(gemv_mod.GEMV_MAX_ROWS + 1, 128, device="cuda").to(torch.bfloat16)
    assert not gemv_mod.uses_gemv(x, w)
    torch.testing.assert_close(gemv_mod.linear(x, w), torch.nn.functional.linear(x, w))


def test_norm_then_gemv_chain_by_pdl_in_a_graph_reads_the_finished_norm():
    """The GEMV by programmatic dependent launch starts while the Triton norm before it runs
    (TREEVERIFY_DECODE_GEMV_PDL auto on sm_90+): it must still read the norm's finished output.
    A captured chain norm -> GEMV -> norm -> GEMV, each replay on fresh inputs (a stale or
    half-written x would show), against the same chain run eagerly with PDL's launches too."""
    from treeverify.models import pdl
    from treeverify.models.fused_ops import add_rmsnorm
    from treeverify.models.layers import RMSNorm

    index = torch.cuda.current_device()
    assert pdl.decode_gemv(index) == (torch.cuda.get_device_capability(index)[0] >= 9)
    h = 2048
    norms = [RMSNorm(h, 1e-6).cuda().to(torch.bfloat16) for _ in range(2)]
    for nm in norms:
        nm.weight.data.uniform_(0.5, 1.5)
    ws = [(torch.randn(h, h, device="cuda") / h**0.5).bfloat16() for _ in range(2)]
    x = torch.empty(1, h, device="cuda", dtype=torch.bfloat16)
    res = torch.empty_like(x)

    def chain():
        y, r = add_rmsnorm(x, res, norms[0])
        y = gemv_mod.gemv(y, ws[0])
        y, _ = add_rmsnorm(y, r, norms[1])
        return gemv_mod.gemv(y, ws[1])

    x.normal_(), res.normal_()
    chain()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for _ in range(5):
        x.normal_(), res.normal_()
        want = chain().clone()
        out.fill_(float("nan"))
        graph.replay()
        torch.testing.assert_close(out, want, rtol=0, atol=0)
