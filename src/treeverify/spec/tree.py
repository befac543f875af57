"""DDTree draft-tree construction (Algorithm 1) as batched, capture-safe tensor code.

The reference algorithm is a best-first search with a host heap (see ``tree_oracle.py``, which is
its literal transcription and our test oracle).  Candidates are rank paths ``(r_1, .., r_d)``: the
node at depth ``d`` whose token is the ``r_d``-th most likely draft token at position ``d``, under
the node ``(r_1, .., r_{d-1})``.  The heap holds ``(logw, ranks, parent, depth, rank)``, is seeded
with ``(lp[0, 0], (0,), root, 1, 0)`` and each pop pushes the next sibling and the first child:

    sibling: logw' = (logw - lp[d-1, rank]) + lp[d-1, rank+1]     (two fp32 roundings)
    child:   logw' = logw + lp[d, 0]                               (one fp32 rounding)

Pops take the max ``logw``; equal ``logw`` pop the lexicographically smaller ranks tuple first (a
tuple is smaller than its extensions).

Why a beam search gives *the same tree, node for node, in fp32* (not just up to rounding)
-------------------------------------------------------------------------------------------
Call the heap's total order on candidates the key: ``(logw desc, ranks asc)``; keys are unique
because ranks tuples are.  The heap pushes each candidate from exactly one "generator" (its elder
sibling, or its parent for rank 0), so candidates form a binary tree G.  Best-first search on a tree
pops in globally descending key order -- and therefore pops exactly the ``budget`` largest keys --
as soon as every G edge strictly decreases the key.  Both edge kinds do, in fp32, exactly:

* child: ``fl(s + lp[d, 0]) <= s`` because ``lp <= 0`` and rounding is monotone; the child's ranks
  tuple extends the parent's, so on equal ``logw`` its key is still smaller.
* sibling: write the node's own value as ``s = fl(u + a)`` (always true: the seed is
  ``fl(0 + lp[0, 0])``, a first child is ``fl(parent + lp[d, 0])`` and a sibling is
  ``fl(t + lp[d, r+1])``).  Lemma: ``fl(fl(s - a) + a) == s``.  Proof: ``t = fl(s - a)`` is a
  float nearest to ``s - a`` and ``u`` is a float, so ``|t - (s-a)| <= |u - (s-a)|``, i.e.
  ``|(t + a) - s| <= |(u + a) - s|``: ``t + a`` is at most as far from ``s`` as ``u + a`` was, and
  ``s`` is a nearest float to ``u + a``.  If ``t + a`` lies on the same side of ``s`` as ``u + a``
  it rounds to ``s`` (a tie at equal distance means ``t == u``).  On the other side the gap to the
  next float is as large, except when ``s = -2^k`` and ``t + a`` lies above it, on the finer side
  (all values are ``<= 0`` by induction); there ``|s - a| <= 2^k`` bounds the rounding error
  ``|t - (s-a)| <= ulp(s-a)/2`` by half the finer gap, a tie resolving to the even ``s``.  Any
  other tie at a half gap means ``u + a`` was a tie too, so ``s`` is even and its neighbours odd.
  Hence for the next rank, ``lp[d, r+1] <= lp[d, r]`` gives
  ``fl(fl(s - a) + lp[d, r+1]) <= fl(fl(s - a) + a) == s``: a sibling never outscores its elder
  sibling, and on an exact tie its larger rank loses.

(The design note's "checked on 200 random cases" agrees; we also checked it on millions of random
chains.)  So the tree is the ``budget`` largest keys among all rank paths, in descending key order.

The batched algorithm (no host sync, static shapes, fixed trip counts)
---------------------------------------------------------------------
Depth by depth, keep a beam of the ``W_d = budget - d + 1`` largest-key depth-``d`` paths (a
depth-``d`` node of the tree has ``d - 1`` ancestors before it, so it ranks within the first
``budget - d + 1`` depth-``d`` paths; its parent is in the previous beam by the same argument).
Candidates at depth ``d`` are ``(beam parent j, rank r)`` for ``r < K_d = min(K, budget - d + 1)``.

* Scores: each candidate's ``logw`` is computed with *the heap's own sequence of fp32 operations*:
  ``s_0 = parent + lp[d-1, 0]`` and ``s_{r+1} = (s_r - lp[d-1, r]) + lp[d-1, r+1]``, one vector
  step per rank for all parents at once.  A per-depth table ``sib[r]`` independent of the parent
  cannot reproduce this: the rounding of ``s_r - lp`` depends on the parent's value.  The loop is
  ``K_d`` sequential device ops per depth in PyTorch (no sync, but ~2 launches per rank); on CUDA
  the Triton kernel in ``_chain_triton.py`` runs the same sequence in registers, one launch per
  depth, bit-identical (checked against the PyTorch loop and the heap on an H200).
* Ties: the beam is stored in lexicographic order of ranks tuples, so candidate ``(j, r)`` has
  lexicographic index ``j * K_d + r`` among the depth's candidates.  The sort key is a single
  int64 ``(orderable_bits(logw) << 32) | (2^31 - 1 - lex)``: unique, exact, and ``topk`` on it
  needs no tie-breaking of its own.
* Merge across depths: the final order is again ``(logw desc, ranks asc)`` but ranks tuples now
  have different lengths; we replace them by their preorder number in the trie of all beam nodes
  (preorder = lexicographic order with prefixes first), computed with subtree sizes bottom-up and
  exclusive sums top-down.  One ``topk`` of ``budget`` over all beam nodes gives the pop order.

Cost (H200, CUDA-graph replay with the mask compile, L=15, V=8192, 2026-12-01,
``scripts/bench_tree_build.py``): this beam search with the Triton chain takes 1.27 / 1.60 / 3.28
/ 7.70 ms at budgets 16 / 64 / 256 / 1024 (B=1; 37 ms at B=32, budget 1024): ~40 small kernels
per depth.  On CUDA ``build_tree`` therefore runs the literal heap instead, one launch
(``tree_heap.py``, kernels/cuda/ddtree_heap.cu): 0.05 / 0.11 / 0.42 / 1.71 ms (B=1), nearly flat
in B.  The beam stays the CPU path and a second, independent implementation for the tests.

Inputs must be finite; ``draft_topk`` clamps log-probs to ``[LOGPROB_FLOOR, 0]`` so ``-inf``
logits (masked vocabulary) give very unlikely but finite paths and never NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from treeverify.kernels.api import triton_available

__all__ = [
    "LOGPROB_FLOOR",
    "DraftTree",
    "build_tree",
    "build_tree_from_topk",
    "draft_topk",
]

#: Lower clamp of draft log-probs: keeps every heap value finite (no ``inf - inf``).
LOGPROB_FLOOR = -1.0e30

_INT64_MIN = -(2**63)
_LEX_MAX = 2**31 - 1


@dataclass
class DraftTree:
    """A batch of draft trees in pop order.

    Node 0 is the root (the previous round's bonus token: ``parents = -1``, ``depths = 0``,
    ``scores = 0``).  Nodes ``1 .. num_nodes-1`` are the popped nodes in pop order, so
    ``parents[b, i] < i``.  Trailing unused nodes (when fewer than ``budget`` rank paths exist)
    have ``tokens = 0``, ``parents = -1``, ``depths = 0`` and ``scores = -inf``; ``num_nodes``
    counts the root plus the real nodes.  All index tensors are int64 (torch's native index type,
    so they feed ``gather``/``scatter`` without casts).
    """

    tokens: Tensor  # (B, budget+1) int64
    parents: Tensor  # (B, budget+1) int64, -1 for the root and padding
    depths: Tensor  # (B, budget+1) int64
    num_nodes: Tensor  # (B,) int64
    scores: Tensor  # (B, budget+1) float32: the heap's logw of each node (root 0, padding -inf)
    # (B*(budget+1), W) int32 ancestor-or-self bits, when the builder wrote them (the CUDA heap
    # with `with_mask`); else None: `parents_to_tree_mask(parents)` gives the same
    mask: Tensor | None = None


def draft_topk(draft_logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Per-position top-``k`` draft log-probs and token ids, shared by the tree builders.

    ``draft_logits (B, L, V)`` -> ``lp (B, L, k)`` float32 sorted descending and ``ids (B, L, k)``
    int64.  Log-probs are ``log_softmax`` in fp32, clamped to ``[LOGPROB_FLOOR, 0]``.  On CUDA
    with ``k <= topk_cuda.MAX_K`` one kernel computes the table (topk_cuda.py).  Among exactly
    equal log-probs the id order is whatever ``torch.topk`` (or the kernel) gives; both
    ``build_tree`` and ``build_tree_host`` consume the same tables, so that choice never makes them
    differ.
    """
    if draft_logits.dim() != 3:
        raise ValueError(f"draft_logits must be (B, L, V), got shape {tuple(draft_logits.shape)}")
    if not 1 <= k <= draft_logits.shape[-1]:
        raise ValueError(f"k must be in [1, V={draft_logits.shape[-1]}], got {k}")
    from . import topk_cuda

    if topk_cuda.usable(draft_logits, k):  # one launch (topk_cuda.py); ties: smaller id first
        return topk_cuda.draft_topk_cuda(draft_logits, k, LOGPROB_FLOOR)
    lp_full = torch.log_softmax(draft_logits.float(), dim=-1)  # (B, L, V)
    lp, ids = torch.topk(lp_full, k, dim=-1, largest=True, sorted=True)  # (B, L, k)
    lp = lp.clamp(min=LOGPROB_FLOOR, max=0.0)
    return lp.contiguous(), ids.contiguous()


