"""DDTree's tree build as the literal best-first heap on the GPU: one CUDA launch per round.

`build_tree_heap` runs kernels/cuda/ddtree_heap.cu (NVRTC-compiled at first use, cached on disk)
over the same ``draft_topk`` tables as ``build_tree_from_topk``: one CTA per request pops the
``budget`` best rank paths from a heap in shared memory. Equal to the host heap
(``tree_oracle.py``) node for node, ties included, since it is the same algorithm with the same
fp32 roundings. It replaces the batched beam search's ~40 small kernels per depth (~1,300 graph
nodes at budget 16, depth 15: 1.2-1.5 ms of GPU time on an H200) with one kernel; the heap is
sequential, O(budget * log(budget)) per request, all requests in parallel.

Capture-safe: no host sync; outputs are allocated with the caching allocator (a graph's pool).
Needs the `cuda` extra (cuda-python + NVRTC); `available()` says whether it can run here.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from .tree import DraftTree

MAX_BUDGET = 1024  # kHeapMaxBudget in ddtree_heap.cu


def available(device: torch.device | None = None) -> bool:
    """True when the heap kernel can run: a CUDA device and NVIDIA's cuda-python bindings."""
    if not torch.cuda.is_available() or (device is not None and device.type != "cuda"):
        return False
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        return False
    return True


def build_tree_heap(lp: Tensor, ids: Tensor, budget: int, root_tokens: Tensor, *,
                    with_mask: bool = False) -> DraftTree:  # fmt: skip
    """``build_tree_from_topk`` on CUDA by the heap kernel: ``lp (B, L, K)`` fp32 sorted
    descending, ``<= 0`` and finite; ``ids (B, L, K)`` int64; ``root_tokens (B,)``.
    ``with_mask``: the same launch also writes the trees' ancestor-or-self masks
    (``DraftTree.mask``, what ``parents_to_tree_mask`` gives)."""
    from treeverify import env
    from treeverify.kernels.cuda.launch import load
    from treeverify.kernels.cuda.variants import DDTreeHeapVariant

    if not lp.is_cuda:
        raise ValueError("lp: the heap kernel needs CUDA tensors")
    if lp.dim() != 3 or ids.shape != lp.shape:
        raise ValueError(f"lp and ids must both be (B, L, K), got {tuple(lp.shape)}, {ids.shape}")
    if not 1 <= budget <= MAX_BUDGET:
        raise ValueError(f"budget: the heap kernel takes 1..{MAX_BUDGET}, got {budget}")
    bsz, n_depth, k = lp.shape
    if k > MAX_BUDGET or n_depth > 32767:
        raise ValueError(f"lp: K <= {MAX_BUDGET} and L <= 32767 expected, got {tuple(lp.shape)}")
    dev = lp.device
    lp = lp.float().contiguous()
    ids = ids.to(torch.int64).contiguous()
    roots = root_tokens.to(device=dev, dtype=torch.int64).contiguous()  # (B,)
    n_slots = budget + 1
    tokens = torch.empty(bsz, n_slots, dtype=torch.int64, device=dev)
    parents = torch.empty(bsz, n_slots, dtype=torch.int64, device=dev)
    depths = torch.empty(bsz, n_slots, dtype=torch.int64, device=dev)
    scores = torch.empty(bsz, n_slots, dtype=torch.float32, device=dev)
    num_nodes = torch.empty(bsz, dtype=torch.int64, device=dev)
    words = (n_slots + 31) // 32
    mask = torch.empty(bsz * n_slots, words, dtype=torch.int32, device=dev) if with_mask else None
    if bsz == 0:
        return DraftTree(tokens, parents, depths, num_nodes, scores, mask)
    kernel = load(DDTreeHeapVariant(), dev)
    # TREEVERIFY_DDTREE_WARP_HEAP: budgets <= 32 popped by the whole warp (the same trees)
    args = heap_args(lp, ids, roots, budget, (tokens, parents, depths, scores, num_nodes), mask,
                     words, warp_pops=env.ddtree_warp_heap())  # fmt: skip
    with torch.cuda.device(dev):
        kernel.launch((bsz, 1, 1), args, torch.cuda.current_stream(dev).cuda_stream)
    return DraftTree(tokens=tokens, parents=parents, depths=depths, num_nodes=num_nodes,
                     scores=scores, mask=mask)  # fmt: skip


def heap_args(lp: Tensor, ids: Tensor, roots: Tensor, budget: int, outs: tuple[Tensor, ...],
              mask: Tensor | None, words: int, *, warp_pops: bool) -> list:  # fmt: skip
    """ddtree_heap_build's parameters in its signature's order (tests count them); `outs`:
    tokens, parents, depths, scores, num_nodes."""
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    _, n_depth, k = lp.shape
    return [ptr(lp.data_ptr()), ptr(ids.data_ptr()), ptr(roots.data_ptr()), i32(n_depth), i32(k),
            i32(budget), *(ptr(x.data_ptr()) for x in outs),
            ptr(0 if mask is None else mask.data_ptr()), i32(words),
            i32(1 if warp_pops else 0)]  # fmt: skip
