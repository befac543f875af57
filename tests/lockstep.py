"""Two engines stepping the same requests in lockstep: their caches must agree.

Shared by the whole-round tests (test_round_graphs.py: whole rounds vs the general path) and the
lookahead tests (test_round_lookahead.py: rounds launched ahead vs read first).
"""

from __future__ import annotations

import torch


def kv_rows(llm, seq) -> list[torch.Tensor]:
    """The K/V of every cached position of `seq`, through this engine's own page table (two
    engines may give the same positions different pages)."""
    ps = llm.cache.page_size
    pos = torch.arange(seq.num_cached_tokens)
    slots = torch.tensor(seq.block_table)[pos // ps] * ps + pos % ps  # (cached,)
    return [t.reshape(-1, *t.shape[2:])[slots] for layer in sorted(llm.cache.k)
            for t in (llm.cache.k[layer], llm.cache.v[layer])]  # fmt: skip


def assert_same_state(llm_a, a, llm_b, b, msg: str) -> None:
    """Same K/V in every committed slot and the same drafter context rows (DFlash rings)."""
    for x, y in zip(kv_rows(llm_a, a), kv_rows(llm_b, b), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5, msg=msg)
    kv_a, first_a = llm_a.spec.source.context.keys_values(a.request_id)
    kv_b, first_b = llm_b.spec.source.context.keys_values(b.request_id)
    assert first_a == first_b, msg
    torch.testing.assert_close(kv_a, kv_b, rtol=1e-4, atol=1e-4, msg=msg)
