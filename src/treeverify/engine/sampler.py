"""Next-token choice for a step: greedy, or temperature / top-k / top-p sampling, plus logprobs.

A sampled row is the Gumbel-max of its (filtered) logits over engine/sample_noise.py's draws,
hashed from (request key, token position): a request's sampled output does not depend on which
other requests share its batch, and a seeded request is reproducible. The whole step's rows are
drawn together: on a GPU rows without top-p / top-k in one Triton launch (engine/pick_kernels.py),
else through treeverify.spec's filtering (the one acceptance uses) with the same draws.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treeverify.engine.pick_kernels import pick_tokens
from treeverify.engine.sample_noise import request_key, row_seed, uniform_noise
from treeverify.engine.sequence import Sequence
from treeverify.kernels.api import triton_available
from treeverify.kernels.staging import take_rows, to_device
from treeverify.spec.accept import sample_per_node


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float | None  # None: a prompt's first token (nothing precedes it)
    top: list[tuple[int, float]]  # the k most likely (token, logprob), best first


def unfiltered(seq: Sequence) -> bool:
    """Whether a request's token needs no sort (greedy, or no top-p and no top-k): the fused
    pick takes it."""
    p = seq.sampling_params
    return p.temperature == 0 or (p.top_p >= 1 and p.top_k <= 0)


def drawable(seqs: list[Sequence], sampling: bool) -> bool:
    """Whether a graph that picks on the device (a decode step launched ahead, a whole round)
    takes these requests as to their sampling: all greedy, or, where it draws (`sampling`), none
    needing a sort (the engine checks logprobs, penalties and logit_bias itself)."""
    if all(s.sampling_params.temperature == 0 for s in seqs):
        return True
    return sampling and all(unfiltered(s) for s in seqs)


def staged_draws(seqs: list[Sequence]) -> tuple[list[float] | None, list[int] | None]:
    """The requests' temperatures and draw keys as a stage takes them (StepStage.write_decodes /
    write_round); (None, None) when all are greedy (the stage's zeros)."""
    temps = [float(s.sampling_params.temperature) for s in seqs]
    if not any(temps):
        return None, None
    return temps, [request_key(s) for s in seqs]


def sample(
    logits: torch.Tensor,  # (N, V) fp32, one row per sampled sequence
    seqs: list[Sequence],
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Tokens for `seqs` (same order), and logprobs where the request asked for them."""
    if logits.shape[0] != len(seqs):
        raise ValueError(f"logits: {logits.shape[0]} rows for {len(seqs)} sequences")
    # One device->host read for the whole step, every row drawn on the device together.
    tokens = draw_nodes(logits[:, None, :], None, 0, seqs)[:, 0].tolist()
    infos: list[TokenLogprobs | None] = [None] * len(seqs)
    want = [r for r, s in enumerate(seqs) if s.sampling_params.logprobs is not None]
    if want:  # every asking row in one call (one more read)
        ks = [seqs[r].sampling_params.logprobs for r in want]
        got = rows_logprobs(take_rows(logits, want), [tokens[r] for r in want], ks)
        for r, info in zip(want, got, strict=True):
            infos[r] = info
    return tokens, infos


def draw_nodes(logits: torch.Tensor, depths: torch.Tensor | None, max_depth: int,
               seqs: list[Sequence]) -> torch.Tensor:  # fmt: skip
    """(B, T) draws for logits (B, T, V): each node of sequence b at depth d = depths[b, t] (<=
    max_depth; None: one node a sequence, depth 0) draws what plain decoding draws for the token
    d places after the sequence's last one, so a round's committed tokens are plain sampled
    decoding's whatever the tree (its path holds one node per depth). Greedy sequences: their
    argmax. On the device, no sync."""
    b, t, vocab = logits.shape
    dev = logits.device
    temps = [float(s.sampling_params.temperature) for s in seqs]
    if not any(temps):
        return logits.argmax(-1)  # all greedy: no draws
    keys = [request_key(s) if temp > 0 else 0 for s, temp in zip(seqs, temps, strict=True)]
    base = [s.num_tokens for s in seqs]  # the position a depth-0 node draws for
    if dev.type == "cuda" and triton_available() and all(unfiltered(s) for s in seqs):
        params = to_device(torch.tensor([keys, base], dtype=torch.int64), dev)  # (2, B)
        positions = params[1][:, None].expand(b, t)  # (B, T)
        if depths is not None:
            positions = positions + depths
        rows = to_device(torch.tensor(temps), dev).repeat_interleave(t)  # (B*T,)
        return pick_tokens(
            logits.float().reshape(b * t, vocab),
            rows,
            params[0].repeat_interleave(t),
            positions.reshape(-1),
        ).view(b, t)
    per = max_depth + 1  # one draw per depth, gathered to the nodes
    seeds = [row_seed(k, q + d) for k, q in zip(keys, base, strict=True) for d in range(per)]
    noise = uniform_noise(seeds, vocab, dev).view(b, per, vocab)  # (B, D+1, V)
    if depths is not None:
        noise = noise.gather(1, depths.to(dev)[..., None].expand(b, t, vocab))  # (B, T, V)
    top_p = [s.sampling_params.top_p for s in seqs]  # 1: off
    top_k = [s.sampling_params.top_k for s in seqs]  # 0: off
    any_p, any_k = any(p < 1 for p in top_p), any(k > 0 for k in top_k)
    return sample_per_node(
        logits, to_device(torch.tensor(temps), dev),
        to_device(torch.tensor(top_p), dev) if any_p else None,
        to_device(torch.tensor(top_k), dev) if any_k else None,
        noise=noise,
    )  # fmt: skip


def token_logprobs(
    logits: torch.Tensor,  # (M, V) the (processed) logits each token was drawn from
    token_ids: list[int],  # (M,)
    k: int,  # alternatives per token
) -> list[TokenLogprobs]:
    """Each token's logprob under its row's softmax and the row's k most likely tokens (one
    device->host read). Plain and speculative decoding both report through here."""
    return rows_logprobs(logits, token_ids, [k] * len(token_ids))


def rows_logprobs(
    logits: torch.Tensor,  # (M, V)
    token_ids: list[int],  # (M,)
    ks: list[int],  # (M,) alternatives per row (rows of several requests: each its own k)
) -> list[TokenLogprobs]:
    """`token_logprobs` with a k per row, one device->host read for all rows: the chosen
    logprobs, then per distinct k its rows' top values and ids, flattened into one float64
    tensor (ids exact below 2^53, float32 values widened exactly). Rows are grouped by k so a
    row's alternatives are `topk` at its own k whatever else shares the step (on tied values a
    larger k's head need not be the same tokens). Indices go up through pinned memory (a
    pageable upload syncs)."""
    if not token_ids:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (M, V)
    dev, vocab = logprobs.device, logprobs.shape[-1]
    ids = to_device(torch.tensor(token_ids, dtype=torch.int64), dev)  # (M,)
    parts = [logprobs.gather(1, ids[:, None])[:, 0].double()]  # (M,)
    groups = []  # (k, its rows, in order)
    for k in sorted({min(k, vocab) for k in ks} - {0}):
        rows = [r for r, kr in enumerate(ks) if min(kr, vocab) == k]
        top = torch.topk(take_rows(logprobs, rows), k=k)  # (m, k) each
        parts += [top.values.double().reshape(-1), top.indices.double().reshape(-1)]
        groups.append((k, rows))
    host = torch.cat(parts).tolist()
    m = len(token_ids)
    alts: list[list[tuple[int, float]]] = [[] for _ in range(m)]
    at = m
    for k, rows in groups:
        size = k * len(rows)
        vals, idx = host[at : at + size], host[at + size : at + 2 * size]
        for n, r in enumerate(rows):
            span = slice(n * k, (n + 1) * k)
            alts[r] = [(int(t), v) for t, v in zip(idx[span], vals[span], strict=True)]
        at += 2 * size
    return [TokenLogprobs(t, host[r], alts[r]) for r, t in enumerate(token_ids)]
