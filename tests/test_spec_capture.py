"""Capture safety of treeverify.spec: no host syncs, and whole rounds replay in a CUDA graph."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch

import treeverify.spec as spec
from walk_trees import tree_and_posterior

SPEC_DIR = Path(spec.__file__).resolve().parent
# Modules that must run inside CUDA graphs (tree_oracle.py is the host test oracle).
CAPTURE_SAFE = ["tree.py", "tree_heap.py", "_chain_triton.py", "mask.py", "accept.py",
                "sglang_layout.py", "walk_cuda.py", "topk_cuda.py"]  # fmt: skip
SYNCING_METHODS = {"item", "tolist", "cpu", "numpy", "nonzero", "multinomial", "synchronize"}
SYNCING_CALLS = {
    ("torch", "tensor"),
    ("torch", "nonzero"),
    ("torch", "unique"),
    ("torch", "multinomial"),
}


@pytest.mark.parametrize("name", CAPTURE_SAFE)
def test_no_host_sync_in_source(name: str) -> None:
    tree = ast.parse((SPEC_DIR / name).read_text())
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in SYNCING_METHODS:
            bad.append(f"line {node.lineno}: .{node.attr}")
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and (node.value.id, node.attr) in SYNCING_CALLS
        ):
            bad.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in {"int", "float", "bool"}
            and node.args
            and not isinstance(node.args[0], ast.Constant)
        ):
            bad.append(f"line {node.lineno}: {node.func.id}(...) may read a tensor")
    # int()/float() of Python values (shapes, ints) are fine; list them explicitly if added.
    assert not bad, f"{name}: possible host syncs: {bad}"


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _round(logits, roots, budget, target_logits, temperature, gen):
    tree = spec.build_tree(logits, budget, roots)
    mask = spec.parents_to_tree_mask(tree.parents, max_depth=logits.shape[1])
    pos = spec.tree_positions(tree.depths, torch.zeros_like(roots))
    acc = spec.accept_sampled(
        tree.tokens,
        tree.parents,
        target_logits,
        temperature,
        top_p=0.9,
        top_k=50,
        generator=gen,
        max_depth=logits.shape[1],
    )
    greedy = spec.accept_greedy(
        tree.tokens, tree.parents, target_logits.argmax(-1), logits.shape[1]
    )
    return tree, mask, pos, acc, greedy


@needs_cuda
@pytest.mark.gpu
def test_no_sync_under_cuda_debug_mode() -> None:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    bsz, n_depth, vocab, budget = 4, 15, 32000, 64
    logits = torch.randn(bsz, n_depth, vocab, device=dev)
    roots = torch.randint(0, vocab, (bsz,), device=dev)
    target = torch.randn(bsz, budget + 1, 1000, device=dev)
    temp = torch.full((bsz,), 0.8, device=dev)
    _round(logits, roots, budget, target, temp, g)  # warm-up (lazy init may sync)
    plen = torch.randint(0, 100, (bsz,), device=dev)
    spec.to_sglang_verify(torch.full((bsz, budget + 1), -1, device=dev), plen, 100000)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tree, *_ = _round(logits, roots, budget, target, temp, g)
        lay = spec.to_sglang_verify(tree.parents, plen, (budget + 1) * (100 + budget + 1) * bsz)
        spec.from_sglang_verify(lay.custom_mask, lay.mask_indptr, plen, budget + 1)
        spec.next_token_sibling_to_parents(lay.retrieve_next_token, lay.retrieve_next_sibling)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@needs_cuda
@pytest.mark.gpu
def test_cuda_matches_host_heap_and_graph_replay() -> None:
    dev = torch.device("cuda")
    bsz, n_depth, vocab, budget = 3, 8, 500, 48
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 3, (bsz, n_depth, vocab), generator=gen).float().to(dev)
    roots = torch.arange(bsz, device=dev)
    tree = spec.build_tree(logits, budget, roots)
    host = spec.build_tree_host(logits, budget, roots)
    for f in ("tokens", "parents", "depths", "num_nodes", "scores"):
        assert torch.equal(getattr(tree, f), getattr(host, f)), f
    # Capture one round in a graph, then replay with new inputs written in place.
    target = torch.randn(bsz, budget + 1, 300, device=dev)
    temp = torch.zeros(bsz, device=dev)
    g = torch.Generator(device=dev).manual_seed(1)
    static = (logits.clone(), roots.clone(), target.clone())
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up: Triton compiles, lazy inits happen outside capture
        _round(*static[:2], budget, static[2], temp, g)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    graph.register_generator_state(g)  # a custom generator must be registered with the graph
    with torch.cuda.graph(graph):
        out = _round(*static[:2], budget, static[2], temp, g)
    for seed in range(3):
        gg = torch.Generator().manual_seed(100 + seed)
        new_logits = torch.randint(0, 4, (bsz, n_depth, vocab), generator=gg).float().to(dev)
        new_target = torch.randn(bsz, budget + 1, 300, generator=gg).to(dev)
        static[0].copy_(new_logits)
        static[2].copy_(new_target)
        graph.replay()
        want = _round(new_logits, roots, budget, new_target, temp, g)
        tree_g, mask_g, pos_g, acc_g, greedy_g = out
        tree_e, mask_e, pos_e, acc_e, greedy_e = want
        for f in ("tokens", "parents", "depths", "num_nodes", "scores"):
            assert torch.equal(getattr(tree_g, f), getattr(tree_e, f)), f
        assert torch.equal(mask_g, mask_e) and torch.equal(pos_g, pos_e)
        for f in ("path", "length", "bonus", "last"):  # temperature 0: deterministic
            assert torch.equal(getattr(acc_g, f), getattr(acc_e, f)), f
            assert torch.equal(getattr(greedy_g, f), getattr(greedy_e, f)), f


@needs_cuda
@pytest.mark.gpu
def test_triton_chain_matches_torch_and_heap() -> None:
    pytest.importorskip("triton")
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(3)
    for t in range(12):
        bsz, n_depth = 2, int(torch.randint(1, 16, (1,), generator=gen))
        vocab, budget = (
            int(torch.randint(2, 2000, (1,), generator=gen)),
            int(torch.randint(1, 300, (1,), generator=gen)),
        )
        logits = torch.randint(0, 3, (bsz, n_depth, vocab), generator=gen).float()
        if t % 2:
            logits = torch.randn(bsz, n_depth, vocab, generator=gen) * 3
        logits = logits.to(dev)
        roots = torch.zeros(bsz, dtype=torch.long, device=dev)
        a = spec.build_tree(logits, budget, roots, backend="triton")
        b = spec.build_tree(logits, budget, roots, backend="torch")
        c = spec.build_tree_host(logits, budget, roots)
        for f in ("tokens", "parents", "depths", "num_nodes", "scores"):
            assert torch.equal(getattr(a, f), getattr(b, f)), f
            assert torch.equal(getattr(a, f), getattr(c, f)), f


def _heap_tables(gen: torch.Generator, cases: list, extra: int, vocab_lo: int, budget_hi: int):
    """The heap tests' tables: `cases` (batch, depth L, vocab, budget) plus `extra` random ones
    (vocab vocab_lo..2999, budget 1..budget_hi - 1); every other case integer logits (ties),
    the rest distinct. Yields (batch, L, vocab, budget, logits, roots, lp, ids) on the GPU."""
    dev = torch.device("cuda")
    cases = list(cases)
    for _ in range(extra):
        cases.append((int(torch.randint(1, 9, (1,), generator=gen)),
                      int(torch.randint(1, 17, (1,), generator=gen)),
                      int(torch.randint(vocab_lo, 3000, (1,), generator=gen)),
                      int(torch.randint(1, budget_hi, (1,), generator=gen))))  # fmt: skip
    for i, (bsz, n_depth, vocab, budget) in enumerate(cases):
        if i % 2:
            logits = torch.randint(0, 3, (bsz, n_depth, vocab), generator=gen).float()
        else:
            logits = torch.randn(bsz, n_depth, vocab, generator=gen) * 3
        logits = logits.to(dev)  # (B, L, V)
        roots = torch.randint(0, vocab, (bsz,), generator=gen).to(dev)
        lp, ids = spec.draft_topk(logits, min(budget, vocab))
        yield bsz, n_depth, vocab, budget, logits, roots, lp, ids


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("warp", ["0", "1"], ids=["thread-heap", "warp-heap-default"])
def test_heap_kernel_matches_host_heap_and_beam(monkeypatch, warp) -> None:
    """The one-launch heap (kernels/cuda/ddtree_heap.cu) against the host heap and the beam
    search, node for node: ties (integer logits), full budgets (1024), fewer rank paths than the
    budget (padding slots), deep and shallow drafts; outputs poisoned first. Budgets <= 32 by
    thread 0's heap (TREEVERIFY_DDTREE_WARP_HEAP=0) or the warp's (the default)."""
    pytest.importorskip("cuda.bindings.driver")
    monkeypatch.setenv("TREEVERIFY_DDTREE_WARP_HEAP", warp)
    from treeverify.spec.tree_heap import build_tree_heap

    gen = torch.Generator().manual_seed(11)
    cases = [(1, 15, 8192, 16), (8, 15, 8192, 64), (3, 4, 3, 40), (2, 1, 50, 7), (4, 16, 700, 1024),
             (1, 8, 2, 1024)]  # fmt: skip
    tables = _heap_tables(gen, cases, 10, 2, 400)
    for bsz, n_depth, vocab, budget, logits, roots, lp, ids in tables:  # noqa: B007 (the last
        heap = build_tree_heap(lp, ids, budget, roots)  # case's logits are used after the loop)
        host = spec.build_tree_host_from_topk(lp, ids, budget, roots)
        beam = spec.build_tree_from_topk(lp, ids, budget, roots, backend="torch")
        masked = build_tree_heap(lp, ids, budget, roots, with_mask=True)
        for f in ("tokens", "parents", "depths", "num_nodes", "scores"):
            assert torch.equal(getattr(heap, f), getattr(host, f)), (f, bsz, n_depth, vocab, budget)
            assert torch.equal(getattr(heap, f), getattr(beam, f)), (f, bsz, n_depth, vocab, budget)
            assert torch.equal(getattr(masked, f), getattr(heap, f)), (f, "with_mask")
        # the same launch's masks: exactly the compiled ones (padding nodes: their own bit)
        assert heap.mask is None
        assert torch.equal(masked.mask, spec.parents_to_tree_mask(heap.parents)), (bsz, budget)
    # "auto" on CUDA is the heap; "heap" on CPU tensors is refused with the argument named.
    auto = spec.build_tree(logits, budget, roots)
    assert torch.equal(auto.parents, heap.parents)
    with pytest.raises(ValueError, match="lp"):
        build_tree_heap(lp.cpu(), ids.cpu(), budget, roots.cpu())


@needs_cuda
@pytest.mark.gpu
def test_warp_heap_matches_the_heap(monkeypatch) -> None:
    """TREEVERIFY_DDTREE_WARP_HEAP: budgets <= 32 popped by the whole warp, node for node the
    host heap's: distinct logits, integer logits (ties on logw, settled by the ranks tuples),
    one-token vocabularies (fewer rank paths than the budget), depth 1; budgets past 32 the
    thread-0 heap; the mask from the same launch."""
    pytest.importorskip("cuda.bindings.driver")
    from treeverify import env
    from treeverify.spec.tree_heap import build_tree_heap

    monkeypatch.setenv("TREEVERIFY_DDTREE_WARP_HEAP", "1")
    assert env.ddtree_warp_heap()  # what build_tree_heap passes the kernel
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    # (1, 200, 64, 32): L x K past the kernel's shared-memory stage (the table read in place)
    cases = [(1, 15, 8192, 16), (8, 15, 8192, 32), (3, 4, 3, 31), (2, 1, 50, 7), (1, 8, 1, 32),
             (4, 16, 700, 33), (2, 15, 2, 1), (1, 200, 64, 32)]  # fmt: skip
    for bsz, _, vocab, budget, _, roots, lp, ids in _heap_tables(gen, cases, 24, 1, 33):
        got = build_tree_heap(lp, ids, budget, roots, with_mask=True)
        host = spec.build_tree_host_from_topk(lp, ids, budget, roots)
        for f in ("tokens", "parents", "depths", "num_nodes", "scores"):
            assert torch.equal(getattr(got, f), getattr(host, f)), (f, bsz, vocab, budget, seed)
        assert torch.equal(got.mask, spec.parents_to_tree_mask(got.parents)), (budget, seed)


@needs_cuda
@pytest.mark.gpu
def test_walk_kernel_equals_walk_tree() -> None:
    """The one-launch greedy walk (kernels/cuda/ddtree_walk.cu) against the vectorized
    `walk_tree`, on DDTree trees of budgets 1..1024 whose posteriors follow the tree for a random
    number of steps (long paths, siblings, padding nodes, depth caps below the tree's depth) and
    on random posteriors; `accept_greedy` on CUDA takes the kernel."""
    pytest.importorskip("cuda.bindings.driver")
    from treeverify.spec.accept import walk_tree
    from treeverify.spec.walk_cuda import greedy_walk_cuda, usable

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    for budget in (1, 4, 16, 17, 64, 300, 1024):
        for bsz in (1, 5):
            tree, post, n_depth = tree_and_posterior(gen, budget, bsz, dev)  # walks go deep
            t = tree.tokens.shape[1]
            for cap in {n_depth, max(0, n_depth - 2), t - 1}:
                want = walk_tree(tree.tokens, tree.parents, post, cap)
                got = greedy_walk_cuda(tree.tokens, tree.parents, post, cap)
                for f in ("path", "length", "bonus", "last"):
                    assert torch.equal(getattr(got, f), getattr(want, f)), (f, budget, bsz, cap)
            assert usable(tree.tokens)
            via = spec.accept_greedy(tree.tokens, tree.parents, post, n_depth)
            assert torch.equal(via.path, walk_tree(tree.tokens, tree.parents, post, n_depth).path)


# The draft table's log-probs against the exact (fp64) log-softmax rounded to fp32: the kernel's
# fp32 log-sum-exp over up to 300000 entries is off by a few ulps of the largest logit (against
# torch's fp32 log_softmax, 2e-6 failed once at 300000 entries, 3.1e-6, on an H100).
LSE_ATOL = 4e-6


def _exact_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), -1).float()


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("warp", ["0", "1"], ids=["threshold", "warps-first"])
def test_topk_kernel_equals_log_softmax_topk(monkeypatch, warp) -> None:
    """The one-launch draft table (kernels/cuda/ddtree_topk.cu) against the exact (fp64)
    log_softmax rounded to fp32 + torch.topk: the same values (within LSE_ATOL, the kernel's fp32
    log-sum-exp) and ids on distinct logits;
    on integer logits (ties) the same values, distinct ids naming entries of those values, the
    smaller id first within a tie; `draft_topk` on CUDA takes it for k <= MAX_K. By threshold
    selection (k block-wide rounds where it cannot: a NaN, an overflowing gathering), or
    (TREEVERIFY_DDTREE_WARP_TOPK=1, vocabularies <= 8192) by warps first."""
    pytest.importorskip("cuda.bindings.driver")
    monkeypatch.setenv("TREEVERIFY_DDTREE_WARP_TOPK", warp)
    from treeverify.spec.topk_cuda import MAX_K, draft_topk_cuda
    from treeverify.spec.tree import LOGPROB_FLOOR

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    # rows read in 4-entry pieces (V a multiple of 4) or single entries (8191, 50001, 8193),
    # up to 8192 entries (32 a thread at most: the gathering's bound) and past it
    cases = ((1, 15, 8192, 16), (3, 4, 50, 32), (2, 1, 2, 2), (1, 7, 50000, 8), (4, 15, 8192, 1),
             (2, 3, 8191, 32), (1, 2, 8193, 16), (2, 3, 128256, 16), (1, 3, 50001, 16))  # fmt: skip
    for bsz, n_depth, vocab, k in cases:
        for ties in (False, True):
            if ties:
                logits = torch.randint(0, 4, (bsz, n_depth, vocab), generator=gen).float()
            else:
                logits = torch.randn(bsz, n_depth, vocab, generator=gen) * 4
            logits = logits.to(dev)
            lp, ids = draft_topk_cuda(logits, k, LOGPROB_FLOOR)
            full = _exact_log_softmax(logits)
            want_lp, want_ids = torch.topk(full, k, dim=-1)
            torch.testing.assert_close(lp, want_lp.clamp(max=0.0), rtol=0, atol=LSE_ATOL)
            torch.testing.assert_close(full.gather(-1, ids), want_lp, rtol=0, atol=LSE_ATOL)
            if not ties:
                assert torch.equal(ids, want_ids), (bsz, n_depth, vocab, k)
            else:
                assert (ids.sort(-1).values.diff(dim=-1) > 0).all()  # distinct ids
                same = lp[..., 1:] == lp[..., :-1]  # within a tie: ascending ids
                assert (ids[..., 1:] > ids[..., :-1])[same].all()
    via = spec.draft_topk(logits, MAX_K)
    assert torch.equal(via[1], draft_topk_cuda(logits, MAX_K, LOGPROB_FLOOR)[1])
    # bf16 logits (the DFlash drafter's own, on CUDA) are read as they are: the same table as
    # their fp32 upcast, bit for bit (the same pieces, the same sums in the same order)
    for bsz, n_depth, vocab, k in ((2, 15, 8192, 16), (1, 3, 50000, 32), (3, 2, 100, 5)):
        b16 = (torch.randn(bsz, n_depth, vocab, generator=gen) * 4).to(dev, torch.bfloat16)
        lp, ids = draft_topk_cuda(b16, k, LOGPROB_FLOOR)
        want_lp, want_ids = draft_topk_cuda(b16.float(), k, LOGPROB_FLOOR)
        assert torch.equal(lp, want_lp) and torch.equal(ids, want_ids), (bsz, n_depth, vocab, k)
    # The kernel selects by rank among the entries at or after the k-th best of its 256
    # threads' best entries: one thread holding all the winners (thread 0's 4-entry pieces
    # raised, 32 entries: the candidate bound, k x 32) and masked (-inf) vocabularies; a row
    # holding a NaN takes the k rounds (no order) and leaves its neighbours' rows exact.
    for k in (1, 16, MAX_K):
        logits = torch.randn(2, 3, 8192, generator=gen) * 4
        logits[0, :, (torch.arange(8192) // 4) % 256 == 0] += 100.0
        logits[1, :, 4096:] = float("-inf")
        logits[1, 2, : 4096 - 16] = float("-inf")  # 16 finite entries left (k up to 32)
        logits[0, 1, 77] = float("nan")
        logits = logits.to(dev)
        lp, ids = draft_topk_cuda(logits, k, LOGPROB_FLOOR)
        want_lp, want_ids = torch.topk(_exact_log_softmax(logits), k, dim=-1)
        for b, d in [(0, 0), (0, 2), (1, 0), (1, 1), (1, 2)]:
            torch.testing.assert_close(lp[b, d], want_lp[b, d].clamp(LOGPROB_FLOOR, 0.0),
                                       rtol=0, atol=LSE_ATOL)  # fmt: skip
            finite = want_lp[b, d] > float("-inf")
            assert torch.equal(ids[b, d][finite], want_ids[b, d][finite]), (k, b, d)
        assert ((ids[0, 1] >= 0) & (ids[0, 1] < 8192)).all()  # the NaN row: ids in range
    # Past 8192 a thread reads 4-entry pieces c = t, t + 256, ...: raising every entry of
    # thread 0's pieces ((i // 4) % 256 == 0) puts all the winners in one thread, ~196 of 50000
    # (gathered with the other threads' bests) and ~1172 of 300000, more than the gathering
    # holds (1024): that row takes the k rounds. A NaN past 8192 takes them too.
    for vocab in (50000, 300000):
        logits = torch.randn(2, 2, vocab, generator=gen) * 4
        logits[0, 0, (torch.arange(vocab) // 4) % 256 == 0] += 100.0
        logits[1, 1, 4321] = float("nan")
        logits = logits.to(dev)
        for k in (1, 16, MAX_K):
            lp, ids = draft_topk_cuda(logits, k, LOGPROB_FLOOR)
            want_lp, want_ids = torch.topk(_exact_log_softmax(logits), k, dim=-1)
            for b, d in [(0, 0), (0, 1), (1, 0)]:
                torch.testing.assert_close(lp[b, d], want_lp[b, d].clamp(LOGPROB_FLOOR, 0.0),
                                           rtol=0, atol=LSE_ATOL)  # fmt: skip
                assert torch.equal(ids[b, d], want_ids[b, d]), (vocab, k, b, d)
            assert ((ids[1, 1] >= 0) & (ids[1, 1] < vocab)).all()  # the NaN row: ids in range
    # small vocabularies at every k the budgets use, one that is not a multiple of 4 (single
    # entries), and k == V
    for vocab, k in ((8192, 4), (8192, 8), (8192, 12), (300, 13), (301, 8), (2048, 32)):
        logits = (torch.randn(2, 3, vocab, generator=gen) * 4).to(dev)
        lp, ids = draft_topk_cuda(logits, k, LOGPROB_FLOOR)
        want_lp, want_ids = torch.topk(_exact_log_softmax(logits), k, dim=-1)
        torch.testing.assert_close(lp, want_lp.clamp(LOGPROB_FLOOR, 0.0), rtol=0, atol=LSE_ATOL)
        assert torch.equal(ids, want_ids), (vocab, k)
    for vocab in (13, 16, 32):
        logits = (torch.randn(2, 3, vocab, generator=gen) * 4).to(dev)
        lp, ids = draft_topk_cuda(logits, vocab, LOGPROB_FLOOR)
        want_lp, want_ids = torch.topk(_exact_log_softmax(logits), vocab, dim=-1)
        torch.testing.assert_close(lp, want_lp.clamp(LOGPROB_FLOOR, 0.0), rtol=0, atol=LSE_ATOL)
        assert torch.equal(ids, want_ids), vocab
