"""models/fused_ops.py's rope_qk_store kernel on Triton's CPU interpreter (TRITON_INTERPRET=1)
against the ops it replaces: rope_qk's PyTorch path and the cache write at the given slots.

Fresh random bf16 data; the caches start random (every slot not written must stay as it was).
tests/test_fused_ops_gpu.py runs the kernel compiled on a GPU, through the public function.
"""

from __future__ import annotations

import random

import torch

from triton_interpreter import cache_cleared, interpret_on_cpu

interpret_on_cpu("tests/test_fused_ops_gpu.py")

from treeverify.models import fused_ops  # noqa: E402
from treeverify.models.config import RopeConfig  # noqa: E402
from treeverify.models.layers import Rope  # noqa: E402

interpreted_kernels = cache_cleared(fused_ops._triton)  # decorated under the interpreter
BF16 = torch.bfloat16


def test_rope_qk_store_equals_rope_qk_then_the_cache_write():
    hq, hkv, d, t, page = 4, 2, 64, 5, 4
    g = torch.Generator().manual_seed(23)
    qkv = torch.randn(t, hq + 2 * hkv, d, generator=g).to(BF16)
    positions = torch.tensor([0, 7, 8, 300, 301])
    cos2, sin2 = Rope(RopeConfig(theta=10000.0), d).rotate_half_tables(positions, BF16)
    kc = torch.randn(3, page, hkv, d, generator=g).to(BF16)
    vc = torch.randn(3, page, hkv, d, generator=g).to(BF16)
    slots = torch.tensor([9, 0, 5, 11, 2])
    want_q, want_k = fused_ops.rope_qk(qkv, cos2, sin2, hq, hkv)  # CPU: the PyTorch ops
    want_kc, want_vc = kc.clone(), vc.clone()
    want_kc.view(-1, hkv, d)[slots] = want_k
    want_vc.view(-1, hkv, d)[slots] = qkv[:, hq + hkv :]
    q = fused_ops._launch_rope(qkv, cos2, sin2, hq, hkv, kc, slots, vc)
    assert q.shape == (t, hq, d) and q.is_contiguous()
    # The interpreter's bf16 roundings are numpy's, not the GPU's: a last bit here and there
    # (the GPU test asserts bit equality). The copies and the untouched slots are exact.
    torch.testing.assert_close(q, want_q, rtol=1e-2, atol=1e-2)
    written = torch.zeros(kc.shape[0] * page, dtype=torch.bool)
    written[slots] = True
    flat_k, want_flat_k = kc.view(-1, hkv, d), want_kc.view(-1, hkv, d)
    torch.testing.assert_close(flat_k[slots], want_flat_k[slots], rtol=1e-2, atol=1e-2)
    assert torch.equal(flat_k[~written], want_flat_k[~written])
    assert torch.equal(vc, want_vc)
    # rope_qk's kernel (the same Triton kernel, STORE off): the same q and k, bit for bit.
    k2 = torch.empty(t, hkv, d, dtype=BF16)
    q2 = fused_ops._launch_rope(qkv, cos2, sin2, hq, hkv, k2)
    assert torch.equal(q2, q) and torch.equal(k2, flat_k[slots])
    # The public function keeps CPU tensors on the two-step path.
    assert fused_ops.rope_qk_store(qkv, cos2, sin2, hq, hkv, slots, kc, vc) is None


def test_rmsnorm_of_a_strided_view_and_add_rmsnorm_equal_the_pytorch_norm():
    """rmsnorm reads a strided split in place (MLA's c_kv beside k_pe) and add_rmsnorm adds the
    residual first (rounded as torch rounds it); both within one bf16 rounding of F.rms_norm."""
    from treeverify.models.layers import RMSNorm

    g = torch.Generator().manual_seed(29)
    wide = torch.randn(3, 96 + 16, generator=g).to(BF16)
    x = wide[:, :96]  # rows 112 apart
    norm = RMSNorm(96, 1e-6).to(BF16)
    norm.weight.data = (1 + 0.1 * torch.randn(96, generator=g)).to(BF16)
    got = fused_ops._triton()[0]  # the kernel, decorated under the interpreter
    y = torch.empty(3, 96, dtype=BF16)
    got[(3,)](x, x, norm.weight, y, y, 96, x.stride(0), 1e-6, y, 0, BLOCK=128, HAS_RES=False,
              PDL=False)  # fmt: skip
    want = torch.nn.functional.rms_norm(x.float(), (96,), norm.weight.float(), 1e-6)
    torch.testing.assert_close(y.float(), want, rtol=1e-2, atol=1e-2)
    r = torch.randn(3, 96, generator=g).to(BF16)
    xc = x.contiguous()
    y2, r_out = torch.empty_like(xc), torch.empty_like(xc)
    # HAS_TAP: the sum also into a (3, 96) column block of wider rows (a forward's captured
    # taps); the block's neighbours, poisoned, stay as they were
    taps = torch.full((3, 3 * 96), float("nan"), dtype=BF16)
    tap = taps[:, 96:192]
    got[(3,)](xc, r, norm.weight, y2, r_out, 96, 96, 1e-6, tap, tap.stride(0), BLOCK=128,
              HAS_RES=True, PDL=False, HAS_TAP=True)  # fmt: skip
    # the add rounded once (exactly torch's on the GPU; numpy's roundings here: a last bit)
    torch.testing.assert_close(r_out.float(), (r + xc).float(), rtol=1e-2, atol=1e-2)
    want2 = torch.nn.functional.rms_norm((r + xc).float(), (96,), norm.weight.float(), 1e-6)
    torch.testing.assert_close(y2.float(), want2, rtol=1e-2, atol=1e-2)
    assert torch.equal(tap, r_out)  # the same rounded sum, stored twice
    assert taps[:, :96].isnan().all() and taps[:, 192:].isnan().all()
    assert torch.equal(fused_ops.rmsnorm(x, norm), norm(x))  # the CPU keeps PyTorch's norm


