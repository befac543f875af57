"""Writing a step's K and V rows into the paged cache: one Triton kernel on a GPU (PyTorch's
two `index_put_`s cost ~3 us each inside a captured decode step, per layer), PyTorch elsewhere.
Rows go to flat slot `slots[t]` of the (pages * page_size, ...) view of each cache tensor."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _kernel():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def store_kv_kernel(K, V, Slots, KC, VC, n, k_row, v_row, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(Slots + t).to(tl.int64)
        for start in range(0, n, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            m = cols < n
            tl.store(KC + slot * n + cols, tl.load(K + t * k_row + cols, mask=m), mask=m)
            tl.store(VC + slot * n + cols, tl.load(V + t * v_row + cols, mask=m), mask=m)

    return store_kv_kernel


def store_kv(
    slots: torch.Tensor,  # (T,) int64
    k: torch.Tensor,  # (T, Hkv, D)
    v: torch.Tensor,  # (T, Hkv, D); rows may be strided (a view into the qkv projection)
    k_cache: torch.Tensor,  # (pages, page_size, Hkv, D)
    v_cache: torch.Tensor,  # same shape
) -> None:
    fast = (
        k.is_cuda and k.dtype == k_cache.dtype and v.dtype == v_cache.dtype
        and k.shape == v.shape and k_cache.shape == v_cache.shape and k_cache.is_contiguous()
        and v_cache.is_contiguous() and k[0].is_contiguous() and v[0].is_contiguous()
        and _kernel() is not None
    )  # fmt: skip
    if not fast:
        k_cache.view(-1, *k_cache.shape[2:])[slots] = k.to(k_cache.dtype)
        v_cache.view(-1, *v_cache.shape[2:])[slots] = v.to(v_cache.dtype)
        return
    n = k[0].numel()
    _kernel()[(k.shape[0],)](k, v, slots, k_cache, v_cache, n, k.stride(0), v.stride(0),
                             BLOCK=1024, num_warps=4)  # fmt: skip
