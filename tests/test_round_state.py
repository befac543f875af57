"""The round glue's CPU side (TREEVERIFY_ROUND_GLUE, engine/round_state.py): the launch arguments
of round_stage_trees and round_path_rows match their C signatures in kernels/cuda/round_state.cu,
and the torch reference of path_rows makes each accepted node's row, position and ring row from
the packed result by hand, reading the ring ends before it advances them. The kernels against
the torch ops: tests/test_round_graphs_gpu.py; whole rounds with the glue: test_round_graphs.py.
"""

from __future__ import annotations

import torch

from kernel_signature import assert_matches_signature
from treeverify.engine.round_state import RoundState, path_rows_args, stage_trees_args
from treeverify.engine.step_stage import StepStage


def _stage(b: int, n: int) -> StepStage:
    stage = StepStage(b, n, 2, 4, 999, torch.device("cpu"))
    stage.write_round([[3, 1, 2, 0][: 4 - i] for i in range(b)], [5 + 7 * i for i in range(b)])
    return stage


def test_stage_trees_arguments_match_the_kernel_signature():
    b, n = 2, 5
    v = _stage(b, n).views
    meta = torch.zeros(4, 8, dtype=torch.int64)
    trees = [torch.zeros(b, n, dtype=torch.int64) for _ in range(2)]
    mask = torch.zeros(b * n, 1, dtype=torch.int32)
    args = stage_trees_args(16, v, n, 999, meta[:, :b], *trees, mask)
    assert_matches_signature("round_state.cu", "round_stage_trees", args)
    assert [a.value for a in args[:6]] == [n, 1, 2, 16, 4, b]  # n, w, words, page, P, B
    assert args[10].value == 8  # the meta's row stride, not the bucket's b


def test_path_rows_arguments_match_the_kernel_signature():
    b, n, k = 2, 5, 4
    v = _stage(b, n).views
    packed = torch.zeros(b, 2 + 2 * k, dtype=torch.int64)
    outs = tuple(torch.empty(b * k, dtype=torch.int64) for _ in range(3))
    args = path_rows_args(n, 104, 7 * 104, 40, packed, torch.zeros(4, 8, dtype=torch.int64), v,
                          outs)  # fmt: skip
    assert_matches_signature("round_state.cu", "round_path_rows", args)
    assert [a.value for a in args[:5]] == [k, n, 104, 7 * 104, 40]


def test_path_rows_by_hand_then_the_advance():
    """Request 0 accepted 3 nodes (root, 2, 4), request 1 only its root; a padding request (no
    rows read) keeps its inputs. Rows r * n + node (0 past the end), positions end + d, ring rows
    slot * width + position % width or the scratch ring's row; then rows read += m (at most the
    window), root = bonus, ring end += m, prefix += m."""
    b, n, width, window = 3, 5, 8, 6  # k = 4 path nodes a request
    stage = _stage(b, n)
    v = stage.views
    v["prefix"][:b] = torch.tensor([10, 20, 0], dtype=torch.int32)
    meta = torch.tensor([[5, 2, 0], [11, 12, 13], [10, 20, 0], [0, 1, 2]])  # (4, b)
    packed = torch.tensor([[3, 77, 11, 31, 41, 0, 0, 2, 4, -1],
                           [1, 88, 12, 0, 0, 0, 0, -1, -1, -1],
                           [1, 99, 13, 0, 0, 0, 0, -1, -1, -1]])  # fmt: skip
    rows, pos, ring = RoundState(torch.device("cpu"), 16, glue=True).path_rows(
        meta, b, n, packed, width, 3 * width, v, window)  # fmt: skip
    assert rows.tolist() == [0, 2, 4, 0, 5, 5, 5, 5, 10, 10, 10, 10]
    assert pos.tolist() == [10, 11, 12, 13, 20, 21, 22, 23, 0, 1, 2, 3]
    assert ring.tolist() == [2, 3, 4, 24, 12, 24, 24, 24, 16, 24, 24, 24]
    assert meta.tolist() == [[6, 3, 0], [77, 88, 13], [13, 21, 0], [0, 1, 2]]
    assert v["prefix"][:b].tolist() == [13, 21, 0]
