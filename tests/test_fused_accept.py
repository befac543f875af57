"""The fused accept's CPU side (TREEVERIFY_FUSED_ACCEPT: kernels/cuda/ddtree_walk.cu
ddtree_walk_pack, kernels/cuda/kv_move.cu): the launch arguments match both kernels' C
signatures, and off the GPU the switch changes nothing (the K/V move takes the gather/scatter,
exactly). tests/test_fused_accept_gpu.py runs the kernels against the PyTorch path."""

from __future__ import annotations

import torch

from kernel_signature import assert_matches_signature
from treeverify.engine.kv_cache import KVCache, kv_move_args
from treeverify.spec.walk_cuda import walk_pack_args


def test_walk_pack_arguments_match_the_kernel_signature():
    b, t, k = 3, 17, 16
    trees = [torch.zeros(b, t, dtype=torch.int64) for _ in range(4)]
    outs = (torch.empty(b, 2 + 2 * k, dtype=torch.int64),
            *(torch.empty(b, k, dtype=torch.int64) for _ in range(2)),
            *(torch.empty(b, dtype=torch.int64) for _ in range(2)))  # fmt: skip
    args = walk_pack_args(*trees, 15, outs)
    assert_matches_signature("ddtree_walk.cu", "ddtree_walk_pack", args)
    assert [a.value for a in args[4:7]] == [t, 15, k]  # T, max_depth, K


def test_kv_move_arguments_match_the_kernel_signature():
    whole = torch.zeros(4, 9, 16, 2, 64, dtype=torch.bfloat16)  # (L, pages + 1, page, Hkv, D)
    src = torch.zeros(3, 16, dtype=torch.int64)
    args = kv_move_args(whole, 16, src, src.clone())
    assert_matches_signature("kv_move.cu", "kv_move_rows", args)
    assert args[1].value == 9 * 16 * 2 * 64 * 2 and args[-1].value == 16  # layer bytes, K


def test_move_rows_off_the_gpu_is_the_gather_scatter():
    """The CPU's move_rows moves exactly what move_slots moves (every source read before any
    write: one pair's source is another's destination)."""
    spec = [((2, 8), (2, 8))] * 3
    g = torch.Generator().manual_seed(5)
    a = KVCache(4, 4, spec=spec, dtype=torch.float32)
    for t in (*a.k.values(), *a.v.values()):
        t.copy_(torch.randn(t.shape, generator=g))
    b = KVCache(4, 4, spec=spec, dtype=torch.float32)
    for x, y in zip((*a.k.values(), *a.v.values()), (*b.k.values(), *b.v.values()), strict=True):
        y.copy_(x)
    # (B, K) as a walk makes them: request 0's path is nodes 0, 2, 3 (slots 0..), request 1's
    # 0, 1, 3 (slots 8..); past a path's end src == dst. Slot 2 is read for position 1 and
    # written from slot 3 for position 2.
    src = torch.tensor([[0, 2, 3, 3], [8, 9, 11, 11]])
    dst = torch.tensor([[0, 1, 2, 3], [8, 9, 10, 11]])
    before = a.k[0].view(-1, 2, 8).clone()  # (slots, Hkv, D) layer 0
    a.move_rows(src, dst)
    b.move_slots(src.reshape(-1), dst.reshape(-1))
    for x, y in zip((*a.k.values(), *a.v.values()), (*b.k.values(), *b.v.values()), strict=True):
        assert torch.equal(x, y)
    after = a.k[0].view(-1, 2, 8)
    assert torch.equal(after[1], before[2])  # slot 2's row, read before slot 2 was written
    assert torch.equal(after[2], before[3]) and torch.equal(after[10], before[11])
    assert torch.equal(after[9], before[9]) and torch.equal(after[3], before[3])


def test_heap_arguments_match_the_kernel_signature():
    """ddtree_heap_build's launch, the warp switch last (spec/tree_heap.py heap_args)."""
    from treeverify.spec.tree_heap import heap_args

    lp = torch.zeros(2, 15, 16)
    ids = torch.zeros(2, 15, 16, dtype=torch.int64)
    outs = tuple(torch.zeros(2, 17) for _ in range(5))
    args = heap_args(lp, ids, torch.zeros(2, dtype=torch.int64), 16, outs, None, 1,
                     warp_pops=True)  # fmt: skip
    assert_matches_signature("ddtree_heap.cu", "ddtree_heap_build", args)
    assert [a.value for a in args[3:6]] == [15, 16, 16] and args[-1].value == 1
