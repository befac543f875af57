"""The DFlash drafter's fused Triton kernels (spec/dflash_fused.py) compiled on a GPU: against an
fp64 reference and the PyTorch path, eagerly and replayed from a CUDA graph over new rings and
metadata. Outputs poisoned with NaN first; fresh random bf16 inputs. Skipped without a GPU (the
CPU interpreter runs the same checks: tests/test_dflash_fused_interpret.py)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# No `import triton` here: collected before test_dflash_fused_interpret.py, it would decorate
# triton.language's own jit functions for the GPU before that module asks for the interpreter.
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="CPU interpreter"),
]

from dflash_rings import BF16, drafter, qk_fused_and_torch, reference_attention, rings  # noqa: E402
from treeverify.models.layers import apply_rope_tables  # noqa: E402
from treeverify.spec import dflash_fused  # noqa: E402

CASES = [
    (96, 96, [0, 40, 96], [0, 150, 96]),  # padding, wrapped, full: splits 2..7 empty
    (2112, 2112, [2048, 3, 300], [5000, 3, 300]),  # tiny-code's W: every split walks rows
    (96, 60, [30, 60], [30, 60]),  # an eager draft reads only the rows in use
]


@pytest.mark.parametrize("width,rows,counts,ends", CASES)
def test_ring_attention_equals_softmax_over_the_valid_rows(width, rows, counts, ends):
    d = drafter(block_size=16, device="cuda")
    attn = d.layers[1].self_attn
    store, meta = rings(d, width, counts, ends, seed=width + rows, device="cuda")
    bsz, t = len(counts), d.block_size
    g = torch.Generator(device="cuda").manual_seed(7)
    q = (3 * torch.randn(bsz * t, attn.hq, attn.d, generator=g, device="cuda")).to(BF16)
    block_kv = torch.randn(bsz, t, 2, attn.hkv, attn.d, generator=g, device="cuda").to(BF16)
    out = torch.full((bsz * t, attn.hq * attn.d), float("nan"), dtype=BF16, device="cuda")
    got = dflash_fused.ring_attention(q, store, 1, meta, rows, block_kv, attn.sm_scale, out=out)
    want = reference_attention(q, store, 1, meta, rows, block_kv, attn.sm_scale)
    assert torch.isfinite(got).all()
    err = (got.double() - want).abs().max().item()
    assert err < 2e-2 * want.abs().max().item(), err


def test_qk_norm_rope_equals_the_torch_ops():
    d = drafter(block_size=16, device="cuda")
    attn = d.layers[0].self_attn
    r = qk_fused_and_torch(d, 3, 3000, torch.Generator(device="cuda").manual_seed(3), "cuda")
    q, kv, want_q, want_kv = r["q"], r["kv"], r["want_q"], r["want_kv"]
    qkv, cos2, sin2 = r["qkv"], r["cos2"], r["sin2"]
    torch.testing.assert_close(q, want_q, rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(kv, want_kv, rtol=8e-3, atol=8e-3)
    assert torch.equal(kv[:, :, 1], want_kv[:, :, 1])  # values are copied
    # Not bit-equal to torch's ops (F.rms_norm rounds where this kernel does not: ~1/4 of the
    # values differ in a last bit on the H200), but no less accurate: against fp64 math on the
    # same bf16 projection, its error is at most torch's.
    q64 = qkv[:, : attn.hq].double()
    q64 = q64 * torch.rsqrt(q64.pow(2).mean(-1, keepdim=True) + attn.q_norm.eps)
    q64 = apply_rope_tables(q64 * attn.q_norm.weight.double(), cos2.double(), sin2.double())
    err, torch_err = (q.double() - q64).abs().mean(), (want_q.double() - q64).abs().mean()
    assert err <= 1.1 * torch_err, (err.item(), torch_err.item())


def test_context_kv_fused_equals_the_torch_path():
    d = drafter(block_size=16, device="cuda")
    feats = torch.randn(48, d.config.context_features, device="cuda").to(BF16)  # (R, F)
    pos = torch.randint(0, 4000, (48,), device="cuda")
    got = d.context_kv(feats, pos)  # fused on a GPU
    saved, d.layers[0].self_attn.qkv = d.layers[0].self_attn.qkv, None  # the torch path
    want = d.context_kv(feats, pos)
    d.layers[0].self_attn.qkv = saved
    torch.testing.assert_close(got, want, rtol=8e-3, atol=8e-3)  # cuBLAS may sum k|v rows in
    # another order over the fused weight than over v_proj alone: close, not bit-equal


@torch.inference_mode()
def test_propose_from_ring_fused_equals_the_torch_path_and_replays_from_a_graph():
    """The whole draft fused vs the gather + mask + SDPA path; then captured once and replayed
    over new rings and metadata (written in place), each replay equal to an eager fused draft."""
    d = drafter(block_size=16, device="cuda")
    width, depth = 2112, 15
    store, meta = rings(d, width, [0, 40, 2100, 17], [0, 4000, 2100, 17], seed=11, device="cuda")
    assert d.ring_fused(store)
    got = d.propose_from_ring(store, meta, width, depth)  # (B, L, V)
    d.layers[0].self_attn.qkv, saved = None, d.layers[0].self_attn.qkv  # the torch path
    assert not d.ring_fused(store)
    want = d.propose_from_ring(store, meta, width, depth)
    d.layers[0].self_attn.qkv = saved
    assert torch.isfinite(got).all()
    assert (got - want).abs().max().item() < 3e-2 * want.abs().max().item()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9

    d.propose_from_ring(store, meta, width, depth)  # warm up (Triton compiles) off the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = d.propose_from_ring(store, meta, width, depth)
    for seed in (12, 13):
        new_store, new_meta = rings(d, width, [5, 1000, 0, 2112], [5, 3000, 0, 2112], seed=seed,
                                    device="cuda")  # fmt: skip
        store.copy_(new_store)
        meta.copy_(new_meta)
        captured.fill_(float("nan"))
        graph.replay()
        assert torch.equal(captured, d.propose_from_ring(store, meta, width, depth))


def test_block_rows_fused_equal_the_torch_ops_and_replay(monkeypatch):
    """TREEVERIFY_ROUND_GLUE's draft block (dflash_fused.block_rows): the drafter's `_block` by
    one kernel bit-equal to its torch ops (embedding, fill, cat, table rows), eagerly and
    replayed from a graph over new roots and ends written in place (the kernel's calls
    counted: the fused branch ran)."""
    calls = []
    block_rows = dflash_fused.block_rows
    monkeypatch.setattr(dflash_fused, "block_rows", lambda *a: calls.append(1) or block_rows(*a))
    d = drafter(block_size=16, device="cuda")
    d.rope.tabulate(4096, BF16, "cuda")
    assert d.rope.tables is not None
    g = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
    meta = torch.stack([torch.randint(0, 96, (4,), generator=g, device="cuda"),
                        torch.randint(0, 4000, (4,), generator=g, device="cuda")])  # fmt: skip
    outs = {}
    for fused in (False, True):
        d.block_fused = fused
        outs[fused] = d._block(meta[0], meta[1])
    assert len(calls) == 1
    for a, b in zip(outs[True], outs[False], strict=True):
        assert torch.equal(a, b)
    d.block_fused = True
    d._block(meta[0], meta[1])  # warm up (Triton compiles) off the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = d._block(meta[0], meta[1])
    meta.copy_(torch.stack([torch.randint(0, 96, (4,), generator=g, device="cuda"),
                            torch.randint(0, 4000, (4,), generator=g, device="cuda")]))  # fmt: skip
    for x in captured:
        x.fill_(float("nan"))
    graph.replay()
    d.block_fused = False
    for a, b in zip(captured, d._block(meta[0], meta[1]), strict=True):
        assert torch.equal(a, b)
