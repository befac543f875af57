"""models/norm_linear.py on a GPU: the norm instances of decode_gemv.cu / skinny_gemm.cu
against an fp32 reference (rmsnorm(round(x + r)) * gamma, then the product) and the two-step
path (add_rmsnorm + linear): no less accurate than the two steps, the residual stream's sum
(and a strided tap) bit-equal to add_rmsnorm's, written over poison; no residual; bias; inside a
CUDA graph on fresh inputs; and the engine with its Llama layers folded (tiny-code,
TREEVERIFY_NORM_LINEAR=1): its forwards' logits against the unfolded ones. Skipped without a
GPU; tests/test_norm_linear.py checks the CPU side."""

from __future__ import annotations

import pytest
import torch

from linear_switches import linear_switches
from treeverify.models import gemv, norm_linear
from treeverify.models.fused_ops import add_rmsnorm
from treeverify.models.layers import RMSNorm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture
def folded(monkeypatch):
    yield from linear_switches(monkeypatch, TREEVERIFY_DECODE_GEMV="1", TREEVERIFY_SKINNY_GEMM="1")


def _case(m: int, k: int, n: int, seed: int, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)

    norm = RMSNorm(k, 1e-5).cuda().to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(k, generator=g, device="cuda"))
    norm.weight.requires_grad_(False)
    return rnd(m, k, scale=2.0), rnd(m, k), norm, rnd(n, k, scale=k**-0.5), rnd(n, scale=0.1)


def _reference(x, residual, norm, weight, bias):
    s = (x.float() + residual.float()).to(x.dtype).float() if residual is not None else x.float()
    h = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.float()
    return torch.nn.functional.linear(h, weight.float(), None if bias is None else bias.float())


@pytest.mark.parametrize("m", [1, 2, 5, 17, 32])
@pytest.mark.parametrize("with_residual", [True, False], ids=["add", "first-norm"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_norm_instances_match_the_reference_and_the_two_steps(folded, m, with_residual,
                                                               with_bias):  # fmt: skip
    k, n = 512, 3 * 256  # (32 rows of 1024 columns would pass the shared-memory cap)
    x, residual, norm, weight, bias = _case(m, k, n, seed=m * 7 + with_residual)
    residual = residual if with_residual else None
    bias = bias if with_bias else None
    kernel = norm_linear.fused_kernel(x, residual, norm, weight, bias)
    assert kernel is (gemv.gemv if m == 1 else gemv.skinny)
    tap_buf = torch.full((m, 3 * k), float("nan"), dtype=x.dtype, device="cuda")
    tap = tap_buf[:, k : 2 * k] if with_residual else None
    r_out = torch.full_like(x, float("nan")) if with_residual else None
    y = kernel(x, weight, bias, norm=gemv.NormOperands(residual, r_out, tap, norm.weight, norm.eps))
    torch.cuda.synchronize()
    ref = _reference(x, residual, norm, weight, bias)
    if with_residual:
        two_h, two_sum = add_rmsnorm(x, residual, norm)
        assert torch.equal(r_out, two_sum) and torch.equal(tap, two_sum)
        assert bool(tap_buf[:, :k].isnan().all()) and bool(tap_buf[:, 2 * k :].isnan().all())
    else:
        two_h = norm(x)
    two = torch.nn.functional.linear(two_h.float(), weight.float(),
                                     None if bias is None else bias.float())  # fmt: skip
    err, err_two = (y.float() - ref).abs().max(), (two - ref).abs().max()
    assert not y.isnan().any()
    assert err <= 2 * err_two + 2e-3 * ref.abs().max(), (float(err), float(err_two))


def test_add_norm_linear_in_a_graph_reads_fresh_inputs(folded):
    m, k, n = 17, 1024, 512
    x, residual, norm, weight, _ = _case(m, k, n, seed=11)
    out = {}
    for _ in range(2):  # warm (kernel loads) outside the capture
        out["y"], out["s"] = norm_linear.add_norm_linear(x, residual, norm, weight)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out["y"], out["s"] = norm_linear.add_norm_linear(x, residual, norm, weight)
    for seed in (1, 2):
        fx, fr, *_ = _case(m, k, n, seed=100 + seed)
        x.copy_(fx)
        residual.copy_(fr)
        graph.replay()
        y, s = norm_linear.add_norm_linear(x, residual, norm, weight)
        torch.cuda.synchronize()
        assert torch.equal(out["y"], y) and torch.equal(out["s"], s)


def test_folded_engine_logits_track_the_unfolded(monkeypatch):
    """tiny-code's forwards folded or not (same weights): 24 one-row forwards (the GEMV) and a
    17-row one (the few-row kernel): every row's logits within bf16 noise, and the same argmax
    wherever the unfolded row's top-2 margin exceeds twice the row's largest difference (a flip
    there needs a larger change than the roundings made; a near-tie may flip: on random tokens
    the forty-eighth and forty-ninth sessions' runs agreed on 20 of 24 one-row argmaxes, which
    the former "90% agree" check failed)."""
    pytest.importorskip("safetensors")
    from treeverify.engine.llm import LLM

    logits = {}
    ids = torch.randint(3, 200, (24,), generator=torch.Generator().manual_seed(5)).cuda()
    pos = torch.arange(24, device="cuda")
    for flag in ("0", "1"):
        monkeypatch.setenv("TREEVERIFY_NORM_LINEAR", flag)
        llm = LLM("tiny-code", device="cuda", num_pages=64, disable_cuda_graph=True)
        model = llm.runner.model
        assert model.fold_norms == (flag == "1")
        with torch.inference_mode():  # TorchAttention: no cache; a row sees the rows before
            logits[(flag, 1)] = torch.cat(
                [model(ids[i : i + 1], pos[i : i + 1]).float() for i in range(24)]
            )  # (24, V) one row each
            logits[(flag, 17)] = model(ids[:17], pos[:17]).float()  # (17, V)
        del llm
    for rows in (1, 17):
        a, b = logits[("0", rows)], logits[("1", rows)]
        assert (a - b).abs().max() <= 0.05 * a.abs().max(), rows
        top2 = a.topk(2, dim=-1).values  # (rows, 2)
        clear = top2[:, 0] - top2[:, 1] > 2 * (a - b).abs().amax(-1)  # (rows,)
        assert bool(clear.any()), (rows, "no row with a clear top-1: the check saw nothing")
        same = a.argmax(-1) == b.argmax(-1)
        assert bool(same[clear].all()), (rows, same.tolist(), clear.tolist())


def test_folded_drafter_tracks_the_unfolded(folded):
    """A DFlash drafter's ring draft (16-row blocks: the few-row kernel's norm instance) with
    its norms folded (`forward_ring_folded`) or not: logits within bf16 noise, the same argmax
    on nearly every row."""
    from dflash_rings import drafter, rings

    d = drafter(block_size=16, device="cuda")
    store, meta = rings(d, 96, [0, 40, 96, 17], [0, 150, 96, 17], seed=13, device="cuda")
    depth = d.block_size - 1
    with torch.inference_mode():
        want = d.propose_from_ring(store, meta, 96, depth).float()  # (B, L, V)
        d.fold_norms = True
        got = d.propose_from_ring(store, meta, 96, depth).float()
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
