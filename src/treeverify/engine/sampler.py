"""Next-token choice for a step: greedy, or temperature / top-k / top-p sampling, plus logprobs.

Each request draws from its own generator seeded by (seed, position of the token), so a
request's sampled output does not depend on which other requests share its batch, and a seeded
request is reproducible. Filtering is treeverify.spec's (the one acceptance uses).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treeverify.engine.sequence import Sequence
from treeverify.spec.accept import sample_per_node


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float | None  # None: a prompt's first token (nothing precedes it)
    top: list[tuple[int, float]]  # the k most likely (token, logprob), best first


def request_generator(seq: Sequence, device: torch.device, position: int | None = None):
    """The generator of a request's draw for the token at `position` (default: its next one),
    seeded by (its seed or id, that position): draws do not depend on batch neighbours or on
    speculation, and a seeded request is reproducible."""
    p = seq.sampling_params
    base = p.seed if p.seed is not None else hash(seq.request_id) & 0x7FFFFFFF
    at = seq.num_tokens if position is None else position
    return torch.Generator(device=device).manual_seed(
        (base * 1_000_003 + at) & 0x7FFF_FFFF_FFFF_FFFF
    )


def position_noise(seq: Sequence, count: int, vocab: int, device: torch.device) -> torch.Tensor:
    """(count, V) uniform draws: row d is what plain decoding draws for the token d places after
    the sequence's last one (a speculative round gives it to every node at depth d)."""
    return torch.cat([
        torch.rand((1, 1, vocab), generator=request_generator(seq, device, seq.num_tokens + d),
                   device=device, dtype=torch.float32)[0]
        for d in range(count)
    ])  # fmt: skip


def filters(seq: Sequence, vocab: int) -> tuple[float, float | None, int | None]:
    """(temperature, top_p, top_k) as the spec samplers take them (None = off)."""
    p = seq.sampling_params
    return (p.temperature, p.top_p if p.top_p < 1 else None,
            min(p.top_k, vocab) if p.top_k > 0 else None)  # fmt: skip


def sample(
    logits: torch.Tensor,  # (N, V) fp32, one row per sampled sequence
    seqs: list[Sequence],
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Tokens for `seqs` (same order), and logprobs where the request asked for them."""
    if logits.shape[0] != len(seqs):
        raise ValueError(f"logits: {logits.shape[0]} rows for {len(seqs)} sequences")
    # One device->host read for the whole step: greedy rows by one argmax, sampled rows drawn
    # on the device, then every chosen id read back together.
    chosen = torch.argmax(logits, dim=-1)  # (N,)
    for row, seq in enumerate(seqs):
        p = seq.sampling_params
        if p.temperature == 0:
            continue
        chosen[row] = sample_per_node(
            logits[row].view(1, 1, -1), *filters(seq, logits.shape[-1]),
            request_generator(seq, logits.device),
        )[0, 0]  # fmt: skip
    tokens = chosen.tolist()
    infos: list[TokenLogprobs | None] = [None] * len(seqs)
    for row, seq in enumerate(seqs):
        k = seq.sampling_params.logprobs
        if k is not None:
            infos[row] = token_logprobs(logits[row : row + 1], [tokens[row]], k)[0]
    return tokens, infos


def token_logprobs(
    logits: torch.Tensor,  # (M, V) the (processed) logits each token was drawn from
    token_ids: list[int],  # (M,)
    k: int,  # alternatives per token
) -> list[TokenLogprobs]:
    """Each token's logprob under its row's softmax and the row's k most likely tokens (one
    device->host read). Plain and speculative decoding both report through here."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (M, V)
    ids = torch.tensor(token_ids, dtype=torch.int64).to(logprobs.device)
    chosen = logprobs.gather(1, ids[:, None])[:, 0]  # (M,)
    top = torch.topk(logprobs, k=min(k, logprobs.shape[-1])) if k else None
    if top is None:
        return [TokenLogprobs(t, v, []) for t, v in zip(token_ids, chosen.tolist(), strict=True)]
    host = torch.cat((chosen[:, None], top.values), 1).tolist()
    idx = top.indices.tolist()
    return [TokenLogprobs(t, h[0], list(zip(i, h[1:], strict=True)))
            for t, h, i in zip(token_ids, host, idx, strict=True)]  # fmt: skip
