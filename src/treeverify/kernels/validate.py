"""Boundary checks for tree_attention: every bad input raises ValueError naming the argument.

``validate_tree_attention_args`` is shared by the eager entry point and ``plan()``. Shape, dtype
and device checks touch no tensor data. With ``check_data=True`` it also reads the index tensors
and the tree mask to the host (a device sync: fine in the eager path, never inside a captured
region) and checks the values: qo_indptr, prefix lengths, page ids and that the mask is a tree.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

import numpy as np
import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class TreeAttentionFacts:
    """What validation derived from the arguments."""

    batch: int  # B
    total_q: int  # sum of T_b
    hq: int
    hkv: int
    dqk: int
    dv: int
    page_size: int
    num_pages: int
    max_pages: int  # block_table columns
    is_mla: bool  # v_cache is None: V = k_cache[..., :dv]
    words: int  # W, int32 words per tree_mask row
    max_tree: int | None  # max T_b; None unless check_data (needs a host read)

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.hq // self.hkv


def _describe(t: object) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {tuple(t.shape)} on {t.device}"


def _fail(name: str, expected: str, got: object) -> ValueError:
    got_text = got if isinstance(got, str) else _describe(got)
    return ValueError(f"{name}: expected {expected}, got {got_text}")


def _tensor(name: str, t: object, rank: int, dtypes: tuple, expected: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != rank or t.dtype not in dtypes:
        raise _fail(name, expected, t)
    return t


def validate_tree_attention_args(
    q,
    k_cache,
    v_cache,
    block_table,
    prefix_lens,
    qo_indptr,
    tree_mask,
    sm_scale,
    *,
    v_head_dim=None,
    out=None,
    check_data: bool = True,
) -> TreeAttentionFacts:
    """Check tree_attention's arguments (see the contract) and return the derived facts."""
    _tensor("q", q, 3, FLOAT_DTYPES, "float16/bfloat16/float32 tensor of shape (total_q, Hq, Dqk)")
    total_q, hq, dqk = q.shape
    if total_q == 0 or hq == 0 or dqk == 0:
        raise _fail("q", "non-empty (total_q, Hq, Dqk)", q)
    dt = q.dtype
    _tensor(
        "k_cache",
        k_cache,
        4,
        (dt,),
        f"{dt} tensor (same dtype as q) of shape (num_pages, page_size, Hkv, Dqk={dqk})",
    )
    num_pages, page_size, hkv, kd = k_cache.shape
    if kd != dqk or num_pages == 0 or page_size == 0 or hkv == 0:
        raise _fail("k_cache", f"non-empty shape (num_pages, page_size, Hkv, Dqk={dqk})", k_cache)
    if hq % hkv:
        raise _fail("k_cache", f"Hkv dividing q's Hq={hq} (Hq % Hkv == 0)", k_cache)

    if v_cache is None:
        if (
            not isinstance(v_head_dim, numbers.Integral)
            or isinstance(v_head_dim, bool)
            or not 1 <= v_head_dim <= dqk
        ):
            raise _fail(
                "v_head_dim",
                f"an int in [1, Dqk={dqk}] when v_cache is None (MLA: V = k_cache[..., :v])",
                repr(v_head_dim),
            )
        dv = int(v_head_dim)
    else:
        want = f"(num_pages={num_pages}, page_size={page_size}, Hkv={hkv}, Dv)"
        _tensor("v_cache", v_cache, 4, (dt,), f"{dt} tensor (same dtype as q) of shape {want}")
        if tuple(v_cache.shape[:3]) != (num_pages, page_size, hkv) or v_cache.shape[3] == 0:
            raise _fail("v_cache", f"shape {want}", v_cache)
        dv = v_cache.shape[3]
        if v_head_dim is not None and v_head_dim != dv:
            raise _fail("v_head_dim", f"None or v_cache's Dv={dv}", repr(v_head_dim))

    _tensor("qo_indptr", qo_indptr, 1, (torch.int32,), "int32 tensor of shape (B+1,), B >= 1")
    batch = qo_indptr.shape[0] - 1
    if batch < 1:
        raise _fail("qo_indptr", "int32 tensor of shape (B+1,), B >= 1", qo_indptr)
    _tensor("prefix_lens", prefix_lens, 1, (torch.int32,), f"int32 tensor of shape (B={batch},)")
    if prefix_lens.shape[0] != batch:
        raise _fail("prefix_lens", f"int32 tensor of shape (B={batch},)", prefix_lens)
    bt_want = f"int32 tensor of shape (B={batch}, max_pages >= 1)"
    _tensor("block_table", block_table, 2, (torch.int32,), bt_want)
    if block_table.shape[0] != batch or block_table.shape[1] == 0:
        raise _fail("block_table", bt_want, block_table)
    mask_want = f"int32 tensor of shape (total_q={total_q}, W>=1)"
    _tensor("tree_mask", tree_mask, 2, (torch.int32,), mask_want)
    if tree_mask.shape[0] != total_q or tree_mask.shape[1] == 0:
        raise _fail("tree_mask", mask_want, tree_mask)

    named = {
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_table": block_table,
        "prefix_lens": prefix_lens,
        "qo_indptr": qo_indptr,
        "tree_mask": tree_mask,
    }
    for name, t in named.items():
        if t is not None and t.device != q.device:
            raise _fail(name, f"a tensor on q's device {q.device}", t)

    if (
        not isinstance(sm_scale, numbers.Real)
        or isinstance(sm_scale, bool)
        or not math.isfinite(sm_scale)
    ):
        raise _fail("sm_scale", "a finite float", repr(sm_scale))

    if out is not None:
        want = f"{dt} tensor of shape (total_q={total_q}, Hq={hq}, Dv={dv}) on {q.device}"
        if (
            not isinstance(out, torch.Tensor)
            or tuple(out.shape) != (total_q, hq, dv)
            or out.dtype != dt
            or out.device != q.device
        ):
            raise _fail("out", want, out)

    facts = TreeAttentionFacts(
        batch=batch,
        total_q=total_q,
        hq=hq,
        hkv=hkv,
        dqk=dqk,
        dv=dv,
        page_size=page_size,
        num_pages=num_pages,
        max_pages=block_table.shape[1],
        is_mla=v_cache is None,
        words=tree_mask.shape[1],
        max_tree=None,
    )
    if not check_data:
        return facts
    max_tree = _check_data(facts, block_table, prefix_lens, qo_indptr, tree_mask)
    return replace(facts, max_tree=max_tree)


