"""The paged KV cache the model runner writes and tree attention reads.

One pair of tensors per layer, `(num_pages, page_size, Hkv, Dqk)` for K and `(..., Dv)` for V, or
K alone for MLA (V = the first Dv columns of each latent row, exactly as the kernels read it).
With a `spec` (the model's `kv_cache_spec()`) every layer is allocated up front, which is what
memory sizing and CUDA-graph capture need; without one, shapes are taken from the first K/V a
layer writes. Page ids and slots come from the torch-free BlockManager (slot = page * page_size +
offset). One extra page past the pool, `scratch_slot`'s page, is never handed out: padding rows
of a captured step write their K/V there.
"""

from __future__ import annotations

import ctypes
import math

import torch

from treeverify.engine.kv_store import store_kv

KVSpec = list[tuple[tuple[int, ...], tuple[int, ...] | None]]  # per layer: K row, V row | None


def bytes_per_token(spec: KVSpec, dtype: torch.dtype) -> int:
    """Cache bytes one token takes across all layers."""
    size = torch.empty((), dtype=dtype).element_size()
    total = 0
    for k_row, v_row in spec:
        total += math.prod(k_row) + (math.prod(v_row) if v_row is not None else 0)
    return total * size


class KVCache:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        device: torch.device | str = "cpu",
        *,
        spec: KVSpec | None = None,
        dtype: torch.dtype | None = None,
    ):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages/page_size: expected >= 1, got {num_pages}/{page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self.device = torch.device(device)
        self.k: dict[int, torch.Tensor] = {}  # layer -> (pages+1, page_size, Hkv, Dqk)
        self.v: dict[int, torch.Tensor | None] = {}  # layer -> (pages+1, page_size, Hkv, Dv)|None
        # Every layer's K (V) as one tensor (L, pages+1, page_size, ...) when all layers share a
        # row shape: a round's K/V move is then one gather + one scatter for all layers.
        self._stacked: tuple[torch.Tensor, torch.Tensor | None] | None = None
        if spec is not None:
            if dtype is None:
                raise ValueError("dtype: required with spec (the cache is allocated now)")
            if len(set(spec)) == 1:
                self._allocate_stacked(len(spec), *spec[0], dtype)
            else:
                for layer, (k_row, v_row) in enumerate(spec):
                    self._allocate(layer, k_row, v_row, dtype, dtype)

    @property
    def scratch_slot(self) -> int:
        """A slot outside the pool (its own page) for the K/V of padding rows."""
        return self.num_pages * self.page_size

    def _allocate(self, layer, k_row, v_row, k_dtype, v_dtype) -> None:
        pages = self.num_pages + 1  # + the scratch page
        self.k[layer] = torch.zeros((pages, self.page_size, *k_row), dtype=k_dtype,
                                    device=self.device)  # fmt: skip
        self.v[layer] = (
            None
            if v_row is None
            else torch.zeros((pages, self.page_size, *v_row), dtype=v_dtype, device=self.device)
        )

    def _allocate_stacked(self, layers: int, k_row, v_row, dtype) -> None:
        shape = (layers, self.num_pages + 1, self.page_size)  # + the scratch page
        k = torch.zeros((*shape, *k_row), dtype=dtype, device=self.device)
        v = None if v_row is None else torch.zeros((*shape, *v_row), dtype=dtype,
                                                   device=self.device)  # fmt: skip
        self._stacked = (k, v)
        for layer in range(layers):  # contiguous per-layer views: the kernels see no change
            self.k[layer] = k[layer]
            self.v[layer] = None if v is None else v[layer]

    def write(
        self,
        layer: int,
        slots: torch.Tensor,  # (T,) int64 slot of each token
        k: torch.Tensor,  # (T, Hkv, Dqk)
        v: torch.Tensor | None,  # (T, Hkv, Dv) or None (MLA)
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Store this step's K/V at their slots; returns the layer's (k_cache, v_cache)."""
        if layer not in self.k:
            self._allocate(layer, k.shape[1:], None if v is None else v.shape[1:], k.dtype,
                           None if v is None else v.dtype)  # fmt: skip
        kc, vc = self.k[layer], self.v[layer]
        if vc is not None:
            store_kv(slots, k, v, kc, vc)  # one kernel on a GPU
        else:
            kc.view(-1, *kc.shape[2:])[slots] = k.to(kc.dtype)
        return kc, vc

    @torch.inference_mode()  # the cache may hold inference tensors (lazy allocation)
    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """`move` for device index tensors (K,) int64: no host sync, fixed shapes (capturable).
        dst[i] == src[i] rows are left as they are."""
        if self._stacked is not None:  # all layers at once
            for whole in self._stacked:
                if whole is not None:
                    flat = whole.view(whole.shape[0], -1, *whole.shape[3:])  # (L, slots, ...)
                    flat[:, dst] = flat[:, src]  # gathers into a temporary before scattering
            return
        for layer, kc in self.k.items():
            flat = kc.view(-1, *kc.shape[2:])
            flat[dst] = flat[src]  # gathers into a temporary before scattering
            vc = self.v[layer]
            if vc is not None:
                vflat = vc.view(-1, *vc.shape[2:])
                vflat[dst] = vflat[src]

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """`move_slots` for (B, K) pairs, request by request (each request's slots its own): on a
        GPU with a stacked cache, one kernel a cache tensor for all layers (kernels/cuda/
        kv_move.cu: every source of a request read before any write), else `move_slots` of the
        flattened pairs. (engine/speculative.py `accept_move_pack` calls it where
        TREEVERIFY_FUSED_ACCEPT is on.)"""
        if src.numel() == 0:  # no request (an empty grid is not a launch)
            return
        launches = self._move_launches(src)
        if launches is None:
            self.move_slots(src.reshape(-1), dst.reshape(-1))
            return
        from treeverify.kernels.cuda.launch import load
        from treeverify.kernels.cuda.variants import KvMoveVariant

        dev = src.device
        kernel = load(KvMoveVariant(), dev)
        bsz, k = src.shape
        src, dst = src.to(torch.int64).contiguous(), dst.to(torch.int64).contiguous()
        stream = torch.cuda.current_stream(dev).cuda_stream
        for whole, row_vecs in launches:
            args = kv_move_args(whole, row_vecs, src, dst)
            with torch.cuda.device(dev):
                kernel.launch((bsz, whole.shape[0], 1), args, stream,
                              smem_bytes=k * row_vecs * 16)  # fmt: skip

    def _move_launches(self, src: torch.Tensor) -> list[tuple[torch.Tensor, int]] | None:
        """(cache tensor, 16-byte vectors a row) for each kv_move launch, or None where the
        kernel does not apply (not a GPU, no stacked cache, a row not a multiple of 16 bytes, a
        request's rows past 48 KiB of shared memory)."""
        from treeverify.kernels.api import cuda_backend_available

        if not (self._stacked is not None and src.is_cuda and cuda_backend_available()):
            return None
        out = []
        for whole in self._stacked:
            if whole is None:
                continue
            row_bytes = whole[0, 0, 0].numel() * whole.element_size()
            if (not whole.is_contiguous() or row_bytes % 16
                    or src.shape[1] * row_bytes > 48 * 1024):  # fmt: skip
                return None
            out.append((whole, row_bytes // 16))
        return out

    @property
    def bytes(self) -> int:
        tensors = [t for t in (*self.k.values(), *self.v.values()) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


def kv_move_args(whole: torch.Tensor, row_vecs: int, src: torch.Tensor,
                 dst: torch.Tensor) -> list:  # fmt: skip
    """kv_move_rows' parameters in its signature's order (tests count them): a stacked cache
    (L, ...) contiguous, its rows' 16-byte vectors, the (B, K) int64 pairs."""
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int
    return [ptr(whole.data_ptr()), i64(whole.stride(0) * whole.element_size()), i32(row_vecs),
            ptr(src.data_ptr()), ptr(dst.data_ptr()), i32(src.shape[1])]  # fmt: skip
