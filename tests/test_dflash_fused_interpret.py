"""The DFlash drafter's fused Triton kernels (spec/dflash_fused.py) on the CPU interpreter
(TRITON_INTERPRET=1) against the PyTorch ops they replace.

Fresh random bf16 data; outputs poisoned with NaN before each kernel runs. Rings in every state a
serving engine leaves them: empty (a padding request), partly filled, wrapped past the end, longer
than the splits' walk (every split busy) and short (most splits empty, the merge's -inf weights).
tests/test_dflash_fused_gpu.py runs the same kernels compiled on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import cache_cleared, interpret_on_cpu

interpret_on_cpu("tests/test_dflash_fused_gpu.py")

from dflash_rings import BF16, drafter, qk_fused_and_torch, reference_attention, rings  # noqa: E402
from treeverify.spec import dflash_fused  # noqa: E402

interpreted_kernels = cache_cleared(dflash_fused._kernels)  # decorated under the interpreter
interpreted_block_kernel = cache_cleared(dflash_fused._block_kernel)


def test_block_rows_equal_the_blocks_torch_ops():
    """block_rows (TREEVERIFY_ROUND_GLUE): the block [root, MASK x (T-1)] embedded and the rotary
    tables' rows at end + j, clamped to the tables, exactly as the fill / cat / embedding /
    arange / add / table rows give them; outputs poisoned by the kernel's fresh buffers being
    compared whole (every element written)."""
    g = torch.Generator().manual_seed(11)
    vocab, hidden, d, limit, t = 300, 48, 16, 40, 5
    weight = torch.randn(vocab, hidden, generator=g).to(BF16)  # hidden not a power of two
    cos_t = torch.randn(limit, d, generator=g).to(BF16)
    sin_t = torch.randn(limit, d, generator=g).to(BF16)
    meta = torch.tensor([[1, 2, 3], [17, 250, 5], [0, 12, 38], [0, 1, 2]])  # (4, B): 38 + j clamps
    roots, ends, mask = meta[1], meta[2], 299
    x, cos2, sin2 = dflash_fused.block_rows(weight, roots, ends, mask, cos_t, sin_t, t)
    ids = torch.cat([roots[:, None], torch.full((3, t - 1), mask)], 1)  # (B, T)
    assert torch.equal(x, torch.nn.functional.embedding(ids, weight))
    pos = (ends[:, None] + torch.arange(t)).reshape(-1).clamp(0, limit - 1)  # (B*T,)
    assert torch.equal(cos2, cos_t[pos]) and torch.equal(sin2, sin_t[pos])


@pytest.mark.parametrize(
    "width,rows,counts,ends",
    [
        (96, 96, [0, 40, 96], [0, 150, 96]),  # padding, wrapped, full: splits 2..7 empty
        (700, 700, [650, 3], [1000, 3]),  # every split walks rows; one short ring
        (96, 60, [30, 60], [30, 60]),  # an eager draft reads only the rows in use
    ],
)
def test_ring_attention_equals_softmax_over_the_valid_rows(width, rows, counts, ends):
    d = drafter()
    attn = d.layers[1].self_attn
    store, meta = rings(d, width, counts, ends, seed=width + rows)
    bsz, t = len(counts), d.block_size
    g = torch.Generator().manual_seed(7)
    q = (3 * torch.randn(bsz * t, attn.hq, attn.d, generator=g)).to(BF16)  # peaky softmax
    block_kv = torch.randn(bsz, t, 2, attn.hkv, attn.d, generator=g).to(BF16)
    out = torch.full((bsz * t, attn.hq * attn.d), float("nan"), dtype=BF16)
    got = dflash_fused.ring_attention(q, store, 1, meta, rows, block_kv, attn.sm_scale, out=out)
    assert got is out
    want = reference_attention(q, store, 1, meta, rows, block_kv, attn.sm_scale)
    assert torch.isfinite(got).all()
    err = (got.double() - want).abs().max().item()
    assert err < 2e-2 * want.abs().max().item(), err


def test_qk_norm_rope_equals_the_torch_ops():
    d = drafter()
    r = qk_fused_and_torch(d, 2, 500, torch.Generator().manual_seed(3))
    q, kv, want_q, want_kv = r["q"], r["kv"], r["want_q"], r["want_kv"]
    # The same roundings in the same order: equal but for a last bf16 bit here and there.
    torch.testing.assert_close(q, want_q, rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(kv, want_kv, rtol=8e-3, atol=8e-3)
    assert torch.equal(kv[:, :, 1], want_kv[:, :, 1])  # values are copied


def test_propose_from_ring_fused_equals_the_torch_path():
    """The whole draft: fused (interpreted kernels) vs the gather + mask + SDPA path, on rings
    of every kind in one batch; the drafted tokens agree and the logits are close."""
    d = drafter()
    store, meta = rings(d, 96, [0, 40, 96, 17], [0, 150, 96, 17], seed=11)
    depth = d.block_size - 1
    assert d.ring_fused(store, interpret=True) and not d.ring_fused(store)  # CPU: torch path
    got = d.propose_from_ring(store, meta, 96, depth, interpret=True)  # (B, L, V)
    want = d.propose_from_ring(store, meta, 96, depth)
    assert got.shape == want.shape == (4, depth, d.config.vocab_size)
    assert torch.isfinite(got).all()
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() < 3e-2 * scale
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree


def test_folded_norms_draft_the_same_off_the_gpu():
    """The drafter's norms folded into its projections (TREEVERIFY_NORM_LINEAR: the layers'
    `forward_ring_folded`, models/norm_linear.py): off the GPU each fold is the add + norm and
    the projection it replaced, so the interpreted draft is bit-equal.
    (tests/test_norm_linear_gpu.py runs the folded kernels.)"""
    d = drafter()
    store, meta = rings(d, 96, [0, 40, 96, 17], [0, 150, 96, 17], seed=12)
    depth = d.block_size - 1
    assert not d.fold_norms
    want = d.propose_from_ring(store, meta, 96, depth, interpret=True)  # (B, L, V)
    d.fold_norms = True
    got = d.propose_from_ring(store, meta, 96, depth, interpret=True)
    assert torch.equal(got, want)


def test_context_kv_fused_equals_the_torch_path():
    """A committed row's keys/values for every layer: one GEMM + one kernel per layer vs the
    per-layer PyTorch ops, at positions past a long context."""
    d = drafter()
    g = torch.Generator().manual_seed(5)
    feats = torch.randn(37, d.config.context_features, generator=g).to(BF16)  # (R, F)
    pos = torch.randint(0, 4000, (37,), generator=g)
    got = d.context_kv(feats, pos, interpret=True)  # (R, n_layers, 2, Hkv, D)
    want = d.context_kv(feats, pos)
    assert got.shape == want.shape == (37, 2, 2, 2, 32)
    torch.testing.assert_close(got, want, rtol=8e-3, atol=8e-3)
    assert torch.equal(got[:, :, 1], want[:, :, 1])  # values: the same GEMM rows, copied
