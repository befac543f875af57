"""Tensor maps of a paged K or V pool for the GQA ping-pong kernel's TMA producer (sm_90+).

Schedule "pingpong-tma" (kernels/cuda/variants.py) loads whole KV tiles of paged prefix keys
with `cp.async.bulk.tensor`, one box per page (or per 64 rows of a larger page) and 64-column
half. A box needs a tensor map, a 128-byte descriptor the driver encodes on the host
(cuTensorMapEncodeTiled) and the kernel takes as a `__grid_constant__` parameter. The map
describes the pool as a rank-4 tensor, innermost first:

    (D, Hkv, page_size, pages)   strides (head, slot, page) in bytes
    box (64, 1, R, 1)            R = min(page_size, 64) rows, 128-byte swizzle

so one box lands as R rows x 128 bytes, the layout (and swizzle) the kernel's wgmma reads
(`sw_off` in tree_attention_sm90.cuh). A pool of page size 1, (slots, Hkv, D), is the same with
page_size 1. Maps are cached per pool geometry: encoding costs tens of microseconds of host
time, and a CUDA graph bakes the map in at capture like every other kernel argument (the
pools of a serving engine never move).
"""

from __future__ import annotations

import ctypes
import threading

import torch

from treeverify import env

BOX_COLS = 64  # elements of a box row: 128 bytes, the 128-byte swizzle's span (bf16 / fp16)
TILE_ROWS = 64  # the kernel's KV tile (GqaPpCfg's BN)

TmaMap = ctypes.c_uint64 * 16  # CUtensorMap's 128 bytes, passed by value to the kernel

CACHE_MAX = 4096  # maps kept (two a layer in a serving engine); eager callers with fresh pools
_cache: dict[tuple, TmaMap | None] = {}
_lock = threading.Lock()
NO_MAP = TmaMap()  # what the kernel takes where it loads no tile by TMA (it reads none)


def box_rows(page_size: int, head_dim: int, min_page: int | None = None) -> int:
    """Rows of a TMA box for this page size, or 0 where the pool takes the cp.async path: page
    sizes that neither divide the 64-row tile nor are a multiple of it, pages smaller than
    `min_page` (None: TREEVERIFY_CUDA_TMA_MIN_PAGE, default 8), or head dims other than 64 and
    128."""
    if min_page is None:
        min_page = env.cuda_tma_min_page()
    if head_dim not in (64, 128) or page_size < min_page:
        return 0
    if TILE_ROWS % page_size and page_size % TILE_ROWS:
        return 0
    return min(page_size, TILE_ROWS)


def pool_geometry(cache: torch.Tensor) -> tuple[list[int], list[int]]:
    """(dims, byte strides of dims 1..3) of a (pages, page_size, H, D) or (slots, H, D) pool as
    the rank-4 tensor (D, H, page_size, pages)."""
    es = cache.element_size()
    if cache.dim() == 4:
        pages, ps, heads, d = cache.shape
        s_page, s_slot, s_head = cache.stride(0), cache.stride(1), cache.stride(2)
    elif cache.dim() == 3:
        pages, heads, d = cache.shape
        ps, s_page, s_head = 1, cache.stride(0), cache.stride(1)
        s_slot = s_page  # a dimension of extent 1: any valid stride
    else:
        raise ValueError(f"k cache: expected 3 or 4 dimensions, got shape {tuple(cache.shape)}")
    return [d, heads, ps, pages], [s_head * es, s_slot * es, s_page * es]


def encodable(cache: torch.Tensor) -> bool:
    """What cuTensorMapEncodeTiled demands of the global side: a 16-byte aligned base, strides
    multiples of 16 bytes below 2^40, extents at most 2^32, a contiguous innermost dim."""
    if cache.stride(-1) != 1 or cache.data_ptr() % 16:
        return False
    dims, strides = pool_geometry(cache)
    return all(s % 16 == 0 and 0 < s < 1 << 40 for s in strides) and all(
        0 < n <= 1 << 32 for n in dims
    )


def tensor_map(cache: torch.Tensor, rows: int) -> TmaMap | None:
    """The tensor map of one K or V pool with boxes of `rows` rows, or None where the pool
    cannot be one (`encodable`). Cached per pool: the per-step cost is one dict lookup."""
    key = (cache.data_ptr(), cache.dtype, cache.shape, cache.stride(), rows, cache.device.index)
    with _lock:
        if key in _cache:
            return _cache[key]
    words = _encode(cache, rows) if encodable(cache) else None
    with _lock:
        if len(_cache) >= CACHE_MAX:  # pools that came and went (eager calls): start over
            _cache.clear()
        _cache[key] = words
    return words


def _encode(cache: torch.Tensor, rows: int) -> TmaMap:
    """cuTensorMapEncodeTiled on the pool's rank-4 view (module docstring)."""
    from cuda.bindings import driver

    dims, strides = pool_geometry(cache)
    dtypes = {
        torch.bfloat16: driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        torch.float16: driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
    }
    if cache.dtype not in dtypes:
        raise ValueError(f"k cache: TMA maps take bf16 or fp16, got {cache.dtype}")
    err, tmap = driver.cuTensorMapEncodeTiled(
        dtypes[cache.dtype],
        4,
        cache.data_ptr(),
        [driver.cuuint64_t(n) for n in dims],  # older cuda-python takes only these types
        [driver.cuuint64_t(n) for n in strides],
        [driver.cuuint32_t(n) for n in (BOX_COLS, 1, rows, 1)],
        [driver.cuuint32_t(1)] * 4,
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    )
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise RuntimeError(
            f"cuTensorMapEncodeTiled(dims={dims}, strides={strides}, box rows={rows}) failed: "
            f"{name.decode() if name else err}"
        )
    return TmaMap(*[int(w) for w in tmap.opaque])
