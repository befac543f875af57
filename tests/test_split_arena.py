"""SplitArena (kernels/split_arena.py), on the CPU: views laid out without overlap, zeroed
counters, growth that leaves earlier plans' views intact; the SGLang backend's plans share one
(checked on the GPU in tests/test_cuda_splits_gpu.py, where the plans' kernels run)."""

from __future__ import annotations

import pytest
import torch

from treeverify.kernels.split_arena import SplitArena


def test_views_do_not_overlap_and_start_aligned():
    arena = SplitArena("cpu")
    (o, lse), ctr = arena.take(((2, 5, 3, 7), (2, 5, 3)), 11)
    assert o.shape == (2, 5, 3, 7) and lse.shape == (2, 5, 3) and ctr.shape == (11,)
    assert o.is_contiguous() and lse.is_contiguous()
    assert (lse.data_ptr() - o.data_ptr()) % 256 == 0
    assert lse.data_ptr() >= o.data_ptr() + o.numel() * 4  # end to end, no overlap
    assert ctr.dtype == torch.int32 and bool((ctr == 0).all())
    o.fill_(1.0)
    lse.fill_(2.0)
    assert bool((o == 1.0).all())  # writing lse left o alone
    assert arena.nbytes >= (o.numel() + lse.numel() + ctr.numel()) * 4


def test_smaller_plans_share_the_buffer_and_larger_ones_grow_it():
    arena = SplitArena("cpu")
    (big, _), ctr = arena.take(((4, 64, 8), (4, 64)), 32)
    (small, _), ctr2 = arena.take(((2, 16, 8), (2, 16)), 8)
    assert small.data_ptr() == big.data_ptr() and ctr2.data_ptr() == ctr.data_ptr()
    assert arena.grown == 0 and arena.requests == 2
    big.fill_(3.0)
    (bigger, _), _ = arena.take(((8, 64, 8), (8, 64)), 64)
    assert arena.grown == 2 and bigger.data_ptr() != big.data_ptr()
    assert bool((big == 3.0).all())  # the earlier plan's views still hold their storage
    (again, _), _ = arena.take(((2, 16, 8), (2, 16)), 8)
    assert again.data_ptr() == bigger.data_ptr()  # later plans take the new buffer


def test_empty_shapes_and_bad_sizes():
    arena = SplitArena("cpu")
    (o, lse), ctr = arena.take(((0,), (0,)), 0)  # a plan that never splits
    assert o.numel() == lse.numel() == ctr.numel() == 0
    with pytest.raises(ValueError, match="f32_shapes"):
        arena.take(((-1, 2),), 0)
    with pytest.raises(ValueError, match="counters"):
        arena.take(((1,),), -3)
