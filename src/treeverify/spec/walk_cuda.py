"""The greedy acceptance walk as one CUDA launch (kernels/cuda/ddtree_walk.cu).

`walk_tree` (accept.py) is exact and vectorized but ~25 small kernels (matching, lowest-index
children, pointer jumping, depths, the path scatter): inside a captured round each costs a few
microseconds of GPU time whatever its size. The kernel does the same walk in one CTA per request:
the lowest matching child of every node in parallel, then the chain from the root. Same result
exactly (tests/test_spec_capture.py compares them on random trees). Capture-safe: no host sync,
outputs from the caching allocator.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from .accept import Acceptance

MAX_NODES = 1025  # kWalkMaxNodes in ddtree_walk.cu


def usable(tokens: Tensor) -> bool:
    """Whether the kernel can walk these (B, T) trees here: CUDA tensors, cuda-python present,
    T within the kernel's shared-memory table."""
    from .tree_heap import available

    return tokens.is_cuda and tokens.shape[1] <= MAX_NODES and available(tokens.device)


def _trees(named: dict[str, Tensor], max_depth: int) -> list[Tensor]:
    """The walk kernels' (B, T) operands as contiguous int64, or a ValueError naming them: all
    one shape, T within the kernels' shared-memory tables, max_depth >= 0."""
    shapes = [tuple(x.shape) for x in named.values()]
    if len(set(shapes)) != 1 or len(shapes[0]) != 2:
        raise ValueError(f"{', '.join(named)} must all be (B, T); got "
                         f"{', '.join(map(str, shapes))}")  # fmt: skip
    t = shapes[0][1]
    if not 1 <= t <= MAX_NODES or max_depth < 0:
        raise ValueError(f"T: expected 1..{MAX_NODES} and max_depth >= 0, got {t}, {max_depth}")
    return [x.to(torch.int64).contiguous() for x in named.values()]


def greedy_walk_cuda(tokens: Tensor, parents: Tensor, posterior: Tensor,
                     max_depth: int) -> Acceptance:  # fmt: skip
    """`walk_tree(tokens, parents, posterior, max_depth)` in one launch: (B, T) int64 each."""
    from treeverify.kernels.cuda.launch import load
    from treeverify.kernels.cuda.variants import DDTreeWalkVariant

    tokens, parents, posterior = _trees(
        {"tokens": tokens, "parents": parents, "posterior": posterior}, max_depth)  # fmt: skip
    (bsz, t), dev = parents.shape, parents.device
    path = torch.empty(bsz, max_depth + 1, dtype=torch.int64, device=dev)
    length = torch.empty(bsz, dtype=torch.int64, device=dev)
    bonus = torch.empty(bsz, dtype=torch.int64, device=dev)
    last = torch.empty(bsz, dtype=torch.int64, device=dev)
    if bsz:
        kernel = load(DDTreeWalkVariant(), dev)
        ptr = ctypes.c_void_p
        args = [ptr(tokens.data_ptr()), ptr(parents.data_ptr()), ptr(posterior.data_ptr()),
                ctypes.c_int(t), ctypes.c_int(max_depth), ptr(path.data_ptr()),
                ptr(length.data_ptr()), ptr(bonus.data_ptr()), ptr(last.data_ptr())]  # fmt: skip
        with torch.cuda.device(dev):
            kernel.launch((bsz, 1, 1), args, torch.cuda.current_stream(dev).cuda_stream)
    return Acceptance(path=path, length=length, bonus=bonus, last=last)


def walk_pack_cuda(tokens: Tensor, parents: Tensor, posterior: Tensor, slots: Tensor,
                   max_depth: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """The walk plus what engine/speculative.py `_move_and_pack` makes of it, in one launch
    (kernels/cuda/ddtree_walk.cu `ddtree_walk_pack`): (B, T) int64 trees, `slots` (B, T) each
    node's KV slot -> packed (B, 2 + 2K) [length, bonus, committed K, path K], src and dst
    (B, K) (the accepted nodes' slots and their positions' slots; src == dst past the path's
    end), K = min(max_depth + 1, T); and length, bonus (B,) as `greedy_walk_cuda` gives them."""
    from treeverify.kernels.cuda.launch import load
    from treeverify.kernels.cuda.variants import DDTreeWalkPackVariant

    tokens, parents, posterior, slots = _trees(
        {"tokens": tokens, "parents": parents, "posterior": posterior, "slots": slots},
        max_depth)  # fmt: skip
    (bsz, t), dev = parents.shape, parents.device
    k = min(max_depth + 1, t)
    packed = torch.empty(bsz, 2 + 2 * k, dtype=torch.int64, device=dev)
    src = torch.empty(bsz, k, dtype=torch.int64, device=dev)
    dst = torch.empty(bsz, k, dtype=torch.int64, device=dev)
    length = torch.empty(bsz, dtype=torch.int64, device=dev)
    bonus = torch.empty(bsz, dtype=torch.int64, device=dev)
    if bsz:
        kernel = load(DDTreeWalkPackVariant(), dev)
        args = walk_pack_args(tokens, parents, posterior, slots, max_depth,
                              (packed, src, dst, length, bonus))  # fmt: skip
        with torch.cuda.device(dev):
            kernel.launch((bsz, 1, 1), args, torch.cuda.current_stream(dev).cuda_stream)
    return packed, src, dst, length, bonus


def walk_pack_args(tokens: Tensor, parents: Tensor, posterior: Tensor, slots: Tensor,
                   max_depth: int, outs: tuple[Tensor, ...]) -> list:  # fmt: skip
    """ddtree_walk_pack's parameters in its signature's order (tests count them); `outs`:
    packed, src, dst, length, bonus."""
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    t, k = parents.shape[1], outs[1].shape[1]
    return [ptr(x.data_ptr()) for x in (tokens, parents, posterior, slots)] + [
        i32(t), i32(max_depth), i32(k)] + [ptr(x.data_ptr()) for x in outs]  # fmt: skip