def _orderable(score: Tensor) -> Tensor:
    """fp32 -> int64 with the same order (``-0.0`` is folded into ``+0.0``, as the heap sees it)."""
    bits = (score + 0.0).contiguous().view(torch.int32)  # -0.0 + 0.0 == +0.0 in round-to-nearest
    flipped = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats: reverse magnitude
    return flipped.to(torch.int64)


def _key(score: Tensor, lex: Tensor, valid: Tensor) -> Tensor:
    """Unique int64 sort key: larger score first, then smaller ``lex`` first; invalid lowest."""
    key = (_orderable(score) << 32) + (_LEX_MAX - lex)
    return torch.where(valid, key, torch.full_like(key, _INT64_MIN))


def build_tree(
    draft_logits: Tensor,
    budget: int,
    root_tokens: Tensor,
    *,
    backend: str = "auto",
    with_mask: bool = False,
) -> DraftTree:
    """Build the DDTree draft tree for each request on the logits' device.

    Args:
        draft_logits: ``(B, L, V)`` drafter logits for the ``L`` positions after the root.
        budget: number of draft nodes (the root is not counted), a Python int ``>= 1``.
        root_tokens: ``(B,)`` the root (bonus) token of each request.
        backend: sibling-chain implementation (see ``build_tree_from_topk``).
        with_mask: let the CUDA heap also write the ancestor-or-self masks (``DraftTree.mask``;
            other builders leave it None).

    Returns:
        A ``DraftTree`` with ``budget + 1`` node slots, identical node for node to
        ``build_tree_host`` (the heap) on the same inputs.
    """
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    k = min(budget, draft_logits.shape[-1])
    lp, ids = draft_topk(draft_logits, k)
    return build_tree_from_topk(lp, ids, budget, root_tokens, backend=backend,
                                with_mask=with_mask)  # fmt: skip


