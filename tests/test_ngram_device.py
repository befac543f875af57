"""The device n-gram matcher (spec/ngram_device.py) equals the host drafter's votes exactly:
random histories with planted repeats, every length around the window, batched."""

from __future__ import annotations

import random

import pytest
import torch

from treeverify.spec.ngram import NgramDrafter
from treeverify.spec.ngram_device import ngram_logits, right_aligned


def _history(rng: random.Random, n: int, vocab: int) -> list[int]:
    """Random tokens with repeated fragments (so suffixes of every length match somewhere)."""
    out: list[int] = []
    while len(out) < n:
        if out and rng.random() < 0.5:
            a = rng.randrange(len(out))
            out += out[a : a + rng.randint(1, 8)]
        else:
            out += [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
    return out[:n]


@pytest.mark.parametrize("window", [2, 5, 64])
def test_equals_host_votes_bit_for_bit(window):
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    vocab = rng.choice([3, 7, 50])  # small vocabularies: many matches of every length
    host = NgramDrafter(vocab, max_n=4, window=window)
    for _ in range(20):
        depth = rng.randint(1, 9)
        hists = [_history(rng, rng.randint(0, 2 * window), vocab) for _ in range(rng.randint(1, 5))]
        votes = torch.tensor([(b, d, t) for b, h in enumerate(hists)
                              for d, t in host.votes(h, depth)],
                             dtype=torch.int64).reshape(-1, 3)  # fmt: skip
        want = host.logits_from_votes(votes, len(hists), depth)  # (B, L, V)
        got = ngram_logits(right_aligned(hists, window), depth, vocab, max_n=4)
        assert torch.equal(got, want), f"seed {seed}"


def test_no_history_and_bad_arguments():
    got = ngram_logits(right_aligned([[], [5]], 8), 3, 10)
    assert torch.allclose(got, torch.full_like(got, -torch.log(torch.tensor(10.0))))  # uniform
    with pytest.raises(ValueError, match="history"):
        ngram_logits(torch.zeros(4, dtype=torch.int64), 3, 10)
    with pytest.raises(ValueError, match="depth"):
        ngram_logits(right_aligned([[1, 2]], 8), 0, 10)


def _votes_by_scan(h: list[int], depth: int, max_n: int, window: int) -> list[tuple[int, int]]:
    """The drafter's rule written the plain way (a scan per n over every start): the
    reference NgramDrafter.votes' one-pass search must equal."""
    h = h[-window:]
    for n in range(min(max_n, len(h) - 1), 0, -1):
        out = []
        for start in range(len(h) - n - 1, -1, -1):  # most recent first
            if h[start : start + n] == h[-n:]:
                out += enumerate(h[start + n : start + n + depth])
        if out:
            return out
    return []


@pytest.mark.parametrize("max_n", [1, 3, 4])
def test_host_votes_equal_the_scan_per_suffix_length(max_n):
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    for _ in range(300):
        vocab, window = rng.choice([2, 3, 7, 50]), rng.choice([2, 5, 64])
        host = NgramDrafter(vocab, max_n=max_n, window=window)
        h, depth = _history(rng, rng.randint(0, 2 * window), vocab), rng.randint(1, 9)
        assert host.votes(h, depth) == _votes_by_scan(h, depth, max_n, window), f"seed {seed}"
