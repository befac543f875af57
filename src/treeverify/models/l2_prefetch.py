"""Weights pulled into L2 while a decode step's attention runs (TREEVERIFY_L2_PREFETCH).

Why: a batch-1 decode step of the 1B shape streams ~121 MB of weights a layer through its
GEMVs and GEMMs (qkv, o, gate|up, down), but between them the rope, the attention and the norms
run for ~10 us a layer while HBM sits nearly idle (scripts/profile_decode_gpu.py). Bytes read
in that gap are bytes the next GEMVs need not wait for.

How: only inside a CUDA graph capture (the engine's decode, verify and whole-round graphs) and
only for steps of at most MAX_TOKENS tokens, a layer forks a side branch right after its qkv
projection (so qkv keeps HBM to itself): one small kernel (kernels/cuda/l2_prefetch.cu) asks
L2 for the layer's o, gate|up and down weights, in the order the layer reads them, up to the
budget. Nothing on the main stream waits for it; the capturing stream takes the branch back at
the forward's end (`join`: a capture must end joined). The kernel reads nothing into registers
and writes nothing, so it changes where bytes come from, never a result.

Budget: TREEVERIFY_L2_PREFETCH megabytes a layer (0, the default, is off until measured). The
L2 holds ~50 MB; what the o GEMV and the prefetch bring in must still be there when gate|up
reads it, so budgets of a few tens of MB are the ones worth trying.
"""

from __future__ import annotations

import ctypes
import functools

import torch

MAX_TOKENS = 64  # decode and verify steps; prefill chunks are compute-bound
GRID = 16  # CTAs of 128 threads: ~2k 4 KB pieces of a 24 MB budget, a few a thread
ALIGN = 16  # the bulk prefetch's alignment of address and size

_side: dict[int, torch.cuda.Stream] = {}
_pending: set[int] = set()  # devices whose capturing stream has a branch to take back


@functools.cache
def budget_bytes() -> int:
    """TREEVERIFY_L2_PREFETCH in bytes (read once a process); 0: off."""
    from treeverify import env

    return env.l2_prefetch_mb() << 20


def ranges(weights: tuple[torch.Tensor, ...], budget: int) -> list[tuple[int, int]]:
    """(address, bytes) of each contiguous weight in order, trimmed inwards to ALIGN bytes and
    cut so that the total stays within `budget`; at most three (the kernel's arguments)."""
    out: list[tuple[int, int]] = []
    left = budget
    for w in weights:
        if len(out) == 3 or left < ALIGN:
            break
        if not w.is_contiguous():
            continue
        start = w.data_ptr()
        first = -(-start // ALIGN) * ALIGN
        last = (start + w.numel() * w.element_size()) // ALIGN * ALIGN
        n = min(last - first, left) // ALIGN * ALIGN
        if n > 0:
            out.append((first, n))
            left -= n
    return out


def active(x: torch.Tensor) -> bool:
    """Whether a forward on x prefetches: a budget, a CUDA step of <= MAX_TOKENS rows being
    captured into a graph, and the kernel's toolchain (cuda-python)."""
    if budget_bytes() <= 0 or not x.is_cuda or x.shape[0] > MAX_TOKENS:
        return False
    if not torch.cuda.is_current_stream_capturing():
        return False
    from treeverify.kernels.api import cuda_backend_available

    return cuda_backend_available()


@functools.cache
def _kernel(device_index: int):
    from treeverify.kernels.cuda.launch import load
    from treeverify.kernels.cuda.variants import L2PrefetchVariant

    return load(L2PrefetchVariant(), torch.device("cuda", device_index))


def launch_args(spans: list[tuple[int, int]]) -> list:
    """l2_prefetch's parameters in its signature's order: three (pointer, bytes) pairs, unused
    ones null."""
    spans = spans + [(0, 0)] * (3 - len(spans))
    args: list = []
    for ptr, n in spans:
        args += [ctypes.c_void_p(ptr), ctypes.c_longlong(n)]
    return args


def issue(x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> None:
    """Fork the side branch after the work queued so far and prefetch `weights` on it (see the
    module docstring); nothing unless `active(x)`."""
    if not weights or not active(x):
        return
    spans = ranges(weights, budget_bytes())
    if not spans:
        return
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    side = _side.get(index)
    if side is None:
        side = _side[index] = torch.cuda.Stream(x.device)
    side.wait_stream(torch.cuda.current_stream(x.device))
    kernel = _kernel(index)
    with torch.cuda.device(x.device):
        kernel.launch((GRID, 1, 1), launch_args(spans), side.cuda_stream)
    _pending.add(index)


def join(x: torch.Tensor) -> None:
    """The current stream takes back the side branch `issue` forked (a no-op without one)."""
    if not x.is_cuda:
        return
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if index in _pending:
        _pending.discard(index)
        torch.cuda.current_stream(x.device).wait_stream(_side[index])


def describe() -> str:
    """One line for the startup log."""
    mb = budget_bytes() >> 20
    if mb <= 0:
        return "L2 prefetch off (TREEVERIFY_L2_PREFETCH=0)"
    return f"L2 prefetch: {mb} MB of the next weights a layer (captured steps <= {MAX_TOKENS} rows)"
