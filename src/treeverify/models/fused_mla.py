"""The absorbed MLA layer's attention operands in one Triton kernel (issue 14: the batch-1 MLA+MoE
decode is launch-bound; "fuse the absorbed-MLA einsums").

models/deepseek_v3.py builds them with ~20 small PyTorch kernels a layer:

    q_pe = apply_rope(q[..., N:])      (T, H, R)     ~9 kernels (casts, products, sums, stack)
    k_pe = apply_rope(kv_a[:, L:])     (T, 1, R)     ~9
    qa   = cat(q_lat, q_pe)            (T, H, L+R)   1
    ka   = cat(c_kv, k_pe)             (T, 1, L+R)   1

Here one program per (token, head) writes its row of qa (q_lat copied, q_pe rotated) and one more
per token the row of ka (c_kv copied, k_pe rotated): one launch. The rotation rounds where
apply_rope rounds (cos and sin to the activation dtype, then each product, then their difference
or sum), so on a GPU the operands are meant to equal the PyTorch path's bit for bit
(tests/test_fused_mla_gpu.py); on Triton's CPU interpreter, whose roundings are numpy's, within a
bf16 rounding (tests/test_fused_mla_interpret.py). Both layouts of the rotary pairs: DeepSeek's
interleaved (2i, 2i+1) and rotate-half (i, i + R/2).

On by default (TREEVERIFY_FUSED_MLA_ROPE, env.py; measured on the H200: random:mla-moe decode
b=1 2.05 -> 1.82 ms, its verify forwards 1.05-1.16x); anything the kernel does not take (the
CPU, fp32, L or R not a power of two, other strides) keeps the PyTorch path.
"""

from __future__ import annotations

import functools

import torch

