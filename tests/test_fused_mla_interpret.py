"""models/fused_mla.py's kernel on Triton's CPU interpreter (TRITON_INTERPRET=1) against the
PyTorch ops it replaces in the absorbed MLA layer: q_pe and k_pe rotated by apply_rope, then
concatenated beside q_lat and c_kv.

Fresh random bf16 data, operands laid out as deepseek_v3.py makes them (q_lat a permuted einsum
result, k_pe a strided view of the kv_a projection); outputs poisoned by new_empty's garbage only
(every element is written: the copies are compared exactly). tests/test_fused_mla_gpu.py runs the
kernel compiled on a GPU, bit for bit against the PyTorch path.
"""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import cache_cleared, interpret_on_cpu

interpret_on_cpu("tests/test_fused_mla_gpu.py")

from treeverify.models import fused_mla  # noqa: E402
from treeverify.models.config import RopeConfig  # noqa: E402
from treeverify.models.layers import Rope, apply_rope  # noqa: E402

interpreted_kernels = cache_cleared(fused_mla._kernel)  # decorated under the interpreter
BF16 = torch.bfloat16


def operands(t: int, h: int, n: int, lat: int, r: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, n + r, generator=g).to(BF16)  # q_b_proj's output, viewed per head
    w_uk = (torch.randn(h, n, lat, generator=g) / n**0.5).to(BF16)
    q_lat = torch.einsum("thn,hnl->thl", q[..., :n], w_uk)  # (T, H, L), as the model makes it
    kv_a = torch.randn(t, lat + r, generator=g).to(BF16)
    ckv, k_pe = kv_a.split([lat, r], dim=-1)  # k_pe: rows strided by L + R
    positions = torch.randint(0, 4000, (t,), generator=g)
    cos, sin = Rope(RopeConfig(theta=10000.0), r)(positions)  # (T, R/2) fp32
    return dict(q_lat=q_lat, q=q, ckv=ckv.contiguous(), k_pe=k_pe, cos=cos, sin=sin)


@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "rotate-half"])
@pytest.mark.parametrize("t,h,n,lat,r", [(3, 4, 16, 64, 16), (1, 16, 128, 512, 64)])
def test_pack_equals_apply_rope_then_cat(t, h, n, lat, r, interleave):
    o = operands(t, h, n, lat, r, seed=t * h + r)
    assert fused_mla.fits(o["q_lat"], o["q"], o["ckv"], o["k_pe"], o["cos"], o["sin"])
    qa, ka = fused_mla._launch(o["q_lat"], o["q"], o["ckv"], o["k_pe"], o["cos"], o["sin"],
                               interleave)  # fmt: skip
    q_pe = apply_rope(o["q"][..., n:], o["cos"], o["sin"], interleave)  # (T, H, R)
    k_pe = apply_rope(o["k_pe"][:, None, :], o["cos"], o["sin"], interleave)  # (T, 1, R)
    assert qa.shape == (t, h, lat + r) and ka.shape == (t, 1, lat + r)
    assert torch.equal(qa[..., :lat], o["q_lat"]) and torch.equal(ka[:, 0, :lat], o["ckv"])
    # The interpreter's bf16 roundings are numpy's (the GPU test asserts bit equality).
    torch.testing.assert_close(qa[..., lat:], q_pe, rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(ka[..., lat:], k_pe, rtol=1e-2, atol=2e-2)


def test_what_the_kernel_does_not_take_keeps_the_pytorch_path():
    o = operands(2, 4, 16, 64, 16, seed=1)
    args = (o["q_lat"], o["q"], o["ckv"], o["k_pe"], o["cos"], o["sin"])
    assert fused_mla.mla_rope_pack(*args, True) is None  # CPU tensors
    assert not fused_mla.fits(o["q_lat"].float(), *args[1:])  # fp32
    assert not fused_mla.fits(o["q_lat"][..., :48], o["q"], o["ckv"][:, :48], *args[3:])  # L 48
    wide_q = torch.randn(2, 4, 64, dtype=BF16)[..., :32]  # rows not contiguous per head
    assert not fused_mla.fits(o["q_lat"], wide_q, *args[2:])


@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "rotate-half"])
def test_pack_store_writes_ka_to_its_cache_slots_only(interleave):
    """The STORE variant (PagedAttention.pack_store_attend): the same qa, and ka's rows at the
    tokens' cache slots (any order) instead of a tensor; every other cache row untouched."""
    t, h, n, lat, r = 5, 4, 16, 64, 16
    o = operands(t, h, n, lat, r, seed=7)
    args = (o["q_lat"], o["q"], o["ckv"], o["k_pe"], o["cos"], o["sin"], interleave)
    qa, ka = fused_mla._launch(*args)
    cache = torch.full((3, 4, 1, lat + r), float("nan"), dtype=BF16)  # 12 slots, poisoned
    slots = torch.randperm(12, generator=torch.Generator().manual_seed(3))[:t]
    qa2, cache2 = fused_mla._launch(*args, slots, cache)
    assert cache2 is cache and torch.equal(qa2, qa)
    flat = cache.view(12, lat + r)
    assert torch.equal(flat[slots], ka[:, 0])
    rest = torch.ones(12, dtype=torch.bool)
    rest[slots] = False
    assert flat[rest].isnan().all()
    assert fused_mla.mla_rope_pack_store(*args, slots, cache) is None  # CPU tensors
