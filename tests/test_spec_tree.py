"""build_tree (batched, capture-safe) == build_tree_host (the heap), node for node, in fp32."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treeverify.spec import (
    DraftTree,
    build_tree,
    build_tree_from_topk,
    build_tree_host,
    build_tree_host_from_topk,
    draft_topk,
)

FIELDS = ("tokens", "parents", "depths", "num_nodes", "scores")


def assert_same_tree(got: DraftTree, want: DraftTree, msg: str = "") -> None:
    for f in FIELDS:
        a, b = getattr(got, f), getattr(want, f)
        assert a.dtype == b.dtype, (f, a.dtype, b.dtype, msg)
        assert torch.equal(a, b), f"{f} differs {msg}\n got {a}\nwant {b}"


def make_logits(kind: str, shape: tuple[int, int, int], g: torch.Generator) -> torch.Tensor:
    if kind == "int3":  # many exactly tied log-probs
        return torch.randint(0, 3, shape, generator=g).float()
    if kind == "int2x50":  # ties plus near-deterministic positions (lp[0] == 0 exactly)
        return torch.randint(0, 2, shape, generator=g).float() * 50
    if kind == "normal":
        return torch.randn(shape, generator=g) * 3
    if kind == "masked":  # -inf logits: clamped log-probs, paths of "impossible" tokens
        x = torch.randn(shape, generator=g)
        x[torch.rand(shape, generator=g) < 0.5] = float("-inf")
        x[..., 0] = 0.0
        return x
    raise AssertionError(kind)


def _cases(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    kinds = ["int3", "int2x50", "normal", "masked"]
    for t in range(n):
        bsz = int(torch.randint(1, 4, (1,), generator=g))
        n_depth = int(torch.randint(1, 17, (1,), generator=g))
        vocab = int(torch.randint(1, 60, (1,), generator=g))
        budget = int(torch.randint(1, 301, (1,), generator=g))
        yield kinds[t % len(kinds)], bsz, n_depth, vocab, budget, g


@pytest.mark.parametrize("seed", [0, 1])
def test_matches_heap_random(seed: int) -> None:
    for kind, bsz, n_depth, vocab, budget, g in _cases(40, seed):
        logits = make_logits(kind, (bsz, n_depth, vocab), g)
        roots = torch.randint(0, vocab, (bsz,), generator=g)
        msg = f"kind={kind} B={bsz} L={n_depth} V={vocab} budget={budget}"
        assert_same_tree(
            build_tree(logits, budget, roots), build_tree_host(logits, budget, roots), msg
        )


def test_matches_heap_large_vocab() -> None:
    g = torch.Generator().manual_seed(2)
    for n_depth, vocab, budget, kind in [
        (15, 5000, 300, "normal"),
        (4, 3000, 257, "int3"),
        (1, 4096, 200, "int3"),
    ]:
        logits = make_logits(kind, (2, n_depth, vocab), g)
        roots = torch.tensor([7, 11])
        assert_same_tree(build_tree(logits, budget, roots), build_tree_host(logits, budget, roots))


def _tie_tables(mode: int, shape: tuple[int, int, int], g: torch.Generator) -> torch.Tensor:
    """Adversarial log-prob tables (sorted, <= 0) fed straight to the tree search."""
    if mode == 0:  # multiples of log 2: sums of different paths tie exactly
        vals = -torch.randint(0, 6, shape, generator=g).float() * math.log(2)
    elif mode == 1:  # few distinct values per depth, random scale
        vals = (
            -torch.randint(0, 4, shape, generator=g).float()
            * torch.rand(*shape[:2], 1, generator=g)
            * 3
        )
    elif mode == 2:  # tiny log-probs: adding them often does not change the sum at all
        vals = -torch.rand(shape, generator=g) * 1e-6
    elif mode == 3:  # zeros: children tie with their parents
        vals = -torch.randint(0, 2, shape, generator=g).float() * 0.5
    else:  # floor values (masked tokens)
        vals = -torch.rand(shape, generator=g) * 5
        vals[vals < -4] = -1e30
    return vals.sort(dim=-1, descending=True).values


def test_matches_heap_adversarial_ties() -> None:
    g = torch.Generator().manual_seed(3)
    for t in range(60):
        mode = t % 5
        n_depth = int(torch.randint(1, 10, (1,), generator=g))
        k = int(torch.randint(1, 30, (1,), generator=g))
        budget = k if t % 2 else int(torch.randint(k, 150, (1,), generator=g))
        lp = _tie_tables(mode, (2, n_depth, k), g)
        ids = torch.randint(0, 1000, (2, n_depth, k), generator=g)
        roots = torch.tensor([1, 2])
        got = build_tree_from_topk(lp, ids, budget, roots)
        want = build_tree_host_from_topk(lp, ids, budget, roots)
        assert_same_tree(got, want, f"mode={mode} L={n_depth} K={k} budget={budget}")


def test_sibling_never_outscores_elder_sibling() -> None:
    """The fp32 lemma behind the batched search: fl(fl(s - a) + b) <= s when s = fl(u + a),
    b <= a <= 0, u <= 0, checked on many random and exactly tied values."""
    rng = np.random.default_rng(0)
    n = 200_000
    a = -rng.uniform(0, 8, n).astype(np.float32)
    a[: n // 2] = -(rng.integers(1, 200, n // 2) * np.float32(2.0**-7)).astype(np.float32)
    u = -rng.uniform(0, 80, n).astype(np.float32)
    b = (a - rng.uniform(0, 1e-5, n).astype(np.float32) * (rng.random(n) < 0.5)).astype(np.float32)
    s = (u + a).astype(np.float32)
    t = (s - a).astype(np.float32)
    assert np.array_equal((t + a).astype(np.float32), s)
    assert np.all((t + b).astype(np.float32) <= s)


def test_budget_larger_than_all_paths() -> None:
    # V=2, L=3: 2 + 4 + 8 = 14 rank paths, budget 50.
    logits = torch.randn(2, 3, 2, generator=torch.Generator().manual_seed(4))
    roots = torch.tensor([5, 6])
    tree = build_tree(logits, 50, roots)
    assert_same_tree(tree, build_tree_host(logits, 50, roots))
    assert tree.num_nodes.tolist() == [15, 15]
    assert tree.tokens.shape == (2, 51)
    assert (tree.parents[:, 15:] == -1).all() and (tree.tokens[:, 15:] == 0).all()
    assert (tree.depths[:, 15:] == 0).all() and torch.isinf(tree.scores[:, 15:]).all()
    # V=1: a single chain of L nodes.
    one = build_tree(torch.zeros(1, 4, 1), 10, torch.tensor([3]))
    assert one.num_nodes.tolist() == [5]
    assert one.parents[0, :5].tolist() == [-1, 0, 1, 2, 3]


def test_root_and_shapes() -> None:
    logits = torch.randn(3, 5, 20, generator=torch.Generator().manual_seed(5))
    roots = torch.tensor([9, 8, 7])
    tree = build_tree(logits, 16, roots)
    for f in ("tokens", "parents", "depths"):
        assert getattr(tree, f).shape == (3, 17) and getattr(tree, f).dtype == torch.int64
    assert tree.num_nodes.dtype == torch.int64 and tree.scores.dtype == torch.float32
    assert tree.tokens[:, 0].tolist() == [9, 8, 7]
    assert (tree.parents[:, 0] == -1).all() and (tree.depths[:, 0] == 0).all()
    assert (tree.num_nodes == 17).all()


def test_l1_is_topk() -> None:
    logits = torch.randn(2, 1, 50, generator=torch.Generator().manual_seed(6))
    tree = build_tree(logits, 10, torch.tensor([0, 0]))
    lp, ids = draft_topk(logits, 10)
    assert torch.equal(tree.tokens[:, 1:], ids[:, 0])
    assert (tree.parents[:, 1:] == 0).all() and (tree.depths[:, 1:] == 1).all()


def test_bad_budget() -> None:
    with pytest.raises(ValueError, match="budget"):
        build_tree(torch.zeros(1, 2, 3), 0, torch.tensor([0]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_depth=st.integers(1, 8),
    vocab=st.integers(1, 12),
    budget=st.integers(1, 80),
    levels=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
)
def test_tree_properties(n_depth: int, vocab: int, budget: int, levels: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (2, n_depth, vocab), generator=g).float()
    roots = torch.tensor([0, 1])
    tree = build_tree(logits, budget, roots)
    assert_same_tree(tree, build_tree_host(logits, budget, roots))
    lp, ids = draft_topk(logits, min(budget, vocab))
    for b in range(2):
        n = int(tree.num_nodes[b])
        paths = sum(min(budget, vocab) ** d for d in range(1, n_depth + 1))
        assert n == 1 + min(budget, paths)
        par = tree.parents[b, :n]
        dep = tree.depths[b, :n]
        sc = tree.scores[b, :n]
        for i in range(1, n):
            p = int(par[i])
            assert 0 <= p < i  # topological
            assert int(dep[i]) == int(dep[p]) + 1
            assert float(sc[i]) <= float(sc[p])
        assert bool((sc[1:][1:] <= sc[1:][:-1]).all())  # pop order never increases
        # Siblings have distinct tokens, each a top-K draft token of its depth.
        for i in range(1, n):
            assert int(tree.tokens[b, i]) in ids[b, int(dep[i]) - 1].tolist()
        seen = {(int(par[i]), int(tree.tokens[b, i])) for i in range(1, n)}
        assert len(seen) == n - 1


def test_triton_chain_in_interpreter() -> None:
    """The Triton sibling-chain kernel, run by Triton's CPU interpreter (no GPU needed).

    Where CUDA exists the compiled kernel is tested instead (test_spec_capture.py); Triton 3.6's
    interpreter also cannot run its ``range(1, K, 4)`` loop (3.9's can)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the compiled kernel is tested in test_spec_capture.py")
    code = (
        "import torch\n"
        "from treeverify.spec.tree import sibling_chain\n"
        "from treeverify.spec._chain_triton import sibling_chain_triton\n"
        "g = torch.Generator().manual_seed(0)\n"
        "for w, k in [(1, 1), (3, 40), (130, 17), (257, 5)]:\n"
        "    prev = -torch.rand(2, w, generator=g) * 50\n"
        "    a = -torch.randint(0, 5, (2, k), generator=g).float() * 0.6931\n"
        "    a = a.sort(-1, descending=True).values\n"
        "    assert torch.equal(sibling_chain(prev, a), sibling_chain_triton(prev, a)), (w, k)\n"
        "print('ok')\n"
    )
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": src}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