from treeverify.models import pdl


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    gdc_wait, gdc_launch_dependents = pdl.gdc()  # PDL's two calls (models/pdl.py)

    @triton.jit
    def mla_pack_kernel(QLat, Q, Ckv, Kpe, C, S, QA, KA, Slots, H, qlat_t, qlat_h, q_t, kpe_t,
                        N: tl.constexpr, L: tl.constexpr, R: tl.constexpr,
                        INTERLEAVE: tl.constexpr, STORE: tl.constexpr,
                        PDL: tl.constexpr):  # fmt: skip
        # Program (t, h): h < H writes qa[t, h], h == H writes ka[t, 0], or with STORE the
        # latent cache's row at slot Slots[t] instead (KA: the cache, (slots, 1, L+R) flat).
        if PDL:  # models/pdl.py: wait for the kernel before, then let the next start
            gdc_wait()
            gdc_launch_dependents()
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        lat = tl.arange(0, L)
        r = tl.arange(0, R)
        if INTERLEAVE:  # pairs (2i, 2i+1): even dims x*c - x'*s, odd dims x*c + x'*s
            partner = r ^ 1
            ang = r // 2
            sign = tl.where(r % 2 == 0, -1.0, 1.0)
        else:  # pairs (i, i + R/2)
            partner = (r + R // 2) % R
            ang = r % (R // 2)
            sign = tl.where(r < R // 2, -1.0, 1.0)
        if h < H:
            src = QLat + t * qlat_t + h * qlat_h
            rope = Q + t * q_t + h * (N + R) + N
            dst = QA + (t * H + h) * (L + R)
        else:
            src = Ckv + t * L
            rope = Kpe + t * kpe_t
            row = tl.load(Slots + t).to(tl.int64) if STORE else t
            dst = KA + row * (L + R)
        tl.store(dst + lat, tl.load(src + lat))
        dt = QA.dtype.element_ty
        x = tl.load(rope + r).to(tl.float32)
        xp = tl.load(rope + partner).to(tl.float32)
        c = tl.load(C + t * (R // 2) + ang).to(dt).to(tl.float32)
        s = tl.load(S + t * (R // 2) + ang).to(dt).to(tl.float32)
        a = (x * c).to(dt).to(tl.float32)
        b = (xp * s).to(dt).to(tl.float32)
        tl.store(dst + L + r, (a + sign * b).to(dt))  # a - b or a + b, rounded once

    return mla_pack_kernel


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def fits(q_lat, q, ckv, k_pe, cos, sin) -> bool:
    """Whether the kernel takes these operands (else the caller keeps the PyTorch path)."""
    t, h, lat = q_lat.shape
    r = k_pe.shape[-1]
    return (
        q_lat.dtype in (torch.bfloat16, torch.float16)
        and q.dtype == ckv.dtype == k_pe.dtype == q_lat.dtype
        and _pow2(lat) and _pow2(r) and r >= 2
        and q.dim() == 3 and q.shape[:2] == (t, h) and q.stride(2) == 1
        and q.stride(1) == q.shape[2]
        and q_lat.stride(2) == 1 and ckv.shape == (t, lat) and ckv.is_contiguous()
        and k_pe.shape == (t, r) and k_pe.stride(1) == 1
        and cos.shape == sin.shape == (t, r // 2) and cos.is_contiguous() and sin.is_contiguous()
    )  # fmt: skip


def mla_rope_pack(
    q_lat: torch.Tensor,  # (T, H, L) W_ukᵀ q_nope, any token / head strides
    q: torch.Tensor,  # (T, H, N + R) [q_nope | q_pe] per head, rows contiguous
    ckv: torch.Tensor,  # (T, L) c_kv after kv_a_layernorm
    k_pe: torch.Tensor,  # (T, R) before the rotation; rows may be strided (a view of kv_a)
    cos: torch.Tensor,  # (T, R/2) fp32, Rope's tables
    sin: torch.Tensor,  # (T, R/2)
    interleave: bool,
) -> tuple[torch.Tensor, torch.Tensor] | None:  # qa (T, H, L+R), ka (T, 1, L+R)
    """qa = [q_lat | rope(q_pe)] and ka = [c_kv | rope(k_pe)] in one launch on a GPU; None where
    the kernel does not apply (the CPU, or `fits` says no)."""
    if not (q_lat.is_cuda and fits(q_lat, q, ckv, k_pe, cos, sin)):
        return None
    return _launch(q_lat, q, ckv, k_pe, cos, sin, interleave)


def mla_rope_pack_store(
    q_lat: torch.Tensor,  # (T, H, L)
    q: torch.Tensor,  # (T, H, N + R)
    ckv: torch.Tensor,  # (T, L)
    k_pe: torch.Tensor,  # (T, R)
    cos: torch.Tensor,  # (T, R/2)
    sin: torch.Tensor,  # (T, R/2)
    interleave: bool,
    slots: torch.Tensor,  # (T,) int64 each token's cache slot
    cache: torch.Tensor,  # (pages, page_size, 1, L + R) the layer's latent cache, contiguous
) -> torch.Tensor | None:  # qa (T, H, L+R)
    """`mla_rope_pack` with ka written straight to its cache slots instead of a tensor (the
    cache write's launch saved: PagedAttention.pack_store_attend); None where it does not apply."""
    lat, r = q_lat.shape[2], k_pe.shape[-1]
    ok = (
        q_lat.is_cuda and fits(q_lat, q, ckv, k_pe, cos, sin) and cache.dtype == q_lat.dtype
        and cache.is_contiguous() and cache.dim() == 4 and cache.shape[2:] == (1, lat + r)
        and slots.dtype == torch.int64 and slots.shape == (q_lat.shape[0],)
    )  # fmt: skip
    return _launch(q_lat, q, ckv, k_pe, cos, sin, interleave, slots, cache)[0] if ok else None


def _launch(q_lat, q, ckv, k_pe, cos, sin, interleave: bool, slots=None,
            cache=None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The launch alone (tests run it on Triton's CPU interpreter). With `slots` and `cache`, ka
    goes to the cache rows (the second result is then the cache)."""
    t, h, lat = q_lat.shape
    r = k_pe.shape[-1]
    n = q.shape[2] - r
    qa = q_lat.new_empty(t, h, lat + r)
    store = cache is not None
    ka = cache if store else q_lat.new_empty(t, 1, lat + r)
    _kernel()[(t, h + 1)](q_lat, q, ckv, k_pe, cos, sin, qa, ka, slots if store else ckv, h,
                          q_lat.stride(0), q_lat.stride(1), q.stride(0), k_pe.stride(0), N=n,
                          L=lat, R=r, INTERLEAVE=interleave, STORE=store,
                          num_warps=4, **pdl.flags(q_lat))  # fmt: skip
    return qa, ka
