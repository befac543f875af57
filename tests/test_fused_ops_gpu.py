"""The decode path's fused Triton ops against the PyTorch ops they replace, on a GPU, bf16,
fresh random inputs, outputs poisoned first where the op writes into given memory."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from treeverify.engine.kv_store import store_kv
from treeverify.models.fused_ops import add_rmsnorm, rmsnorm, rope_qk, rope_qk_store, silu_mul
from treeverify.models.layers import RMSNorm, apply_rope_tables

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BF16 = torch.bfloat16


@pytest.mark.parametrize("t,h", [(1, 2048), (7, 4096), (33, 128)])
def test_add_rmsnorm(t, h, monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(t * h)
    x = torch.randn(t, h, device="cuda", generator=g).to(BF16)
    r = torch.randn(t, h, device="cuda", generator=g).to(BF16)
    norm = RMSNorm(h, 1e-5).cuda().to(BF16)
    norm.weight.data.normal_(1.0, 0.1, generator=g)
    y, r_out = add_rmsnorm(x, r, norm)
    want_r = r + x
    assert torch.equal(r_out, want_r)  # the add rounds exactly as torch's
    want = F.rms_norm(want_r.float(), (h,), norm.weight.float(), 1e-5)
    torch.testing.assert_close(y.float(), want, rtol=8e-3, atol=8e-3)  # one bf16 rounding
    # a tap: the sum also into a column block of wider rows, the neighbours untouched, by the
    # kernel (not the PyTorch fallback)
    from treeverify.models import fused_ops

    launched, launch = [], fused_ops._launch_norm

    def spy(*a):
        launched.append(len(a) > 4 and a[4] is not None)  # the tap handed to the kernel
        return launch(*a)

    monkeypatch.setattr(fused_ops, "_launch_norm", spy)
    taps = torch.full((t, 3 * h), float("nan"), device="cuda", dtype=BF16)
    y2, r2 = add_rmsnorm(x, r, norm, taps[:, h : 2 * h])
    assert launched == [True]
    assert torch.equal(y2, y) and torch.equal(r2, want_r)
    assert torch.equal(taps[:, h : 2 * h], want_r)
    assert taps[:, :h].isnan().all() and taps[:, 2 * h :].isnan().all()


@pytest.mark.parametrize("t,h,extra", [(1, 512, 64), (17, 1536, 0), (5, 7168, 0)])
def test_rmsnorm_of_strided_rows(t, h, extra):
    """fused_ops.rmsnorm (MLA's q_a and kv_a norms; kv_a's c_kv is a strided split, read in
    place) against F.rms_norm in fp32: one bf16 rounding; the output contiguous."""
    g = torch.Generator(device="cuda").manual_seed(t + h)
    wide = torch.randn(t, h + extra, device="cuda", generator=g).to(BF16)
    x = wide[:, :h]
    norm = RMSNorm(h, 1e-6).cuda().to(BF16)
    norm.weight.data.normal_(1.0, 0.1, generator=g)
    y = rmsnorm(x, norm)
    assert y.is_contiguous() and y.shape == (t, h)
    want = F.rms_norm(x.float(), (h,), norm.weight.float(), 1e-6)
    torch.testing.assert_close(y.float(), want, rtol=8e-3, atol=8e-3)


@pytest.mark.parametrize("t", [1, 17])
def test_rmsnorm_pair_equals_the_two_norms(t):
    """fused_ops.rmsnorm_pair on random:mla-moe's fused a-projection (1536 | 512 | 64): both
    ranges against F.rms_norm in fp32 (one bf16 rounding), and the first bit-equal to
    rmsnorm's kernel (the same arithmetic over the same block)."""
    from treeverify.models.fused_ops import rmsnorm_pair

    g = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(t, 1536 + 512 + 64, device="cuda", generator=g).to(BF16)
    norms = [RMSNorm(1536, 1e-6).cuda().to(BF16), RMSNorm(512, 1e-6).cuda().to(BF16)]
    for nm in norms:
        nm.weight.data.normal_(1.0, 0.1, generator=g)
    a, b = rmsnorm_pair(x, *norms)
    assert a.shape == (t, 1536) and b.shape == (t, 512) and a.is_contiguous()
    for got, nm, part in ((a, norms[0], x[:, :1536]), (b, norms[1], x[:, 1536:2048])):
        want = F.rms_norm(part.float(), (part.shape[1],), nm.weight.float(), 1e-6)
        torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=8e-3)
    assert torch.equal(a, rmsnorm(x[:, :1536], norms[0]))