BACKENDS = ("auto", "heap", "torch", "triton")


def sibling_chain(prev_score: Tensor, a: Tensor, use_triton: bool = False) -> Tensor:
    """Every candidate's heap value: ``prev_score (B, W)`` parents, ``a (B, K)`` the depth's
    log-probs -> ``(B, W, K)`` with ``[:, :, 0] = parent + a[0]`` and
    ``[:, :, r+1] = ([:, :, r] - a[r]) + a[r+1]``, exactly the heap's fp32 operations.

    PyTorch: one vector step per rank (``K`` sequential device ops, no sync).  Triton (CUDA): the
    same sequence in registers, one launch (see ``_chain_triton.py``); bit-identical.
    """
    if use_triton:
        from ._chain_triton import sibling_chain_triton

        return sibling_chain_triton(prev_score, a)
    bsz, w = prev_score.shape
    k = a.shape[1]
    chain = torch.empty(k, bsz, w, dtype=torch.float32, device=prev_score.device)  # (K, B, W)
    s = torch.add(prev_score, a[:, 0:1], out=chain[0])  # first child: parent + lp[d-1, 0]
    for r in range(k - 1):
        t = s - a[:, r : r + 1]  # (B, W)
        s = torch.add(t, a[:, r + 1 : r + 2], out=chain[r + 1])  # next sibling
    return chain.permute(1, 2, 0)


