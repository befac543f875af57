"""tree_mask bits, depths and positions against naive host walks."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treeverify.spec import (
    depths_from_parents,
    pack_bits,
    parents_to_tree_mask,
    tree_positions,
    unpack_tree_mask,
)


def naive_ancestors(parents: list[int]) -> list[set[int]]:
    out = []
    for i in range(len(parents)):
        s = {i}
        j = parents[i] if i > 0 else -1
        while j >= 0:
            s.add(j)
            j = parents[j]
        out.append(s)
    return out


def naive_depths(parents: list[int]) -> list[int]:
    return [len(a) - 1 for a in naive_ancestors(parents)]


@st.composite
def parent_batches(draw, max_t: int = 100):
    bsz = draw(st.integers(1, 3))
    t = draw(st.integers(1, max_t))
    rows = []
    for _ in range(bsz):
        n_real = draw(st.integers(1, t))  # real nodes first, then padding
        row = [-1]
        for i in range(1, n_real):
            row.append(draw(st.integers(0, i - 1)))
        row += [-1] * (t - n_real)
        rows.append(row)
    return rows


def _check_mask(rows: list[list[int]]) -> None:
    parents = torch.tensor(rows, dtype=torch.int64)
    bsz, t = parents.shape
    mask = parents_to_tree_mask(parents)
    assert mask.dtype == torch.int32 and mask.shape == (bsz * t, (t + 31) // 32)
    dense = unpack_tree_mask(mask, t).reshape(bsz, t, t)
    for b, row in enumerate(rows):
        anc = naive_ancestors(row)
        for i in range(t):
            got = {j for j in range(t) if dense[b, i, j]}
            assert got == anc[i], (b, i, got, anc[i])
    assert torch.equal(pack_bits(dense).reshape(bsz * t, -1), mask)


@settings(max_examples=80, deadline=None)
@given(parent_batches())
def test_mask_matches_naive(rows: list[list[int]]) -> None:
    _check_mask(rows)


@settings(max_examples=40, deadline=None)
@given(parent_batches())
def test_depths_and_positions(rows: list[list[int]]) -> None:
    parents = torch.tensor(rows, dtype=torch.int64)
    depths = depths_from_parents(parents)
    assert depths.tolist() == [naive_depths(r) for r in rows]
    start = torch.arange(len(rows), dtype=torch.int32) * 100 + 5
    pos = tree_positions(depths, start)
    assert pos.dtype == torch.int64
    assert pos.tolist() == [
        [int(start[b]) + d for d in naive_depths(r)] for b, r in enumerate(rows)
    ]


def test_bit31_and_multiword() -> None:
    # A chain of 70 nodes: row i has bits 0..i, across 3 words.
    t = 70
    parents = torch.tensor([[-1] + list(range(t - 1))])
    mask = parents_to_tree_mask(parents)
    assert mask.shape == (t, 3)
    assert mask[31].tolist() == [-1, 0, 0]  # all 32 bits of word 0: 0xFFFFFFFF
    assert mask[30].tolist() == [0x7FFFFFFF, 0, 0]
    assert mask[32].tolist() == [-1, 1, 0]
    assert mask[69].tolist() == [-1, -1, (1 << 6) - 1]
    # A star: node 31's row is root + itself = bit 0 and the sign bit.
    star = torch.tensor([[-1] + [0] * 40])
    m = parents_to_tree_mask(star)
    assert m[31].tolist() == [-(2**31) + 1, 0]
    assert m[32].tolist() == [1, 1]
    assert m[0].tolist() == [1, 0]


def test_padding_rows_self_only() -> None:
    parents = torch.tensor([[-1, 0, 1, -1, -1]])
    dense = unpack_tree_mask(parents_to_tree_mask(parents), 5)
    assert dense.tolist() == [
        [True, False, False, False, False],
        [True, True, False, False, False],
        [True, True, True, False, False],
        [False, False, False, True, False],
        [False, False, False, False, True],
    ]
    assert depths_from_parents(parents).tolist() == [[0, 1, 2, 0, 0]]


def test_max_depth_bound() -> None:
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3, 6]])
    full = parents_to_tree_mask(parents)
    assert torch.equal(parents_to_tree_mask(parents, max_depth=4), full)
    assert parents_to_tree_mask(torch.tensor([[-1]])).tolist() == [[1]]
