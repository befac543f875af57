"""Our trees <-> SGLang's target-verify layout: layout facts and round trips."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treeverify.spec import (
    from_sglang_verify,
    next_token_sibling_to_parents,
    parents_to_tree_mask,
    sglang_mask_to_tree_mask,
    to_sglang_verify,
    unpack_tree_mask,
)


@st.composite
def batches(draw, padding: bool = True):
    bsz = draw(st.integers(1, 3))
    n = draw(st.integers(1, 70))
    rows = []
    for _ in range(bsz):
        n_real = draw(st.integers(1, n)) if padding else n
        rows.append(
            [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n_real)] + [-1] * (n - n_real)
        )
    prefix = [draw(st.integers(0, 40)) for _ in range(bsz)]
    return rows, prefix


def naive_layout(rows: list[list[int]], prefix: list[int]):
    n = len(rows[0])
    flat, indptr, first, nxt = [], [0], [], []
    for row, p in zip(rows, prefix, strict=True):
        anc = []
        for i in range(n):
            s, j = {i}, row[i]
            while j >= 0:
                s.add(j)
                j = row[j]
            anc.append(s)
        for i in range(n):
            flat += [1] * p + [1 if j in anc[i] else 0 for j in range(n)]
        indptr.append(indptr[-1] + n * (p + n))
        kids = {i: [c for c in range(1, n) if row[c] == i] for i in range(n)}
        first.append([kids[i][0] if kids[i] else -1 for i in range(n)])
        nx = []
        for i in range(n):
            sib = [c for c in kids.get(row[i], []) if c > i] if (i > 0 and row[i] >= 0) else []
            nx.append(sib[0] if sib else -1)
        nxt.append(nx)
    return flat, indptr, first, nxt


@settings(max_examples=60, deadline=None)
@given(batches(), st.integers(0, 50))
def test_layout_matches_naive_and_round_trips(data, extra: int) -> None:
    rows, prefix = data
    parents = torch.tensor(rows)
    plen = torch.tensor(prefix, dtype=torch.int32)
    bsz, n = parents.shape
    flat, indptr, first, nxt = naive_layout(rows, prefix)
    lay = to_sglang_verify(parents, plen, mask_capacity=len(flat) + extra)
    assert lay.custom_mask.dtype == torch.uint8
    assert lay.custom_mask.tolist() == flat + [0] * extra
    assert lay.mask_indptr.dtype == torch.int64 and lay.mask_indptr.tolist() == indptr
    assert lay.qo_indptr.dtype == torch.int32
    assert lay.qo_indptr.tolist() == list(range(0, (bsz + 1) * n, n))
    assert lay.kv_indptr.dtype == torch.int32
    assert lay.kv_indptr.tolist() == [sum(prefix[:b]) for b in range(bsz + 1)]
    assert lay.retrieve_next_token.tolist() == first
    assert lay.retrieve_next_sibling.tolist() == nxt
    # Round trips.
    back = from_sglang_verify(lay.custom_mask, lay.mask_indptr, plen, n)
    assert back.dtype == torch.int64 and back.tolist() == rows
    ours = sglang_mask_to_tree_mask(lay.custom_mask, lay.mask_indptr, plen, n)
    assert torch.equal(ours, parents_to_tree_mask(parents))
    assert (
        next_token_sibling_to_parents(lay.retrieve_next_token, lay.retrieve_next_sibling).tolist()
        == rows
    )


def test_bool_mask_and_bit31() -> None:
    # SGLang's eager path passes a bool mask; a 40-node chain exercises bit 31 and a second word.
    n = 40
    parents = torch.tensor([[-1] + list(range(n - 1)), [-1] + [0] * (n - 1)])
    plen = torch.tensor([3, 0])
    total = n * (3 + n) + n * n
    lay = to_sglang_verify(parents, plen, mask_capacity=total)
    as_bool = lay.custom_mask.bool()
    ours = sglang_mask_to_tree_mask(as_bool, lay.mask_indptr, plen, n)
    assert torch.equal(ours, parents_to_tree_mask(parents))
    assert ours[31].tolist() == [-1, 0]
    assert torch.equal(from_sglang_verify(as_bool, lay.mask_indptr, plen, n), parents)
    dense = unpack_tree_mask(ours, n).reshape(2, n, n)
    assert dense[1].sum().item() == 2 * n - 1