def build_tree_from_topk(
    lp: Tensor,
    ids: Tensor,
    budget: int,
    root_tokens: Tensor,
    *,
    backend: str = "auto",
    with_mask: bool = False,
) -> DraftTree:
    """``build_tree`` on precomputed tables: ``lp (B, L, K)`` fp32 sorted descending, ``<= 0``,
    finite; ``ids (B, L, K)`` the matching token ids.  Capture-safe: no host reads, static shapes.

    ``backend``: ``"heap"`` (CUDA: the literal heap, one kernel launch; ``tree_heap.py``), the
    beam search below with the sibling chain in ``"torch"`` or ``"triton"`` (CUDA), or ``"auto"``
    (the heap on CUDA when cuda-python is installed, else the beam with Triton on CUDA, else
    PyTorch).  All give identical trees.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "heap" or (backend == "auto" and lp.is_cuda):
        from . import tree_heap  # imports DraftTree from here

        if backend == "heap" or (budget <= tree_heap.MAX_BUDGET and tree_heap.available()):
            return tree_heap.build_tree_heap(lp, ids, budget, root_tokens, with_mask=with_mask)
    use_triton = backend == "triton" or (backend == "auto" and lp.is_cuda and triton_available())
    if use_triton and not lp.is_cuda:
        raise ValueError("backend='triton' needs CUDA tensors")
    if lp.dim() != 3 or ids.shape != lp.shape:
        raise ValueError(f"lp and ids must both be (B, L, K), got {tuple(lp.shape)}, {ids.shape}")
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    bsz, n_depth, k_all = lp.shape
    dev = lp.device
    lp = lp.float()
    ids = ids.long()

    # Beam of depth d-1, in lexicographic order of ranks tuples.  Depth 0 is the root alone,
    # whose logw the heap never uses except as "0 + lp[0, 0]" (the seed is lp[0, 0] exactly).
    prev_score = torch.zeros(bsz, 1, dtype=torch.float32, device=dev)  # (B, W_{d-1})
    prev_valid = torch.ones(bsz, 1, dtype=torch.bool, device=dev)  # (B, W_{d-1})

    depth_score: list[Tensor] = []  # per depth: (B, W_d) fp32
    depth_valid: list[Tensor] = []  # (B, W_d) bool
    depth_parent: list[Tensor] = []  # (B, W_d) int64 slot in the previous depth's beam
    depth_token: list[Tensor] = []  # (B, W_d) int64

    for d in range(1, n_depth + 1):
        k_d = min(k_all, budget - d + 1)  # a depth-d node has d-1 ancestors in the budget
        if k_d < 1:
            break
        w_prev = prev_score.shape[1]
        a = lp[:, d - 1, :k_d]  # (B, K_d)
        chain = sibling_chain(prev_score, a, use_triton)  # (B, Wp, K_d)
        cand_score = chain.reshape(bsz, w_prev * k_d)  # (B, Wp*K_d), lexicographic order
        cand_valid = prev_valid.unsqueeze(-1).expand(bsz, w_prev, k_d).reshape(bsz, -1)
        lex = torch.arange(w_prev * k_d, device=dev).expand(bsz, -1)  # (B, Wp*K_d)
        key = _key(cand_score, lex, cand_valid)

        w_d = min(budget - d + 1, w_prev * k_d)
        # The W_d largest keys, in no particular order (they are re-sorted by lex index below).
        top_key, top_idx = torch.topk(key, w_d, dim=1, sorted=False)  # (B, W_d)
        sel_valid = top_key != _INT64_MIN
        # Back to lexicographic order (valid first, in candidate order; invalid slots last).
        order_key = torch.where(sel_valid, top_idx, torch.full_like(top_idx, w_prev * k_d))
        _, perm = torch.sort(order_key, dim=1, stable=True)  # (B, W_d)
        flat = top_idx.gather(1, perm)  # (B, W_d) candidate index j * K_d + r
        valid = sel_valid.gather(1, perm)
        rank = flat % k_d
        score = cand_score.gather(1, flat)
        score = torch.where(valid, score, torch.zeros_like(score))  # finite filler for invalid

        depth_score.append(score)
        depth_valid.append(valid)
        depth_parent.append(flat // k_d)
        depth_token.append(ids[:, d - 1, :k_d].gather(1, rank))
        prev_score, prev_valid = score, valid

    n_d = len(depth_score)
    widths = [t.shape[1] for t in depth_score]

    # Preorder number of every beam node in the trie of beam nodes (= lexicographic rank of its
    # ranks tuple, prefixes first).  Subtree sizes bottom-up ...
    sizes = [v.long() for v in depth_valid]  # (B, W_d)
    for d in range(n_d - 1, 0, -1):
        child = torch.where(depth_valid[d], sizes[d], torch.zeros_like(sizes[d]))
        sizes[d - 1] = sizes[d - 1] + torch.zeros_like(sizes[d - 1]).scatter_add_(
            1, depth_parent[d], child
        )
    # ... then pre(x) = pre(parent) + 1 + (sizes of x's elder siblings), top-down.  Siblings are
    # contiguous in a lexicographically ordered beam, so the elder-sibling sum is an exclusive
    # prefix sum minus the prefix sum at the parent's first child.
    preorder: list[Tensor] = []
    pre_parent = torch.full((bsz, 1), -1, dtype=torch.int64, device=dev)  # the root
    for d in range(n_d):
        sz = torch.where(depth_valid[d], sizes[d], torch.zeros_like(sizes[d]))
        excl = torch.cumsum(sz, dim=1) - sz  # (B, W_d)
        per_parent = torch.zeros(bsz, pre_parent.shape[1], dtype=torch.int64, device=dev)
        per_parent.scatter_add_(1, depth_parent[d], sz)
        start = torch.cumsum(per_parent, dim=1) - per_parent  # (B, W_{d-1})
        par = depth_parent[d]
        pre = pre_parent.gather(1, par) + 1 + excl - start.gather(1, par)
        preorder.append(pre)
        pre_parent = pre

    # Final merge: the budget largest (logw desc, preorder asc) among all beam nodes.
    all_score = torch.cat(depth_score, dim=1)  # (B, N)
    all_valid = torch.cat(depth_valid, dim=1)
    all_pre = torch.cat(preorder, dim=1)
    all_token = torch.cat(depth_token, dim=1)
    all_depth = torch.cat(
        [torch.full((bsz, w), d + 1, dtype=torch.int64, device=dev) for d, w in enumerate(widths)],
        dim=1,
    )
    offsets = [0]
    for w in widths:
        offsets.append(offsets[-1] + w)
    # Global id of each node's parent (-1 = the root).
    all_parent_gid = torch.cat(
        [depth_parent[0].new_full((bsz, widths[0]), -1)]
        + [depth_parent[d] + offsets[d - 1] for d in range(1, n_d)],
        dim=1,
    )
    n_all = all_score.shape[1]
    n_sel = min(budget, n_all)
    all_key = _key(all_score, all_pre, all_valid)
    top_key, sel = torch.topk(all_key, n_sel, dim=1)  # (B, n_sel) in pop order
    sel_valid = top_key != _INT64_MIN

    # Node index of every global id (1 + pop position); only read for valid parents.
    pos = torch.zeros(bsz, n_all, dtype=torch.int64, device=dev)
    pos.scatter_(1, sel, torch.arange(1, n_sel + 1, device=dev).expand(bsz, -1))
    par_gid = all_parent_gid.gather(1, sel)  # (B, n_sel)
    par_node = torch.where(par_gid < 0, torch.zeros_like(par_gid), pos.gather(1, par_gid.clamp(0)))

    n_slots = budget + 1
    tokens = torch.zeros(bsz, n_slots, dtype=torch.int64, device=dev)
    parents = torch.full((bsz, n_slots), -1, dtype=torch.int64, device=dev)
    depths = torch.zeros(bsz, n_slots, dtype=torch.int64, device=dev)
    scores = torch.full((bsz, n_slots), float("-inf"), dtype=torch.float32, device=dev)
    tokens[:, 0] = root_tokens.to(device=dev, dtype=torch.int64)
    scores[:, 0] = 0.0
    zero = torch.zeros_like(par_node)
    tokens[:, 1 : n_sel + 1] = torch.where(sel_valid, all_token.gather(1, sel), zero)
    parents[:, 1 : n_sel + 1] = torch.where(sel_valid, par_node, zero - 1)
    depths[:, 1 : n_sel + 1] = torch.where(sel_valid, all_depth.gather(1, sel), zero)
    scores[:, 1 : n_sel + 1] = torch.where(
        sel_valid, all_score.gather(1, sel), torch.full_like(all_score[:, :n_sel], float("-inf"))
    )
    num_nodes = 1 + sel_valid.sum(dim=1)
    return DraftTree(
        tokens=tokens, parents=parents, depths=depths, num_nodes=num_nodes, scores=scores
    )
