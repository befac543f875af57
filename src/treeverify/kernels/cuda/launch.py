"""Loading compiled cubins on the current GPU and launching them on PyTorch's current stream.

The kernel takes one argument, `TreeAttnParams`, by value; `Params` below mirrors that struct
field for field (ctypes applies the same C alignment rules). Launches go through the CUDA driver
API (cuLaunchKernel) on `torch.cuda.current_stream()`, so they are captured by CUDA graphs like
any PyTorch kernel. Nothing here allocates device memory or synchronises.
"""

from __future__ import annotations

import ctypes
import functools
import math
import threading

import torch

from treeverify.kernels.cuda.jit import CompiledKernel, compile_variant
from treeverify.kernels.cuda.variants import Variant

LOG2E = 1.4426950408889634
_ARCH_BY_CAPABILITY = {
    (8, 0): "sm_80",
    (8, 6): "sm_86",
    (8, 7): "sm_86",
    (8, 9): "sm_89",
    (9, 0): "sm_90a",
    (10, 0): "sm_100a",
    (12, 0): "sm_120",
}


class Params(ctypes.Structure):
    """Mirror of treeverify::TreeAttnParams in tree_attention.cu (same order, same types)."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("part_o", ctypes.c_void_p),
        ("part_lse", ctypes.c_void_p),
        ("block_table", ctypes.c_void_p),
        ("prefix_lens", ctypes.c_void_p),
        ("kv_indptr", ctypes.c_void_p),
        ("qo_indptr", ctypes.c_void_p),
        ("tree_mask", ctypes.c_void_p),
        ("k_ext", ctypes.c_void_p),
        ("v_ext", ctypes.c_void_p),
        ("q_stride_tok", ctypes.c_longlong),
        ("q_stride_head", ctypes.c_longlong),
        ("k_stride_page", ctypes.c_longlong),
        ("k_stride_slot", ctypes.c_longlong),
        ("k_stride_head", ctypes.c_longlong),
        ("v_stride_page", ctypes.c_longlong),
        ("v_stride_slot", ctypes.c_longlong),
        ("v_stride_head", ctypes.c_longlong),
        ("o_stride_tok", ctypes.c_longlong),
        ("o_stride_head", ctypes.c_longlong),
        ("kext_stride_tok", ctypes.c_longlong),
        ("kext_stride_head", ctypes.c_longlong),
        ("vext_stride_tok", ctypes.c_longlong),
        ("vext_stride_head", ctypes.c_longlong),
        ("bt_stride", ctypes.c_longlong),
        ("bt_i64", ctypes.c_int),
        ("batch", ctypes.c_int),
        ("hq", ctypes.c_int),
        ("hkv", ctypes.c_int),
        ("group", ctypes.c_int),
        ("page_size", ctypes.c_int),
        ("mask_words", ctypes.c_int),
        ("max_splits", ctypes.c_int),
        ("chunk", ctypes.c_int),
        ("total_q_cap", ctypes.c_int),
        ("scale_log2", ctypes.c_float),
        ("split_counters", ctypes.c_void_p),
        ("fused_merge_bytes", ctypes.c_int),
        ("fwd_bm", ctypes.c_int),
        ("out_rows", ctypes.c_int),
        ("balance_div", ctypes.c_int),
        ("merge_heads", ctypes.c_int),
        ("tma_rows", ctypes.c_int),
        ("persist_m", ctypes.c_int),
        ("split_order", ctypes.c_int),
        ("fused_merge_ilp", ctypes.c_int),
    ]


def _drv():
    from cuda.bindings import driver

    return driver


def device_arch(device: torch.device) -> str:
    """The NVRTC arch string for a CUDA device ("sm_90a" on an H100/H200)."""
    cap = torch.cuda.get_device_capability(device)
    if cap not in _ARCH_BY_CAPABILITY:
        raise ValueError(
            f"device: compute capability {cap[0]}.{cap[1]} has no tree_attention variant "
            f"(supported: {sorted(_ARCH_BY_CAPABILITY)})"
        )
    return _ARCH_BY_CAPABILITY[cap]


def _check(result, what: str) -> None:
    drv = _drv()
    err = result[0] if isinstance(result, tuple) else result
    if err != drv.CUresult.CUDA_SUCCESS:
        _, name = drv.cuGetErrorName(err)
        raise RuntimeError(f"CUDA driver call {what} failed: {name.decode() if name else err}")


@functools.cache
def _programmatic_attr():
    """The launch attribute that allows programmatic dependent launch (made once)."""
    drv = _drv()
    attr = drv.CUlaunchAttribute()
    attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    return attr


@functools.cache
def _cluster_attr(x: int):
    """The launch attribute for clusters of `x` CTAs along grid x (made once per size)."""
    drv = _drv()
    attr = drv.CUlaunchAttribute()
    attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = x, 1, 1
    return attr


class LoadedKernel:
    """One variant's function handle on one device, ready to launch."""

    def __init__(self, compiled: CompiledKernel, threads: int):
        drv = _drv()
        self.compiled = compiled
        self.threads = threads
        err, self._module = drv.cuModuleLoadData(compiled.cubin)
        _check(err, f"cuModuleLoadData({compiled.name})")
        err, self._fn = drv.cuModuleGetFunction(self._module, compiled.lowered_name.encode())
        _check(err, f"cuModuleGetFunction({compiled.name})")
        if compiled.smem_bytes > 48 * 1024:
            attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check(drv.cuFuncSetAttribute(self._fn, attr, compiled.smem_bytes), "smem attribute")

    def launch(
        self,
        grid: tuple[int, int, int],
        args: list[ctypes._SimpleCData | ctypes.Structure],
        stream: int,
        *,
        programmatic: bool = False,
        cluster: int = 1,
        smem_bytes: int | None = None,
    ) -> None:
        """Launch on `stream`. `programmatic`: programmatic dependent launch (sm_90+): the
        kernel may start once every CTA of the kernel before it on the stream has executed
        `griddepcontrol.launch_dependents` (or exited), and must `griddepcontrol.wait` before
        reading what that kernel writes (device_common.cuh: pdl_trigger / pdl_wait).
        `cluster` > 1: thread-block clusters of that many CTAs along x (grid[0] a multiple).
        `smem_bytes`: this launch's dynamic shared memory (at most 48 KiB) in place of the
        variant's (a kernel sized by its arguments: kv_move.cu)."""
        drv = _drv()
        smem = self.compiled.smem_bytes if smem_bytes is None else smem_bytes
        if smem_bytes is not None and not 0 <= smem_bytes <= 48 * 1024:
            raise ValueError(f"smem_bytes: expected 0..49152, got {smem_bytes}")
        ptrs = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        if programmatic or cluster > 1:
            attrs = [_programmatic_attr()] if programmatic else []
            if cluster > 1:
                if grid[0] % cluster:
                    raise ValueError(f"grid: x = {grid[0]} is not a multiple of cluster {cluster}")
                attrs.append(_cluster_attr(cluster))
            config = drv.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = grid
            config.blockDimX, config.blockDimY, config.blockDimZ = self.threads, 1, 1
            config.sharedMemBytes = smem
            config.hStream = drv.CUstream(stream)
            config.attrs, config.numAttrs = attrs, len(attrs)
            res = drv.cuLaunchKernelEx(config, self._fn, ctypes.addressof(ptrs), 0)
            what = f"programmatic={programmatic}, cluster={cluster}"
            _check(res, f"cuLaunchKernelEx({self.compiled.name}, grid={grid}, {what})")
            return
        res = drv.cuLaunchKernel(
            self._fn,
            grid[0],
            grid[1],
            grid[2],
            self.threads,
            1,
            1,
            smem,
            drv.CUstream(stream),
            ctypes.addressof(ptrs),
            0,
        )
        _check(res, f"cuLaunchKernel({self.compiled.name}, grid={grid})")


_loaded: dict[tuple[str, int], LoadedKernel] = {}
_load_lock = threading.Lock()


def load(variant: Variant, device: torch.device) -> LoadedKernel:
    """Compile (or fetch from cache) and load a variant on a device. Call at warmup."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (variant.name, index)
    with _load_lock:
        if key in _loaded:
            return _loaded[key]
    arch = device_arch(device)
    compiled = compile_variant(variant, arch)
    with torch.cuda.device(index):
        torch.cuda.init()
        torch.empty(1, device=f"cuda:{index}")  # make the primary context current here
        threads = getattr(variant, "threads", 256)
        kernel = LoadedKernel(compiled, threads)
    with _load_lock:
        _loaded[key] = kernel
    return kernel


def scale_log2(sm_scale: float) -> float:
    if not math.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale: expected a positive finite float, got {sm_scale!r}")
    return sm_scale * LOG2E