def _check_data(facts, block_table, prefix_lens, qo_indptr, tree_mask) -> int:
    """Value checks on host copies; returns max T_b."""
    qo = qo_indptr.cpu().numpy().astype(np.int64)
    if qo[0] != 0 or qo[-1] != facts.total_q:
        raise ValueError(
            f"qo_indptr: expected to start at 0 and end at total_q={facts.total_q} "
            f"(q's rows), got {qo[0]} ... {qo[-1]}"
        )
    sizes = np.diff(qo)
    if (sizes < 1).any():
        b = int(np.argmax(sizes < 1))
        raise ValueError(
            f"qo_indptr: expected non-decreasing with T_b >= 1 (every tree has a root), "
            f"got T_{b} = {sizes[b]}"
        )
    prefix = prefix_lens.cpu().numpy().astype(np.int64)
    if (prefix < 0).any():
        b = int(np.argmax(prefix < 0))
        raise ValueError(f"prefix_lens: expected values >= 0, got prefix_lens[{b}] = {prefix[b]}")

    max_tree = int(sizes.max())
    need_words = -(-max_tree // 32)
    if facts.words < need_words:
        raise ValueError(
            f"tree_mask: expected int32 tensor of shape (total_q={facts.total_q}, "
            f"W>={need_words}) for max T_b={max_tree}, got {_describe(tree_mask)}"
        )

    pages_needed = -(-(prefix + sizes) // facts.page_size)
    if (pages_needed > facts.max_pages).any():
        b = int(np.argmax(pages_needed > facts.max_pages))
        raise ValueError(
            f"block_table: request {b} needs {pages_needed[b]} pages for P_b + T_b = "
            f"{prefix[b]} + {sizes[b]} tokens at page_size {facts.page_size}, but block_table "
            f"has shape {tuple(block_table.shape)}"
        )
    table = block_table.cpu().numpy()
    used = np.arange(facts.max_pages)[None, :] < pages_needed[:, None]
    bad = used & ((table < 0) | (table >= facts.num_pages))
    if bad.any():
        b, p = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(
            f"block_table: expected page ids in [0, num_pages={facts.num_pages}), "
            f"got block_table[{b}, {p}] = {table[b, p]}"
        )

    words = np.ascontiguousarray(tree_mask.cpu().numpy()).astype("<i4").view(np.uint8)
    bits = np.unpackbits(words, axis=1, bitorder="little").astype(bool)  # (total_q, 32 W)
    for b in range(facts.batch):
        _check_tree(bits[qo[b] : qo[b + 1]], b, int(qo[b]))
    return max_tree


def _check_tree(bits: np.ndarray, b: int, row0: int) -> None:
    """bits: (T, 32 W) bool rows of one request. Raise unless they encode a topological tree."""
    t = bits.shape[0]

    def fail(i: int, why: str) -> ValueError:
        return ValueError(
            f"tree_mask: request {b} row {i} (q row {row0 + i}): {why}; expected each row to "
            f"set its own bit and exactly its ancestors' bits (nodes in topological order)"
        )

    beyond = bits[:, t:].any(axis=1)
    if beyond.any():
        i = int(np.argmax(beyond))
        j = t + int(np.argmax(bits[i, t:]))
        raise fail(i, f"bit {j} set beyond the tree size T_b={t}")
    square = bits[:, :t]
    later = np.triu(square, 1).any(axis=1)
    if later.any():
        i = int(np.argmax(later))
        j = i + 1 + int(np.argmax(square[i, i + 1 :]))
        raise fail(i, f"sees later node {j} (not topological: a node sees only nodes <= itself)")
    diag = np.diagonal(square)
    if not diag.all():
        i = int(np.argmin(diag))
        raise fail(i, f"bit {i} (itself) is not set")
    if t == 1:
        return
    earlier = np.tril(square, -1)
    orphan = ~earlier[1:].any(axis=1)
    if orphan.any():
        i = 1 + int(np.argmax(orphan))
        raise fail(i, "sees no earlier node, so it has no parent (only node 0 is a root)")
    parent = t - 1 - np.argmax(earlier[:, ::-1], axis=1)  # largest visible j < i
    expected = square[parent]
    expected[np.arange(t), np.arange(t)] = True
    wrong = (expected != square)[1:].any(axis=1)
    if wrong.any():
        i = 1 + int(np.argmax(wrong))
        raise fail(
            i,
            f"not a tree: its visible set differs from {{{i}}} plus the visible set of its "
            f"parent {int(parent[i])} (its largest visible earlier node)",
        )
