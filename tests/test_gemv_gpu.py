"""The decode GEMV (models/gemv.py) compiled on a GPU: against an fp32 reference on the shapes
the engine runs (the 1B shape's projections, odd sizes, bias), eager and replayed from a CUDA
graph with new inputs, and `linear`'s dispatch (more rows than GEMV_MAX_ROWS, weights over
GEMV_MAX_BYTES, unaligned operands: cuBLAS)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from linear_switches import linear_switches  # noqa: E402
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


def _assert_graph_replays_new_inputs(x: torch.Tensor, w: torch.Tensor, eager) -> None:
    """`linear(x, w)` captured once, replayed on fresh x (its output poisoned before each
    replay), bit-equal to `eager(x, w)` (the same kernel called directly)."""
    gemv_mod.linear(x, w)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemv_mod.linear(x, w)
    for _ in range(3):
        x.copy_(torch.randn(x.shape, device="cuda").to(x.dtype))
        y.fill_(float("nan"))
        graph.replay()
        torch.testing.assert_close(y, eager(x, w), rtol=0, atol=0)


def test_gemv_in_a_cuda_graph_replays_new_inputs():
    n, k = 3072, 2048
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    assert gemv_mod.uses_gemv(x, w)
    _assert_graph_replays_new_inputs(x, w, gemv_mod.gemv)


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


def _assert_norm_chain_replays(rows: int, h: int) -> None:
    """A captured chain norm -> linear -> norm -> linear over `rows` rows, each replay on fresh
    inputs, bit-equal to the same chain run eagerly (with PDL's launches too): a linear kernel
    launched by PDL that read x before the norm finished would show a stale or half-written x."""
    from treeverify.models.fused_ops import add_rmsnorm
    from treeverify.models.layers import RMSNorm

    norms = [RMSNorm(h, 1e-6).cuda().to(torch.bfloat16) for _ in range(2)]
    for nm in norms:
        nm.weight.data.uniform_(0.5, 1.5)
    ws = [(torch.randn(h, h, device="cuda") / h**0.5).bfloat16() for _ in range(2)]
    x = torch.empty(rows, h, device="cuda", dtype=torch.bfloat16)
    res = torch.empty_like(x)

    def chain():
        y, r = add_rmsnorm(x, res, norms[0])
        y = gemv_mod.linear(y, ws[0])
        y, _ = add_rmsnorm(y, r, norms[1])
        return gemv_mod.linear(y, ws[1])

    with torch.no_grad():  # the norms' weights require grad: the kernels run without autograd
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


def test_norm_then_gemv_chain_by_pdl_in_a_graph_reads_the_finished_norm():
    """The GEMV by programmatic dependent launch starts while the Triton norm before it runs
    (TREEVERIFY_DECODE_GEMV_PDL auto on sm_90+): it must still read the norm's finished output."""
    from treeverify.models import pdl

    index = torch.cuda.current_device()
    assert pdl.decode_gemv(index) == (torch.cuda.get_device_capability(index)[0] >= 9)
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    assert gemv_mod.uses_gemv(torch.empty(1, 2048, **bf16), torch.empty(2048, 2048, **bf16))
    _assert_norm_chain_replays(1, 2048)


# The few-row kernel (skinny_gemm.cu): tiny-code's layers, its drafter's fc, an odd size and the
# 1B qkv past the dispatch's cap, at the row counts a verify forward and a drafter block run.
SKINNY_SHAPES = [(512, 256), (256, 256), (1280, 256), (256, 640), (8192, 256), (256, 768),
                 (1008, 96), (3072, 2048)]  # fmt: skip
SKINNY_ROWS = [2, 5, 8, 9, 16, 17, 24, 25, 32]


@pytest.fixture
def fused_silu_on(monkeypatch):
    """TREEVERIFY_FUSED_SILU_DOWN=1 (and the few-row kernel on) for this test."""
    yield from linear_switches(monkeypatch, TREEVERIFY_FUSED_SILU_DOWN="1",
                               TREEVERIFY_SKINNY_GEMM="1")  # fmt: skip


@pytest.fixture
def skinny_on(monkeypatch):
    """TREEVERIFY_SKINNY_GEMM=1 for this test (whatever the process's environment says)."""
    yield from linear_switches(monkeypatch, TREEVERIFY_SKINNY_GEMM="1")


@pytest.mark.parametrize("n,k", SKINNY_SHAPES)
@pytest.mark.parametrize("m", SKINNY_ROWS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_few_row_kernel_matches_fp32_reference(n, k, m, dtype):
    x = torch.randn(m, k, device="cuda").to(dtype)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
    b = torch.randn(n, device="cuda").to(dtype) if n % 3 == 0 else None
    got = gemv_mod.skinny(x, w, b)
    want = x.float() @ w.float().T + (b.float() if b is not None else 0.0)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    err = (got.float() - want).abs().max()
    ref = (torch.nn.functional.linear(x, w, b).float() - want).abs().max()
    assert err <= 2 * ref + 1e-3  # as close to fp32 as cuBLAS's own result
    torch.testing.assert_close(gemv_mod.skinny(x, w, b), got, rtol=0, atol=0)  # deterministic


@pytest.mark.parametrize("m", [9, 17, 32])
def test_few_row_kernel_reads_only_its_rows_and_columns_of_strided_operands(m):
    """x a view of every other row of a wider buffer and W the first K columns of a wider one
    (row stride K + 24: the kernel's second weight row block sits 8 strides on); everything
    outside the views holds NaN: the result depends only on the views."""
    n, k = 512, 256
    buf = torch.full((2 * m + 8, k), float("nan"), device="cuda", dtype=torch.bfloat16)
    x = buf[: 2 * m : 2]  # (M, K), row stride 2K
    x.copy_(torch.randn(m, k, device="cuda").to(torch.bfloat16))
    wbuf = torch.full((n, k + 24), float("nan"), device="cuda", dtype=torch.bfloat16)
    w = wbuf[:, :k]  # (N, K), row stride K + 24
    w.copy_((torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16))
    got = gemv_mod.skinny(x, w)
    assert torch.isfinite(got).all()
    want = gemv_mod.skinny(x.contiguous(), w.contiguous())
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_few_row_dispatch_and_graph_replay(skinny_on):
    """`linear` takes the few-row kernel for 2..32 rows on small weights (cuBLAS past the cap,
    past 32 rows, on K not a multiple of 32), and a captured call replays new inputs bit-equal
    to the eager call."""
    w = (torch.randn(512, 256, device="cuda") / 16).to(torch.bfloat16)
    big = torch.randn(2048, 1024, device="cuda").to(torch.bfloat16)  # 4 MB > the cap
    assert gemv_mod.uses_skinny(torch.randn(17, 256, device="cuda").bfloat16(), w)
    assert not gemv_mod.uses_skinny(torch.randn(1, 256, device="cuda").bfloat16(), w)  # GEMV
    assert not gemv_mod.uses_skinny(torch.randn(33, 256, device="cuda").bfloat16(), w)
    assert not gemv_mod.uses_skinny(torch.randn(17, 1024, device="cuda").bfloat16(), big)
    x17 = torch.randn(17, 256, device="cuda").bfloat16()
    assert not gemv_mod.uses_skinny(x17, w, torch.randn(512, device="cuda"))  # fp32 bias
    assert gemv_mod.uses_skinny(x17, w, torch.randn(512, device="cuda").bfloat16())
    wg = w.clone().requires_grad_(True)
    assert not gemv_mod.uses_skinny(x17, wg)  # autograd: F.linear
    with torch.no_grad():
        assert gemv_mod.uses_skinny(x17, wg)
    w24 = torch.randn(24, 256, device="cuda").bfloat16()  # N not a multiple of 16
    assert not gemv_mod.uses_skinny(torch.randn(4, 256, device="cuda").bfloat16(), w24)
    w48 = torch.randn(64, 48, device="cuda").bfloat16()
    assert not gemv_mod.uses_skinny(torch.randn(4, 48, device="cuda").bfloat16(), w48)
    _assert_graph_replays_new_inputs(torch.randn(17, 256, device="cuda").bfloat16(), w,
                                     gemv_mod.skinny)  # fmt: skip


def test_norm_then_few_row_chain_by_pdl_in_a_graph_reads_the_finished_norm(skinny_on):
    """As the GEMV's chain test, for 17 rows through the few-row kernel (launched by PDL on
    sm_90+, its weights loaded before it waits for the norm)."""
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    assert gemv_mod.uses_skinny(torch.empty(17, 256, **bf16), torch.empty(256, 256, **bf16))
    _assert_norm_chain_replays(17, 256)


def test_tiny_code_forward_with_the_few_row_kernel_matches_cublas(skinny_on, monkeypatch):
    """tiny-code's 17-row forward (a budget-16 verify's row count), fused as the engine runs it,
    with every linear on the few-row kernel against the same forward on cuBLAS, both measured
    against the fp32 forward: the few-row kernel's logits no farther from it than cuBLAS's
    (bf16 rounding of the activations through every layer puts single logits 0.1-0.2 apart
    between two correct bf16 forwards: an absolute bound between them failed 4 of 4 random
    inputs on an H100), and its greedy tokens as often equal to fp32's as cuBLAS's are."""
    from treeverify.models import load_model

    _, model, _ = load_model("tiny-code", dtype=torch.bfloat16, device="cuda")
    _, ref_model, _ = load_model("tiny-code", dtype=torch.float32, device="cuda")
    model.fuse_for_inference()
    ref_model.fuse_for_inference()
    ids = torch.randint(3, model.config.vocab_size, (17,), device="cuda")
    pos = torch.arange(17, device="cuda")
    with torch.no_grad():
        ref = ref_model(ids, pos).float()  # [17, vocab]
        assert gemv_mod.skinny_enabled()
        got = model(ids, pos).float()
        monkeypatch.setenv("TREEVERIFY_SKINNY_GEMM", "0")
        gemv_mod.skinny_enabled.cache_clear()
        want = model(ids, pos).float()
    err_got, err_want = (got - ref).abs(), (want - ref).abs()
    print(
        f"max |err| few-row {err_got.max():.4f} cuBLAS {err_want.max():.4f}; "
        f"mean {err_got.mean():.5f} / {err_want.mean():.5f}"
    )
    assert err_got.mean() <= 1.25 * err_want.mean() + 1e-3
    assert err_got.max() <= 2.0 * err_want.max() + 0.02
    # greedy tokens: the few-row kernel's argmax leaves fp32's no more often than cuBLAS's does
    # (a row whose top two logits are closer than the bf16 error may flip in either forward)
    flips_got = int((got.argmax(-1) != ref.argmax(-1)).sum())
    flips_want = int((want.argmax(-1) != ref.argmax(-1)).sum())
    assert flips_got <= flips_want + 1, (flips_got, flips_want)


@pytest.mark.parametrize("n,i", [(256, 640), (2048, 2048), (1008, 1024)])
@pytest.mark.parametrize("m", [1, 2, 9, 17, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_activation_on_the_load_matches_silu_mul_then_the_kernel(n, i, m, dtype):
    """act=True (the down projection's input silu(gate) * up made on the kernel's load) against
    fused_ops.silu_mul then the same kernel: equal (the same inputs summed in the same order;
    the activation itself is checked bit for bit below), and as close to fp32 as the unfused
    pair."""
    from treeverify.models.fused_ops import silu_mul

    if m > 1 and n * i * 2 > gemv_mod.SKINNY_MAX_BYTES:
        pytest.skip("past the few-row kernel's cap (the dispatch never sends it)")
    gu = (torch.randn(m, 2 * i, device="cuda") * 2).to(dtype)
    w = (torch.randn(n, i, device="cuda") / i**0.5).to(dtype)
    b = torch.randn(n, device="cuda").to(dtype)
    kernel = gemv_mod.gemv if m == 1 else gemv_mod.skinny
    got = kernel(gu, w, b, act=True)
    want = kernel(silu_mul(gu), w, b)
    assert torch.equal(got, want), (got != want).sum().item()
    ref = torch.nn.functional.linear(silu_mul(gu).float(), w.float(), b.float())
    err, ref_err = (got.float() - ref).abs().max(), (want.float() - ref).abs().max()
    assert err <= 2 * ref_err + 1e-2


@pytest.mark.parametrize("m", [1, 5, 17, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_activation_on_the_load_is_bit_equal_to_silu_mul(m, dtype):
    """Through an identity weight (each output one exact product, no sum rounds) the act
    instances' input is fused_ops.silu_mul's output bit for bit: the same operations as its
    Triton kernel (ex2.approx of g * -log2 e, div.full), the same two roundings. The gate values
    sweep -30..30 (silu's negative tail, its bend and its linear part)."""
    from treeverify.models.fused_ops import silu_mul

    i = 640
    g = torch.Generator(device="cuda").manual_seed(m)
    gate = torch.linspace(-30, 30, m * i, device="cuda").reshape(m, i)  # (M, I)
    gate = gate + torch.randn(m, i, device="cuda", generator=g) * 1e-3
    up = torch.randn(m, i, device="cuda", generator=g) * 3
    gu = torch.cat((gate, up), 1).to(dtype)  # (M, 2I)
    eye = torch.eye(i, device="cuda", dtype=dtype)
    kernel = gemv_mod.gemv if m == 1 else gemv_mod.skinny
    got = kernel(gu, eye, act=True)
    want = silu_mul(gu)
    assert torch.isfinite(want).all()
    assert torch.equal(got, want), (got != want).sum().item()


@pytest.mark.parametrize("m", [1, 17])
def test_activation_on_the_load_of_a_strided_gate_up(m):
    """gate|up a view of a wider buffer (row stride 2I + 64, NaN outside the view): the up half
    is read I columns after each row's start, whatever the stride."""
    n, i = 256, 640
    buf = torch.full((m, 2 * i + 64), float("nan"), device="cuda", dtype=torch.bfloat16)
    gu = buf[:, : 2 * i]  # (M, 2I)
    gu.copy_(torch.randn(m, 2 * i, device="cuda").to(torch.bfloat16))
    w = (torch.randn(n, i, device="cuda") / i**0.5).to(torch.bfloat16)
    kernel = gemv_mod.gemv if m == 1 else gemv_mod.skinny
    got = kernel(gu, w, act=True)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, kernel(gu.contiguous(), w, act=True), rtol=0, atol=0)


def test_down_of_silu_dispatch_and_a_fused_mlp(fused_silu_on):
    """down_of_silu takes the GEMV for one row, the few-row kernel for 2..32, both kernels'
    act instances, and silu_mul then cuBLAS past them; tiny-code's MLPs (fused, as the engine
    runs them) with it match them without it."""
    from treeverify.models import load_model
    from treeverify.models.fused_ops import silu_mul

    w = (torch.randn(256, 640, device="cuda") / 640**0.5).bfloat16()
    for m in (1, 17, 40):
        gu = torch.randn(m, 1280, device="cuda").bfloat16()
        got = gemv_mod.down_of_silu(gu, w)
        torch.testing.assert_close(got, gemv_mod.linear(silu_mul(gu), w), rtol=2e-2, atol=2e-2)
    _, model, _ = load_model("tiny-code", dtype=torch.bfloat16, device="cuda")
    model.fuse_for_inference()
    mlp = model.model.layers[3].mlp
    for m in (1, 17):
        x = torch.randn(m, 256, device="cuda").bfloat16()
        with torch.no_grad():
            got = mlp(x)
            want = gemv_mod.linear(silu_mul(gemv_mod.linear(x, *mlp.gate_up)),
                                   mlp.down_proj.weight)  # fmt: skip
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
