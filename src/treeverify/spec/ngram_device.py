"""The n-gram drafter's suffix matching as fixed-shape tensor ops: no host loop, no host sync.

Same rule as `NgramDrafter.votes` (spec/ngram.py), for a batch of right-aligned histories:

    history (B, W) int64: each sequence's last W tokens, right-aligned, -1 on the left if shorter

For the longest n <= max_n whose suffix history[-n:] occurs earlier (an occurrence must end
before the last token), every occurrence votes for the tokens that followed it at distances
1..L. Matches are built up from n = 1: `eq[n][s]` (the n tokens from s equal the suffix of
length n) is `eq[n-1][s+1] & (h[s] == h[W-n])`. A suffix must start on a real token (>= 0;
padding is -1), so one longer than the history finds nothing, as on the host.
Counts go through one scatter_add (exact integer counts in fp32, order-free), then the same
floor and normalisation as the host path: the logits are bit-identical to
`NgramDrafter.logits_from_votes(votes)`.

Cost: O(max_n * B * W) compares and O(B * W * L) scatter elements; every shape depends only on
(B, W, L), so a CUDA graph can capture it.
"""

from __future__ import annotations

import torch


def ngram_logits(
    history: torch.Tensor,  # (B, W) int64 right-aligned tokens, -1 padding on the left
    depth: int,  # L
    vocab_size: int,
    max_n: int = 4,
    floor: float = 1e-3,
) -> torch.Tensor:  # (B, L, V) fp32 log-probabilities
    if history.dim() != 2 or history.dtype != torch.int64:
        raise ValueError(f"history: expected (B, W) int64, got {tuple(history.shape)} "
                         f"{history.dtype}")  # fmt: skip
    if depth < 1 or max_n < 1:
        raise ValueError(f"depth/max_n: expected >= 1, got {depth}/{max_n}")
    b, w = history.shape
    device = history.device
    pos = torch.arange(w, device=device)  # (W,)

    # ends[b, e]: an occurrence of the chosen suffix ends just before position e (its votes
    # start at e); the longest n with any occurrence decides.
    ends = torch.zeros(b, w, dtype=torch.bool, device=device)  # (B, W)
    eq = torch.ones(b, w + 1, dtype=torch.bool, device=device)  # n = 0: every start matches
    for n in range(1, min(max_n, w - 1) + 1):
        first = history[:, w - n : w - n + 1]  # (B, 1): the suffix's first token
        same = (history == first) & (first >= 0)  # (B, W): h[s] == h[W-n], a real token
        eq = eq[:, 1:] & same[:, : w - n + 1]  # (B, W-n+1): starts 0 .. W-n
        starts = eq[:, : w - n]  # (B, W-n): the occurrence ends before the last token
        found = starts.any(dim=1, keepdim=True)  # (B, 1)
        ends = torch.where(found, torch.nn.functional.pad(starts, (n, 0)), ends)  # e = s + n
    # votes: the token at e + d for d = 0..L-1, while e + d < W
    d = torch.arange(depth, device=device)  # (L,)
    at = pos[:, None] + d[None, :]  # (W, L)
    inside = at < w  # (W, L)
    tok = history[:, at.clamp(max=w - 1)]  # (B, W, L)
    weight = (ends[:, :, None] & inside[None]).float()  # (B, W, L)
    flat = (
        torch.arange(b, device=device)[:, None, None] * depth + d[None, None, :]
    ) * vocab_size + tok.clamp(min=0)  # fmt: skip  (B, W, L)
    counts = torch.zeros(b * depth * vocab_size, device=device)
    counts.scatter_add_(0, flat.reshape(-1), weight.reshape(-1))
    probs = counts.view(b, depth, vocab_size) + floor  # (B, L, V)
    return (probs / probs.sum(-1, keepdim=True)).log()


def right_aligned(histories: list[list[int]], window: int) -> torch.Tensor:
    """(B, W) int64 on the host: each history's last `window` tokens, -1 on the left."""
    out = torch.full((len(histories), window), -1, dtype=torch.int64)
    for i, h in enumerate(histories):
        tail = h[-window:]
        if tail:
            out[i, window - len(tail) :] = torch.tensor(tail, dtype=torch.int64)
    return out
