"""Next-token choice for a step: greedy, or temperature / top-k / top-p sampling, plus logprobs.

Each request draws from its own generator seeded by (seed, position of the token), so a
request's sampled output does not depend on which other requests share its batch, and a seeded
request is reproducible. Filtering is treeverify.spec's (the one acceptance uses).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treeverify.engine import faults
from treeverify.engine.sequence import Sequence
from treeverify.spec.accept import sample_per_node


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the k most likely (token, logprob), best first


def sample(
    logits: torch.Tensor,  # (N, V) fp32, one row per sampled sequence
    seqs: list[Sequence],
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Tokens for `seqs` (same order), and logprobs where the request asked for them."""
    if logits.shape[0] != len(seqs):
        raise ValueError(f"logits: {logits.shape[0]} rows for {len(seqs)} sequences")
    tokens: list[int] = []
    infos: list[TokenLogprobs | None] = []
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (N, V)
    for row, seq in enumerate(seqs):
        p = seq.sampling_params
        if p.temperature == 0:
            tok = int(torch.argmax(logits[row]))
        else:
            gen = torch.Generator(device=logits.device)
            base = p.seed if p.seed is not None else hash(seq.request_id) & 0x7FFFFFFF
            gen.manual_seed(base * 1_000_003 + seq.num_tokens)
            tok = int(
                sample_per_node(
                    logits[row].view(1, 1, -1), p.temperature, p.top_p if p.top_p < 1 else None,
                    p.top_k if p.top_k > 0 else None, gen,
                )[0, 0]
            )  # fmt: skip
        tok = faults.garble_token(tok, seq.num_output_tokens, logits.shape[-1])  # planted only
        tokens.append(tok)
        if p.logprobs is None:
            infos.append(None)
            continue
        top = torch.topk(logprobs[row], k=max(p.logprobs, 0)) if p.logprobs else None
        infos.append(
            TokenLogprobs(
                token_id=tok,
                logprob=float(logprobs[row, tok]),
                top=[]
                if top is None
                else list(zip(top.indices.tolist(), top.values.tolist(), strict=True)),  # fmt: skip
            )
        )
    return tokens, infos
