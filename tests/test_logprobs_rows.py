"""sampler.rows_logprobs: every row's logprob and top-k alternatives, with a k per row, in one
device read, equal to each row's own `topk` at its own k (ties included: rows are grouped by k,
so a request's alternatives do not depend on the k of the others in its step)."""

from __future__ import annotations

import os
import random

import torch

from treeverify.engine.sampler import rows_logprobs, token_logprobs


def test_each_row_equals_its_own_topk_at_its_own_k():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for trial in range(200):
        m, vocab = rng.randint(1, 6), rng.randint(2, 20)
        logits = torch.randn(m, vocab, generator=gen)
        if trial % 3 == 0:
            logits = logits.round()  # many tied values
        tokens = [rng.randrange(vocab) for _ in range(m)]
        ks = [rng.choice([0, 1, 2, 5, 30]) for _ in range(m)]  # 30: more than the vocabulary
        got = rows_logprobs(logits, tokens, ks)
        lp = torch.log_softmax(logits, -1)
        for r in range(m):
            assert got[r].token_id == tokens[r]
            assert got[r].logprob == lp[r, tokens[r]].item(), f"seed {seed}"
            k = min(ks[r], vocab)
            want = []
            if k:
                top = torch.topk(lp[r : r + 1], k)
                want = list(zip(top.indices[0].tolist(), top.values[0].tolist(), strict=True))
            assert got[r].top == want, f"seed {seed}, row {r}, k {ks[r]}"


def test_no_rows_and_one_k_for_all():
    assert rows_logprobs(torch.zeros(0, 5), [], []) == []
    logits = torch.randn(3, 7)
    one = token_logprobs(logits, [1, 2, 3], 2)
    assert [x.top for x in one] == [x.top for x in rows_logprobs(logits, [1, 2, 3], [2, 2, 2])]
    assert all(len(x.top) == 2 for x in one)