@pytest.mark.parametrize("t,hq,hkv,d", [(1, 32, 8, 64), (5, 32, 8, 128), (17, 4, 2, 64)])
def test_rope_qk(t, hq, hkv, d):
    g = torch.Generator(device="cuda").manual_seed(t + d)
    qkv = torch.randn(t, hq + 2 * hkv, d, device="cuda", generator=g).to(BF16)
    ang = torch.rand(t, d // 2, device="cuda", generator=g) * 6.28
    cos2 = torch.cat((ang.cos(), ang.cos()), -1).to(BF16)
    sin2 = torch.cat((-ang.sin(), ang.sin()), -1).to(BF16)
    q, k = rope_qk(qkv, cos2, sin2, hq, hkv)
    want = apply_rope_tables(qkv[:, : hq + hkv], cos2, sin2)
    assert q.is_contiguous() and q.shape == (t, hq, d) and k.shape == (t, hkv, d)
    # within one bf16 rounding of a product (|x*cos| < 4: ulp 2^-6) of torch's mul, mul, add;
    # where the two products cancel the relative error is large, the absolute one is not
    # (measured on the H200: 0.5% of elements off by at most 0.0078). A wrong rotation is O(1).
    torch.testing.assert_close(q, want[:, :hq], rtol=8e-3, atol=1.6e-2)
    torch.testing.assert_close(k, want[:, hq:], rtol=8e-3, atol=1.6e-2)


@pytest.mark.parametrize("t,n", [(1, 8192), (9, 1408), (3, 100)])
def test_silu_mul(t, n):
    g = torch.Generator(device="cuda").manual_seed(n)
    gu = torch.randn(t, 2 * n, device="cuda", generator=g).to(BF16) * 3
    got = silu_mul(gu)
    a, b = gu.chunk(2, -1)
    torch.testing.assert_close(got, F.silu(a) * b, rtol=1.6e-2, atol=1e-2)


def test_store_kv_writes_exactly_the_slots():
    g = torch.Generator(device="cuda").manual_seed(0)
    kc = torch.randn(9, 16, 8, 64, device="cuda", generator=g).to(BF16)
    vc = torch.randn(9, 16, 8, 64, device="cuda", generator=g).to(BF16)
    kc0, vc0 = kc.clone(), vc.clone()
    qkv = torch.randn(3, 32 + 16, 64, device="cuda", generator=g).to(BF16)
    k, v = qkv[:, 32:40].contiguous(), qkv[:, 40:]  # v strided, as the model passes it
    slots = torch.tensor([5, 70, 143], device="cuda")
    store_kv(slots, k, v, kc, vc)
    kc0.view(-1, 8, 64)[slots] = k
    vc0.view(-1, 8, 64)[slots] = v
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)


