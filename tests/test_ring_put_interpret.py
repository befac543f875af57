"""engine/ring_put.py's kernel on the CPU interpreter (TRITON_INTERPRET=1): a step graph that
writes its tapped rows into the DFlash context's feed ring itself (TREEVERIFY_RING_IN_GRAPH)
must leave the ring, its head and the context's rows as the copy after each replay leaves them.
The device head follows the host's lap rule with no readback; the context takes each write's
ids before the write (`ring_reserve`), so the spills and projections that make room come
first. tests/test_decode_ahead_gpu.py runs it compiled, inside the step graphs."""

from __future__ import annotations

import random

import pytest
import torch

from triton_interpreter import cache_cleared, interpret_on_cpu

interpret_on_cpu("tests/test_decode_ahead_gpu.py")

from treeverify.engine import ring_put as ring_put_module  # noqa: E402
from treeverify.engine.draft_context import DraftContextCache  # noqa: E402
from treeverify.engine.feed_ring import FeedRing  # noqa: E402
from treeverify.engine.ring_put import ring_put  # noqa: E402

interpreted_kernels = cache_cleared(ring_put_module._kernels)


@pytest.mark.parametrize("block", [1024, 8, 4], ids=["one-program", "programs-8", "programs-4"])
def test_device_head_and_rows_follow_the_hosts_lap_rule(block):
    """Writes of 1..rows rows (some cross the ring's end and start at the next lap): the rows
    land where the copy puts them, the other rows keep what they held, and the device head equals
    the host's after every write; `block`: values a program copies (8 or 4 of a write's up to 55:
    several programs, all reading the head before the second kernel moves it)."""
    rows, feats = 11, 5
    g = torch.Generator().manual_seed(3)
    copied, graphed = (FeedRing(rows, feats, torch.float32, torch.device("cpu")) for _ in "ab")
    poison = torch.randn(rows, feats, generator=g)  # the same untouched rows in both
    copied.buf.copy_(poison)
    graphed.buf.copy_(poison)
    head = graphed.written_by_graphs()
    lapped = 0
    for n in [3, 4, 4, 2, 1, 7, 11, 5, 5, 5, 9, 1, 6, 6, 2, 10]:  # 3 + 4 + 4: an exact fit
        hidden = torch.randn(n, feats, generator=g)
        lapped += copied.start_of(n) != copied.head
        want = copied.write(hidden)
        got = graphed.advance(n)  # the host's ids, taken before the "replay"
        ring_put(hidden, graphed.buf, head, block=block)
        assert got == want and int(head) == graphed.head == copied.head
        assert torch.equal(graphed.buf, copied.buf)
    assert lapped >= 3
    with pytest.raises(RuntimeError, match="step graphs write this ring"):
        graphed.write(torch.randn(1, feats))


def test_graphs_captured_zeroes_the_rows_and_puts_the_device_head_back():
    ring = FeedRing(8, 3, torch.float32, torch.device("cpu"))
    head = ring.written_by_graphs()
    ring_put(torch.randn(4, 3), ring.buf, head)  # a capture's warm-up: no id names these rows
    assert int(head) == 4 and ring.head == 0
    ring.graphs_captured()
    assert int(head) == 0 and bool((ring.buf == 0).all())


def test_shapes_are_checked_by_name():
    ring = FeedRing(4, 3, torch.float32, torch.device("cpu"))
    head = ring.written_by_graphs()
    with pytest.raises(ValueError, match="hidden \\(2, 5\\), buf \\(4, 3\\)"):
        ring_put(torch.zeros(2, 5), ring.buf, head)
    with pytest.raises(ValueError, match="5 rows, the ring holds 4"):
        ring_put(torch.zeros(5, 3), ring.buf, head)
    with pytest.raises(ValueError, match="one dtype and contiguous"):
        ring_put(torch.zeros(3, 2).t(), ring.buf, head)
    with pytest.raises(ValueError, match="head \\(1,\\) torch.int32"):
        ring_put(torch.zeros(2, 3), ring.buf, torch.zeros(1, dtype=torch.int32))


def test_graphs_write_the_ring_only_with_the_switch_and_triton(monkeypatch):
    """Without Triton (an optional extra) the step graphs keep the copy, as every Triton kernel
    here keeps its PyTorch path: a review found the engine refusing to start there."""
    import sys

    from treeverify.engine import ring_put as module
    from treeverify.engine.ring_put import graphs_write_ring

    monkeypatch.delenv("TREEVERIFY_RING_IN_GRAPH", raising=False)
    assert graphs_write_ring()  # the default, Triton here
    monkeypatch.setenv("TREEVERIFY_RING_IN_GRAPH", "0")
    assert not graphs_write_ring()
    monkeypatch.setenv("TREEVERIFY_RING_IN_GRAPH", "1")
    monkeypatch.setitem(sys.modules, "triton", None)  # as where it is not installed
    module.triton_available.cache_clear()  # (cached: asked once a process)
    try:
        assert not graphs_write_ring()
    finally:
        module.triton_available.cache_clear()


@pytest.fixture(scope="module")
def drafter():
    from treeverify.models.tiny import build_tiny
    from treeverify.spec.dflash_io import tiny_dflash

    cfg, model, _ = build_tiny("tiny-llama", seed=0)
    return tiny_dflash(cfg, seed=1, target_embed=model.model.embed_tokens,
                       target_lm_head=model.lm_head).eval()  # fmt: skip


@pytest.mark.parametrize("lazy", [False, True], ids=["eager-flush", "lazy"])
def test_rows_written_by_the_graph_give_the_context_the_copys_rows(drafter, lazy):
    """Two contexts fed the same random history (tests/test_feed_ring.py's: prompts, plain
    steps with padding rows, rejections, reads; batch flushes at 3 x 8 rows, a small ring that
    laps and spills): one each step's rows by `ring_write` (the copy), one by `ring_reserve`
    then ring_put (the graph's kernel). After every read their keys/values are equal; at the end
    the rings hold the same rows and the device head is the host's."""
    from test_draft_context import _BucketedProjection
    from test_feed_ring import _steps

    seed = random.randrange(2**32)
    feats, window = drafter.config.context_features, 48
    copied, graphed = DraftContextCache(drafter, window), DraftContextCache(drafter, window)
    for c in (copied, graphed):
        c._captured = _BucketedProjection(drafter, [8])
        c.enable_ring(6)
        c.lazy = lazy
    ring = graphed.ring_for_graphs(feats, torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        for kind, items, rows in _steps(seed, feats):
            if kind == "chunk":
                ((rid, start),) = items
                for c in (copied, graphed):
                    c.observe(rid, start, rows)
            elif kind == "step":
                want = copied.ring_write(rows)
                got = graphed.ring_reserve(rows.shape[0])
                ring_put(rows, ring.buf, ring.device_head, block=256)
                assert got == want, seed
                for c in (copied, graphed):
                    c.observe_ring([(rid, s, got + i) for i, (rid, s) in enumerate(items)])
            else:
                for rid in items:
                    kv, first = graphed.keys_values(rid)
                    kv2, first2 = copied.keys_values(rid)
                    assert first == first2, seed
                    torch.testing.assert_close(kv, kv2, rtol=0, atol=0, msg=f"seed {seed}")
    assert ring.head > 2 * ring.rows, "the ring must have lapped"
    assert int(ring.device_head) == ring.head == copied._ring.head
    assert torch.equal(ring.buf, copied._ring.buf)
    assert graphed.ring_spills == copied.ring_spills
