"""Acceptance: walk the verified draft tree on the device (greedy, and lossless sampling).

The walk (DDTree step 6): start at the root; while some child ``c`` of ``cur`` has
``tokens[c] == posterior[cur]``, move to ``c`` (the lowest-index such child if there are several;
DDTree siblings have distinct tokens so that never happens there).  ``posterior[i]`` is the
target's token at node ``i``: its argmax (greedy) or one independent sample (``accept_sampled``).
The bonus token is ``posterior[last]``.

Vectorized without host reads or data-dependent shapes: a node is *chosen* iff its token matches
its parent's posterior and it is the lowest-index matching child of its parent; the walk is
exactly the set of nodes whose whole root path is chosen (an AND along the path, computed by
pointer jumping in ``ceil(log2(max_depth + 1))`` fixed rounds).  That set is a single root path;
its deepest node is ``last`` and scattering its nodes by depth gives ``path``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .mask import _jump_pointers, _rounds, depths_from_parents

__all__ = ["Acceptance", "accept_greedy", "accept_sampled", "sample_per_node", "walk_tree"]


@dataclass
class Acceptance:
    """Result of one acceptance walk for each request.

    ``path[b, k]`` is the node index at depth ``k`` of the accepted path (``path[b, 0] = 0``, the
    root), ``-1`` past its end.  ``length[b]`` is the number of nodes on the path *including the
    root*, so ``length - 1`` draft tokens were accepted and, with the bonus, ``length`` tokens are
    committed this round (``tokens[path[b, 1:length]]`` then ``bonus``).  ``last[b] =
    path[b, length-1]`` is the deepest accepted node; ``bonus[b] = posterior[b, last[b]]``.
    """

    path: Tensor  # (B, L+1) int64 node indices, root first, -1 padded
    length: Tensor  # (B,) int64, >= 1
    bonus: Tensor  # (B,) int64
    last: Tensor  # (B,) int64


def walk_tree(
    tokens: Tensor, parents: Tensor, posterior: Tensor, max_depth: int | None = None
) -> Acceptance:
    """The tree walk with a given per-node posterior token (``(B, T)`` each).

    ``max_depth`` (default ``T - 1``) is the longest path considered and sets ``path``'s width
    ``max_depth + 1``; pass the drafter's ``L`` to keep it small.
    """
    if tokens.shape != parents.shape or posterior.shape != parents.shape or parents.dim() != 2:
        raise ValueError(
            "tokens, parents, posterior must all be (B, T); got "
            f"{tuple(tokens.shape)}, {tuple(parents.shape)}, {tuple(posterior.shape)}"
        )
    bsz, t = parents.shape
    depth_cap = t - 1 if max_depth is None else max_depth
    dev = parents.device
    idx = torch.arange(t, device=dev).expand(bsz, t)  # (B, T)
    has_parent = parents >= 0
    par = parents.long().clamp(min=0)  # (B, T)
    match = has_parent & (tokens.long() == posterior.long().gather(1, par))  # (B, T)
    # Lowest-index matching child of each node.
    big = torch.full_like(idx, t)
    first = torch.full((bsz, t), t, dtype=torch.int64, device=dev)
    first.scatter_reduce_(1, par, torch.where(match, idx, big), reduce="amin", include_self=True)
    chosen = match & (first.gather(1, par) == idx)
    chosen = chosen | (idx == 0)  # the root is always on the path
    # AND of `chosen` along each root path, by pointer jumping.
    ptr = _jump_pointers(parents)
    ok = chosen.clone()
    for _ in range(_rounds(min(t, depth_cap + 1))):
        ok = ok & ok.gather(1, ptr)
        ptr = ptr.gather(1, ptr)
    depth = depths_from_parents(parents)  # (B, T)
    ok = ok & (depth <= depth_cap)
    # ok is one root path; its deepest node is the last accepted one.
    last = torch.where(ok, depth, torch.full_like(depth, -1)).argmax(dim=1)  # (B,)
    length = depth.gather(1, last.unsqueeze(1)).squeeze(1) + 1
    path = torch.full((bsz, depth_cap + 2), -1, dtype=torch.int64, device=dev)
    col = torch.where(ok, depth, torch.full_like(depth, depth_cap + 1))  # spare column for others
    path.scatter_(1, col, torch.where(ok, idx, torch.full_like(idx, -1)))
    bonus = posterior.long().gather(1, last.unsqueeze(1)).squeeze(1)
    return Acceptance(path=path[:, : depth_cap + 1], length=length, bonus=bonus, last=last)


def accept_greedy(
    tokens: Tensor, parents: Tensor, posterior: Tensor, max_depth: int | None = None
) -> Acceptance:
    """Greedy (temperature 0) acceptance: ``posterior (B, T)`` is the target argmax per node.
    On CUDA the walk is one kernel (walk_cuda.py), elsewhere the vectorized `walk_tree`: equal."""
    from . import walk_cuda

    if walk_cuda.usable(tokens):
        depth = parents.shape[1] - 1 if max_depth is None else max_depth
        return walk_cuda.greedy_walk_cuda(tokens, parents, posterior, depth)
    return walk_tree(tokens, parents, posterior, max_depth)


def _as_batch(x: Tensor | float | int | None, bsz: int, dtype: torch.dtype, dev) -> Tensor | None:
    if x is None:
        return None
    if isinstance(x, Tensor):
        return x.to(device=dev, dtype=dtype).reshape(-1).expand(bsz)
    return torch.full((bsz,), x, dtype=dtype, device=dev)


def sample_per_node(
    target_logits: Tensor,
    temperature: Tensor | float,
    top_p: Tensor | float | None = None,
    top_k: Tensor | int | None = None,
    generator: torch.Generator | None = None,
    noise: Tensor | None = None,
) -> Tensor:
    """One independent token per node from the (filtered) target distribution: ``(B, T)`` int64.

    Per request ``b`` (each parameter a scalar or a ``(B,)`` tensor): logits are divided by
    ``temperature[b]``, restricted to the ``top_k[b]`` largest (``<= 0`` or ``>= V``: off), then
    to the smallest set of largest-probability tokens whose mass reaches ``top_p[b]`` (``>= 1``:
    off; ties at the cut are kept), and sampled by the Gumbel-max trick with ``torch.rand``
    (no ``multinomial``, which can sync on CUDA).  ``temperature[b] == 0`` means argmax of the raw
    logits for that request.  ``None`` for ``top_p``/``top_k`` skips the sort entirely.
    ``noise`` (B, T, V) uniform [0, 1): the draws to use instead of ``torch.rand`` (nodes at the
    same depth may share theirs: only one node per depth is ever on the accepted path).
    """
    bsz, t, v = target_logits.shape
    dev = target_logits.device
    logits = target_logits.float()  # (B, T, V)
    temp = _as_batch(temperature, bsz, torch.float32, dev)
    greedy = temp <= 0  # (B,)
    scaled = logits / torch.where(greedy, torch.ones_like(temp), temp).view(bsz, 1, 1)
    if top_k is not None or top_p is not None:
        neg_inf = torch.full_like(scaled, float("-inf"))
        sorted_logits, _ = torch.sort(scaled, dim=-1, descending=True)  # (B, T, V)
        keep_min = sorted_logits[..., -1:]  # (B, T, 1): by default keep everything
        if top_k is not None:
            k = _as_batch(top_k, bsz, torch.int64, dev)
            k = torch.where((k <= 0) | (k > v), torch.full_like(k, v), k)
            kth = sorted_logits.gather(-1, (k - 1).view(bsz, 1, 1).expand(bsz, t, 1))
            keep_min = torch.maximum(keep_min, kth)
            sorted_logits = torch.where(sorted_logits >= kth, sorted_logits, neg_inf)
        if top_p is not None:
            p = _as_batch(top_p, bsz, torch.float32, dev).view(bsz, 1, 1)
            probs = torch.softmax(sorted_logits, dim=-1)
            mass_before = torch.cumsum(probs, dim=-1) - probs  # (B, T, V)
            in_nucleus = (mass_before < p) | (p >= 1.0)
            in_nucleus[..., 0] = True
            # Smallest kept logit = the last sorted entry inside the nucleus.
            n_keep = in_nucleus.long().sum(dim=-1, keepdim=True)  # (B, T, 1) >= 1
            pth = sorted_logits.gather(-1, n_keep - 1)
            keep_min = torch.maximum(keep_min, pth)
        scaled = torch.where(scaled >= keep_min, scaled, neg_inf)
    if noise is None:
        u = torch.rand(scaled.shape, generator=generator, device=dev, dtype=torch.float32)
    else:
        if noise.shape != scaled.shape:
            raise ValueError(f"noise: expected {tuple(scaled.shape)}, got {tuple(noise.shape)}")
        u = noise.to(device=dev, dtype=torch.float32)
    # -log(-log(u)), in place on clamp_min's fresh copy: one (B, T, V) buffer, not four
    neg_gumbel = u.clamp_min(torch.finfo(torch.float32).tiny).log_().neg_().log_()
    sampled = (scaled - neg_gumbel).argmax(dim=-1)  # (B, T)
    argmax = logits.argmax(dim=-1)
    return torch.where(greedy.view(bsz, 1), argmax, sampled)


def accept_sampled(
    tokens: Tensor,
    parents: Tensor,
    target_logits: Tensor,
    temperature: Tensor | float,
    top_p: Tensor | float | None = None,
    top_k: Tensor | int | None = None,
    generator: torch.Generator | None = None,
    max_depth: int | None = None,
    noise: Tensor | None = None,
) -> Acceptance:
    """DDTree's lossless sample-and-walk acceptance.

    Draw one independent token per node from the target distribution at that node
    (``sample_per_node``) and walk the tree with those samples as the posterior.  Every committed
    token (accepted draft tokens, then the bonus) is then an exact sample from the target given the
    committed prefix: the token committed after node ``cur`` is ``sample[cur]`` whether or not a
    child matches it, and samples at different nodes are independent.  ``temperature == 0`` for a
    request gives exactly ``accept_greedy`` with the target argmax for it.

    ``noise`` (B, N, V): per-node uniform draws (see ``sample_per_node``). The engine gives every
    node the draw that plain decoding would use for the token at that node's position, so a seeded
    request commits exactly plain decoding's tokens whatever trees the drafter proposes: the path
    holds one node per depth, and each depth's draw is independent of the ones that chose it.
    """
    sample = sample_per_node(target_logits, temperature, top_p, top_k, generator, noise)
    return walk_tree(tokens, parents, sample, max_depth)