@pytest.mark.parametrize(
    "t,hq,hkv,d,page", [(1, 32, 8, 64, 16), (17, 4, 2, 64, 16), (5, 8, 1, 128, 1)]
)
def test_rope_qk_store_equals_rope_qk_then_store_kv(t, hq, hkv, d, page):
    """One kernel for rope_qk + store_kv (the engine's GQA layers): q bit-equal to rope_qk's, the
    cache bit-equal to store_kv's writes of the rotated k and of v at shuffled slots, every
    other slot untouched (the caches start random, q poisoned by new_empty's garbage only);
    None where the kernel does not apply (an fp32 cache, a non-contiguous qkv)."""
    g = torch.Generator(device="cuda").manual_seed(t * d + hq)
    qkv = torch.randn(t, hq + 2 * hkv, d, device="cuda", generator=g).to(BF16)
    ang = torch.rand(t, d // 2, device="cuda", generator=g) * 6.28
    cos2 = torch.cat((ang.cos(), ang.cos()), -1).to(BF16)
    sin2 = torch.cat((-ang.sin(), ang.sin()), -1).to(BF16)
    pages = -(-(4 * t) // page)
    kc = torch.randn(pages, page, hkv, d, device="cuda", generator=g).to(BF16)
    vc = torch.randn(pages, page, hkv, d, device="cuda", generator=g).to(BF16)
    slots = torch.randperm(pages * page, device="cuda", generator=g)[:t]
    want_q, want_k = rope_qk(qkv, cos2, sin2, hq, hkv)
    want_kc, want_vc = kc.clone(), vc.clone()
    store_kv(slots, want_k, qkv[:, hq + hkv :], want_kc, want_vc)
    q = rope_qk_store(qkv, cos2, sin2, hq, hkv, slots, kc, vc)
    assert q is not None and q.is_contiguous()
    assert torch.equal(q, want_q)
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)
    assert rope_qk_store(qkv, cos2, sin2, hq, hkv, slots, kc.float(), vc.float()) is None
    wide = torch.randn(t, hq + 2 * hkv, 2 * d, device="cuda", generator=g).to(BF16)[..., :d]
    assert rope_qk_store(wide, cos2, sin2, hq, hkv, slots, kc, vc) is None


def test_moe_grouped_mm_equals_grouped():
    """The capture-safe grouped-GEMM MoE (bf16, device-side group offsets) against the
    host-grouped one on the same routing, and the counts it reports."""
    from treeverify.models import load_model

    _, model, _ = load_model("tiny-kimi", dtype=BF16, device="cuda")
    moe = next(m for m in model.modules() if hasattr(m, "n_experts"))
    g = torch.Generator(device="cuda").manual_seed(3)
    x = (torch.randn(37, 128, device="cuda", generator=g) * 0.5).to(BF16)
    moe.impl = "grouped"
    want, want_counts = moe(x)
    moe.impl = "grouped_mm"
    got, counts = moe(x)
    assert torch.equal(counts, want_counts)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("d,theta", [(64, 10000.0), (128, 500000.0), (32, 1000000.0)])
def test_rope_table_rows_equal_the_computed_ones(d, theta):
    """Rope.tabulate's rows, read by rope_rows (one kernel, eager and in a CUDA graph), are the
    tables rotate_half_tables computes for the same positions, bit for bit; positions past the
    table read its last row."""
    from treeverify.models.config import RopeConfig
    from treeverify.models.layers import Rope

    rope = Rope(RopeConfig(theta=theta), d).cuda()
    limit = 5000
    g = torch.Generator(device="cuda").manual_seed(d)
    pos = torch.randint(0, limit, (37,), device="cuda", generator=g)  # (T,)
    pos[:3] = torch.tensor([0, limit - 1, 1])
    want = rope.rotate_half_tables(pos, BF16)  # no tables yet: computed
    rope.tabulate(limit, BF16, "cuda")
    assert rope.tables is not None and rope.tables[0].shape == (limit, d)
    got = rope.rotate_half_tables(pos, BF16)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(rope.rotate_half_tables(pos.int(), BF16)[0], want[0])
    static = pos.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cos2, sin2 = rope.rotate_half_tables(static, BF16)
    fresh = torch.randint(0, limit, (37,), device="cuda", generator=g)
    static.copy_(fresh)
    cos2.fill_(float("nan"))
    graph.replay()
    rope_off = Rope(RopeConfig(theta=theta), d).cuda()
    want2 = rope_off.rotate_half_tables(fresh, BF16)
    assert torch.equal(cos2, want2[0]) and torch.equal(sin2, want2[1])
    past = torch.tensor([limit + 5], device="cuda")
    assert torch.equal(rope.rotate_half_tables(past, BF16)[0][0], rope.tables[0][limit - 1])
    assert rope.rotate_half_tables(pos, torch.float16)[0].dtype == torch.float16  # computed


def test_tiny_code_and_its_drafter_read_their_rope_tables(monkeypatch):
    """fuse_for_inference tabulates tiny-code's rotary tables (the engine's drafter too, past the
    target's context), and the model's logits are the same bits with the tables or without."""
    from treeverify.engine.llm import LLM
    from treeverify.models import load_model

    _, model, _ = load_model("tiny-code", dtype=BF16, device="cuda")
    model.eval().fuse_for_inference()
    assert model.rope.tables is not None
    assert model.rope.tables[0].shape[0] > model.config.max_position_embeddings
    ids = torch.randint(3, model.config.vocab_size, (24,), device="cuda")
    pos = torch.arange(100, 124, device="cuda")
    with torch.no_grad():
        got = model(ids, pos)
        model.rope.tables = None  # computed each forward, as before
        want = model(ids, pos)
    assert torch.equal(got, want)
    monkeypatch.setenv("TREEVERIFY_ROPE_TABLE", "0")
    model.fuse_for_inference()
    assert model.rope.tables is None
    monkeypatch.delenv("TREEVERIFY_ROPE_TABLE")
    llm = LLM("tiny-code", device="cuda", num_pages=256, max_num_seqs=1, cuda_graph_max_bs=1,
              speculative_algorithm="DDTREE", speculative_ddtree_budget=4)  # fmt: skip
    assert llm.model.rope.tables is not None
    assert llm.spec.source.drafter.rope.tables is not None
