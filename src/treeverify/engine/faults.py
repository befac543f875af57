"""Planted faults, TEST ONLY: the failure classes the deployment gate must catch.

Inert unless TREEVERIFY_FAULT is set (read through treeverify.env), one fault at a time:

| TREEVERIFY_FAULT  | what goes wrong                                                          |
| ----------------- | ------------------------------------------------------------------------ |
| attn_past:N       | attention output is wrong for tokens whose context is longer than N      |
| merge_bug         | like a broken split-KV merge: wrong output once the prefix exceeds 256   |
| batch_over:N      | logits corrupted in steps that run more than N sequences                 |
| capture_crash     | the server exits non-zero in the CUDA-graph-capture startup phase        |
| capture_hang      | the server hangs in that phase and never becomes ready                   |
| first_request_crash | the server process dies on its first HTTP completion request           |
| garbage_after:N   | every token after a request's N-th output token is garbage              |
| spec_diverge      | speculative rounds commit a wrong bonus token (output differs from plain) |

Each hook below is a no-op returning its input when its fault is not the active one.
"""

from __future__ import annotations

import torch

from treeverify import env

MERGE_BUG_PREFIX = 256  # the split chunk a broken merge would show beyond


def active(name: str) -> int | None:
    """The fault's parameter (0 when it takes none) if `name` is the planted fault, else None."""
    fault = env.planted_fault()
    if fault is None or fault[0] != name:
        return None
    return fault[1]


def any_planted() -> bool:
    """True when any fault is planted (the engine then runs eager steps only)."""
    return env.planted_fault() is not None


def attention_fault_rows(
    prefix_lens: list[int], query_lens: list[int]
) -> tuple[torch.Tensor, str] | None:
    """Once per step (host): the rows a planted attention fault corrupts, and how; None when no
    attention fault is planted, so a real deployment pays one environment lookup per step."""
    past, merge = active("attn_past"), active("merge_bug")
    if past is None and merge is None:
        return None
    prefix = torch.repeat_interleave(torch.tensor(prefix_lens), torch.tensor(query_lens))  # (T,)
    if past is not None:
        kv = prefix + torch.cat([torch.arange(1, n + 1) for n in query_lens])  # (T,) context
        return kv > past, "roll"
    return prefix > MERGE_BUG_PREFIX, "scale"


def corrupt_attention(out: torch.Tensor, rows: tuple[torch.Tensor, str]) -> torch.Tensor:
    """Apply `attention_fault_rows`' verdict to one layer's output (T, Hq, Dv)."""
    bad, how = rows
    bad = bad.to(out.device)[:, None, None]
    return torch.where(bad, out.roll(1, dims=-1) if how == "roll" else out * 0.25, out)


def corrupt_logits(logits: torch.Tensor, num_seqs: int) -> torch.Tensor:
    n = active("batch_over")
    if n is not None and num_seqs > n:
        return logits.roll(7, dims=-1)
    return logits


def garble_token(token: int, num_output_tokens: int, vocab_size: int) -> int:
    n = active("garbage_after")
    if n is not None and num_output_tokens >= n:
        return (token * 7919 + 13) % vocab_size
    return token


def diverge_bonus(token: int, vocab_size: int) -> int:
    if active("spec_diverge") is not None:
        return (token + 1) % vocab_size
    return token
