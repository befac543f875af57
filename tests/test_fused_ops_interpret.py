"""models/fused_ops.py's rope_qk_store kernel on Triton's CPU interpreter (TRITON_INTERPRET=1)
against the ops it replaces: rope_qk's PyTorch path and the cache write at the given slots.

Fresh random bf16 data; the caches start random (every slot not written must stay as it was).
tests/test_fused_ops_gpu.py runs the kernel compiled on a GPU, through the public function.
"""

from __future__ import annotations

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
