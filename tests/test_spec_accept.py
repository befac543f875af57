"""Greedy and sample-and-walk acceptance: semantics, a naive host walk, and losslessness."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from treeverify.spec import Acceptance, accept_greedy, accept_sampled, walk_tree
from treeverify.spec.accept import sample_per_node


def naive_walk(tokens: list[int], parents: list[int], post: list[int]) -> tuple[list[int], int]:
    path = [0]
    cur = 0
    while True:
        nxt = [c for c in range(1, len(parents)) if parents[c] == cur and tokens[c] == post[cur]]
        if not nxt:
            return path, post[cur]
        cur = min(nxt)
        path.append(cur)


@st.composite
def trees(draw):
    bsz = draw(st.integers(1, 3))
    t = draw(st.integers(1, 40))
    vocab = draw(st.integers(1, 4))  # small: many matches and duplicate sibling tokens
    tok, par, post = [], [], []
    for _ in range(bsz):
        n_real = draw(st.integers(1, t))
        p = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n_real)] + [-1] * (t - n_real)
        par.append(p)
        tok.append([draw(st.integers(0, vocab - 1)) for _ in range(t)])
        post.append([draw(st.integers(0, vocab - 1)) for _ in range(t)])
    return tok, par, post


def _check(acc: Acceptance, tok, par, post, width: int) -> None:
    for b in range(len(par)):
        path, bonus = naive_walk(tok[b], par[b], post[b])
        assert acc.path[b].tolist() == path + [-1] * (width - len(path))
        assert int(acc.length[b]) == len(path)
        assert int(acc.last[b]) == path[-1]
        assert int(acc.bonus[b]) == bonus


@settings(max_examples=150, deadline=None)
@given(trees())
def test_greedy_matches_naive_walk(data) -> None:
    tok, par, post = data
    t = len(par[0])
    acc = accept_greedy(torch.tensor(tok), torch.tensor(par), torch.tensor(post))
    assert acc.path.shape == (len(par), t) and acc.path.dtype == torch.int64
    _check(acc, tok, par, post, t)


def test_semantics_example() -> None:
    # root(0) -> 1:'5' -> 3:'7' -> 4:'2' ; root -> 2:'6'
    tokens = torch.tensor([[9, 5, 6, 7, 2]])
    parents = torch.tensor([[-1, 0, 0, 1, 3]])
    post = torch.tensor([[5, 7, 0, 3, 1]])  # accept 1, 3; at 3 the target says 3, node 4 is '2'
    acc = accept_greedy(tokens, parents, post, max_depth=3)
    assert acc.path.tolist() == [[0, 1, 3, -1]]
    assert acc.length.tolist() == [3]  # root + 2 accepted draft nodes; 3 tokens committed
    assert acc.last.tolist() == [3] and acc.bonus.tolist() == [3]
    # Nothing accepted: path is the root alone, bonus is the root's posterior.
    acc = accept_greedy(tokens, parents, torch.tensor([[8, 0, 0, 0, 0]]), max_depth=3)
    assert acc.path.tolist() == [[0, -1, -1, -1]] and acc.length.tolist() == [1]
    assert acc.bonus.tolist() == [8]
    # Duplicate sibling tokens: the lowest index wins even if the other branch goes deeper.
    tokens = torch.tensor([[0, 4, 4, 1]])
    parents = torch.tensor([[-1, 0, 0, 2]])
    acc = accept_greedy(tokens, parents, torch.tensor([[4, 2, 1, 0]]))
    assert acc.path.tolist() == [[0, 1, -1, -1]] and acc.bonus.tolist() == [2]


@settings(max_examples=40, deadline=None)
@given(trees(), st.integers(0, 2**31 - 1))
def test_temperature_zero_is_greedy(data, seed: int) -> None:
    tok, par, _ = data
    bsz, t = len(par), len(par[0])
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(bsz, t, 4, generator=g)
    tokens, parents = torch.tensor(tok), torch.tensor(par)
    want = accept_greedy(tokens, parents, logits.argmax(-1))
    got = accept_sampled(tokens, parents, logits, 0.0, top_p=0.5, top_k=2, generator=g)
    for f in ("path", "length", "bonus", "last"):
        assert torch.equal(getattr(got, f), getattr(want, f))
    # Per-request temperatures: the zero-temperature requests are greedy.
    temp = torch.tensor([0.0, 1.0, 0.0][:bsz])
    mixed = accept_sampled(tokens, parents, logits, temp, generator=g)
    for b in range(bsz):
        if temp[b] == 0:
            assert torch.equal(mixed.path[b], want.path[b]) and mixed.bonus[b] == want.bonus[b]


# --- losslessness: committed tokens are target samples given the committed prefix -------------

V = 5
# Tree (node:'token'): 0 root; 1:'0', 2:'1', 3:'2' under the root; 4:'3', 5:'0' under 1;
# 6:'4' under 2; 7:'1' under 4
TOKENS = [0, 0, 1, 2, 3, 0, 4, 1]
PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4]
PROBS = np.array(
    [
        [0.30, 0.25, 0.20, 0.15, 0.10],
        [0.10, 0.20, 0.30, 0.25, 0.15],
        [0.05, 0.15, 0.20, 0.25, 0.35],
        [0.40, 0.10, 0.10, 0.20, 0.20],
        [0.22, 0.18, 0.20, 0.20, 0.20],
        [0.50, 0.20, 0.10, 0.10, 0.10],
        [0.20, 0.20, 0.20, 0.20, 0.20],
        [0.10, 0.10, 0.50, 0.20, 0.10],
    ]
)
N_DRAWS = 20000


def committed(acc: Acceptance, tokens: torch.Tensor) -> list[list[int]]:
    """The tokens committed this round per request: accepted draft tokens, then the bonus."""
    out = []
    for b in range(acc.path.shape[0]):
        n = int(acc.length[b])
        nodes = acc.path[b, 1:n].tolist()
        out.append([int(tokens[b, i]) for i in nodes] + [int(acc.bonus[b])])
    return out


def _fit_p(observed: list[int], probs: np.ndarray) -> float:
    obs = np.bincount(np.asarray(observed, dtype=np.int64), minlength=len(probs))
    return float(chisquare(obs, probs * obs.sum()).pvalue)


def _lossless_pvalues(posterior_fn) -> list[float]:
    """p-values of: first token ~ p(root); second | first=a ~ p(child a); third | (0, 3) ~ p(4)."""
    tokens = torch.tensor(TOKENS).expand(N_DRAWS, -1)
    parents = torch.tensor(PARENTS).expand(N_DRAWS, -1)
    logits = torch.tensor(np.log(PROBS), dtype=torch.float32).expand(N_DRAWS, -1, -1)
    acc = walk_tree(tokens, parents, posterior_fn(logits))
    seqs = committed(acc, tokens)
    pvals = [_fit_p([s[0] for s in seqs], PROBS[0])]
    for first, node in [(0, 1), (1, 2), (2, 3)]:
        pvals.append(_fit_p([s[1] for s in seqs if s[0] == first], PROBS[node]))
    pvals.append(_fit_p([s[2] for s in seqs if s[:2] == [0, 3]], PROBS[4]))
    return pvals


def test_sampled_walk_is_lossless() -> None:
    g = torch.Generator().manual_seed(1234)
    tokens = torch.tensor(TOKENS).expand(N_DRAWS, -1)
    parents = torch.tensor(PARENTS).expand(N_DRAWS, -1)
    logits = torch.tensor(np.log(PROBS), dtype=torch.float32).expand(N_DRAWS, -1, -1)
    acc = accept_sampled(tokens, parents, logits, 1.0, generator=g)
    assert (acc.length > 1).float().mean() > 0.5  # the tree is actually exercised
    g = torch.Generator().manual_seed(1234)
    pvals = _lossless_pvalues(lambda lg: sample_per_node(lg, 1.0, generator=g))
    assert min(pvals) > 1e-4, pvals


def test_biased_sampler_fails_the_same_test() -> None:
    g = torch.Generator().manual_seed(1234)
    # Negative control 1: samples from a sharpened distribution (a wrong temperature).
    pvals = _lossless_pvalues(lambda lg: sample_per_node(lg * 1.5, 1.0, generator=g))
    assert min(pvals) < 1e-4, pvals

    # Negative control 2: one shared Gumbel draw for all nodes of a request (not independent).
    def shared_noise(lg: torch.Tensor) -> torch.Tensor:
        u = torch.rand(lg.shape[0], 1, lg.shape[2], generator=g)
        return (lg - torch.log(-torch.log(u))).argmax(-1)

    pvals = _lossless_pvalues(shared_noise)
    assert min(pvals) < 1e-4, pvals


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(0.7, None, None), (1.0, 3, None), (1.3, None, 0.6), (0.9, 4, 0.7)],
)
def test_sample_filters(temperature: float, top_k, top_p) -> None:
    probs = np.array([0.35, 0.25, 0.2, 0.12, 0.08])
    logits = torch.tensor(np.log(probs), dtype=torch.float32).expand(4000, 5, -1)
    g = torch.Generator().manual_seed(7)
    s = sample_per_node(logits, temperature, top_p=top_p, top_k=top_k, generator=g).reshape(-1)
    want = probs ** (1.0 / temperature)
    want /= want.sum()
    order = np.argsort(-want)
    keep = np.ones(5, dtype=bool)
    if top_k is not None:
        keep[order[top_k:]] = False
    want = np.where(keep, want, 0.0)
    want /= want.sum()
    if top_p is not None:
        mass_before = np.cumsum(want[order]) - want[order]
        drop = order[mass_before >= top_p]
        want[drop] = 0.0
        want /= want.sum()
    counts = np.bincount(s.numpy(), minlength=5)
    assert counts[want == 0].sum() == 0
    nz = want > 0
    assert chisquare(counts[nz], want[nz] * counts.sum()).pvalue > 1e-4


def test_per_request_parameters() -> None:
    logits = torch.tensor(np.log([0.4, 0.3, 0.2, 0.1]), dtype=torch.float32).expand(2, 3000, -1)
    g = torch.Generator().manual_seed(9)
    s = sample_per_node(
        logits,
        torch.tensor([1.0, 1.0]),
        top_k=torch.tensor([1, 0]),
        top_p=torch.tensor([1.0, 1.0]),
        generator=g,
    )
    assert (s[0] == 0).all()  # top_k = 1: always the argmax
    assert len(set(s[1].tolist())) == 4  # top_k = 0: off
