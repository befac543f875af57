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
from treeverify.kernels.staging import to_device
from treeverify.spec.accept import sample_per_node


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float | None  # None: a prompt's first token (nothing precedes it)
    top: list[tuple[int, float]]  # the k most likely (token, logprob), best first


def filters(seq: Sequence, vocab: int) -> tuple[float, float | None, int | None]:
    """(temperature, top_p, top_k) as the spec samplers take them (None = off)."""
    p = seq.sampling_params
    return (p.temperature, p.top_p if p.top_p < 1 else None,
            min(p.top_k, vocab) if p.top_k > 0 else None)  # fmt: skip


def unfiltered(seq: Sequence) -> bool:
    """Whether a request's draw needs no sort (no top-p, no top-k): the fused pick takes it."""
    p = seq.sampling_params
    return p.top_p >= 1 and p.top_k <= 0


def sample(
    logits: torch.Tensor,  # (N, V) fp32, one row per sampled sequence
    seqs: list[Sequence],
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Tokens for `seqs` (same order), and logprobs where the request asked for them."""
    if logits.shape[0] != len(seqs):
        raise ValueError(f"logits: {logits.shape[0]} rows for {len(seqs)} sequences")
    # One device->host read for the whole step, every row drawn on the device together.
    if all(s.sampling_params.temperature == 0 for s in seqs):
        chosen = torch.argmax(logits, dim=-1)  # (N,)
    else:
        chosen = _draw(logits, seqs)
    tokens = chosen.tolist()
    infos: list[TokenLogprobs | None] = [None] * len(seqs)
    for row, seq in enumerate(seqs):
        k = seq.sampling_params.logprobs
        if k is not None:
            infos[row] = token_logprobs(logits[row : row + 1], [tokens[row]], k)[0]
    return tokens, infos


def _draw(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """(N,) tokens of a step with sampled rows (greedy rows, temperature 0, their argmax)."""
    n, vocab = logits.shape
    dev = logits.device
    temps = [float(s.sampling_params.temperature) for s in seqs]
    keys = [request_key(s) for s in seqs]
    positions = [s.num_tokens for s in seqs]  # each row draws its next token
    if dev.type == "cuda" and triton_available() and all(unfiltered(s) for s in seqs):
        params = to_device(torch.tensor([keys, positions], dtype=torch.int64), dev)  # (2, N)
        return pick_tokens(logits.float().contiguous(), to_device(torch.tensor(temps), dev),
                           params[0], params[1])  # fmt: skip
    noise = uniform_noise(
        [row_seed(k, q) for k, q in zip(keys, positions, strict=True)], vocab, dev
    )  # (N, V) fmt: skip
    top_p = [s.sampling_params.top_p for s in seqs]  # 1: off
    top_k = [s.sampling_params.top_k for s in seqs]  # 0: off
    any_p, any_k = any(p < 1 for p in top_p), any(k > 0 for k in top_k)
    return sample_per_node(
        logits.view(n, 1, vocab), to_device(torch.tensor(temps), dev),
        to_device(torch.tensor(top_p), dev) if any_p else None,
        to_device(torch.tensor(top_k), dev) if any_k else None,
        noise=noise.view(n, 1, vocab),
    )[:, 0]  # fmt: skip


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