def test_rmsnorm_pair_norms_both_ranges_of_a_strided_row():
    """rmsnorm_pair's kernel: MLA's q_a and kv_a norms of one fused product (48 | 32 | 8 columns
    here, rows 100 apart) in one launch, each range by its own weight and eps, fresh values."""
    from treeverify.models.layers import RMSNorm

    g = torch.Generator().manual_seed(random.randrange(2**31))
    wide = torch.randn(3, 100, generator=g).to(torch.float16)
    x = wide[:, :88]  # (T, Q + L + R) with Q 48, L 32, R 8: rows 100 apart
    norms = [RMSNorm(48, 1e-6).to(torch.float16), RMSNorm(32, 1e-5).to(torch.float16)]
    for nm in norms:
        nm.weight.data = (1 + 0.1 * torch.randn(nm.weight.shape, generator=g)).half()
    y1 = torch.full((3, 48), float("nan"), dtype=torch.float16)
    y2 = torch.full((3, 32), float("nan"), dtype=torch.float16)
    kernel = fused_ops._triton()[3]  # decorated under the interpreter
    kernel[(3, 2)](x, norms[0].weight, norms[1].weight, y1, y2, 48, 32, x.stride(0), 1e-6, 1e-5,
                   BLOCK=64, PDL=False)  # fmt: skip
    for got, nm, part in ((y1, norms[0], x[:, :48]), (y2, norms[1], x[:, 48:80])):
        want = torch.nn.functional.rms_norm(part.float(), (part.shape[1],), nm.weight.float(),
                                            nm.eps)  # fmt: skip
        torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-3)
    a, b = fused_ops.rmsnorm_pair(x, *norms)  # the CPU: PyTorch's two norms
    assert torch.equal(a, norms[0](x[:, :48])) and torch.equal(b, norms[1](x[:, 48:80]))


def test_rope_rows_copies_the_tables_rows_and_clamps_past_them():
    """rope_rows' kernel: row t of each output is the tables' row at positions[t] exactly
    (int32 or int64 positions), a position past the table its last row, before 0 its first."""
    g = torch.Generator().manual_seed(31)
    for d in (32, 64, 48):  # 48: a head size that is not a power of two (masked lanes)
        cos_t = torch.randn(40, d, generator=g).to(BF16)  # (L, D)
        sin_t = torch.randn(40, d, generator=g).to(BF16)
        for dtype in (torch.int64, torch.int32):
            pos = torch.tensor([0, 39, 7, 7, 41, -3, 12], dtype=dtype)
            cos2 = torch.full((7, d), float("nan"), dtype=BF16)  # (T, D), poisoned
            sin2 = torch.full((7, d), float("nan"), dtype=BF16)
            fused_ops._triton()[4][(7,)](pos, cos_t, sin_t, cos2, sin2, 40, D=d,
                                     BLOCK=64, PDL=False)  # fmt: skip
            idx = pos.long().clamp(0, 39)
            assert torch.equal(cos2, cos_t[idx]) and torch.equal(sin2, sin_t[idx])
            # the public function off the GPU: the same rows by index
            c, s = fused_ops.rope_rows(cos_t, sin_t, pos)
            assert torch.equal(c, cos_t[idx]) and torch.equal(s, sin_t[idx])


def test_rope_tabulate_keeps_nothing_off_the_gpu():
    """Rope.tabulate on the CPU keeps no tables (the rows stay computed each forward, as the
    CPU's vectorised cos of a long row may differ from a short row's in a last bit)."""
    rope = Rope(RopeConfig(theta=10000.0), 64)
    rope.tabulate(128, BF16, "cpu")
    assert rope.tables is None
    pos = torch.tensor([3, 100])
    cos2, sin2 = rope.rotate_half_tables(pos, BF16)
    assert cos2.shape == (2, 64) and sin2.shape == (2, 64)
