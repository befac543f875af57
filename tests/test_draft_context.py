"""DraftContextCache (CPU, fp32, the seeded tiny DFlash drafter on tiny-llama): the keys/values it
holds in its rings equal the drafter's own `context_kv` of the rows observed, through chunks,
rejections, restarts, the pending-list bound and rings wrapping past the window; a draft from
the rings equals the stateless `propose` over the same context; a fixed store lends the ring of
the least recently used request when it runs out."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from treeverify.engine.draft_context import DraftContextCache
from treeverify.models.tiny import build_tiny
from treeverify.spec.dflash_io import tiny_dflash


@pytest.fixture(scope="module")
def drafter():
    cfg, model, _ = build_tiny("tiny-llama", seed=0)
    return tiny_dflash(cfg, seed=1, target_embed=model.model.embed_tokens,
                       target_lm_head=model.lm_head).eval()  # fmt: skip


def _expected(drafter, rows: torch.Tensor, window: int) -> tuple[torch.Tensor, int]:
    """context_kv of the last `window` of `rows` (positions 0..), and the first position."""
    first = max(0, rows.shape[0] - window)
    with torch.inference_mode():
        pos = torch.arange(first, rows.shape[0], device=rows.device)
        kv = drafter.context_kv(rows[first:], pos)
    return kv, first


@pytest.mark.parametrize(
    "captured",
    [
        False,
        pytest.param(
            True,
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
            ],
        ),
    ],
)
def test_random_chunks_rejections_and_restarts_match_from_scratch(drafter, captured):
    """A random history of chunk appends, rejections (a chunk starting before the end) and
    restarts from 0, read at random moments; a small window forces compaction and skipping.
    `captured`: on a GPU, the projection replayed from CUDA graphs per row bucket (chunks past
    the largest bucket run eagerly)."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    window = rng.choice([7, 16, 40])
    dev = torch.device("cuda" if captured else "cpu")
    if captured:
        drafter = copy.deepcopy(drafter).to(dev)
    cache = DraftContextCache(drafter, window)
    if captured:
        cache.capture_projection(dev, max_rows=24)  # buckets 16 .. 256 (MIN_FLUSH_ROWS)
    feats = drafter.config.context_features
    truth = torch.empty(0, feats, device=dev)  # the rows the target holds now, positions 0..
    with torch.inference_mode():
        for _ in range(120):
            end = truth.shape[0]
            start = rng.choice([end] * 6 + [max(0, end - rng.randint(1, 4))] + [0])
            n = rng.choice([1, 1, 1, 2, 3, 5, rng.randint(1, 3 * window)])
            new = torch.randn(n, feats, generator=gen).to(dev)
            cache.observe("r", start, new)
            truth = torch.cat([truth[:start], new])
            assert cache.end("r") == truth.shape[0], seed
            if rng.random() < 0.3:
                kv, first = cache.keys_values("r")
                want, want_first = _expected(drafter, truth, window)
                assert first == want_first, seed
                torch.testing.assert_close(kv, want, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")
    # one ring of window + SLACK rows holds it all: bounded by the window, not by the history
    assert cache.kv.shape[1] == window + DraftContextCache.SLACK and cache.slots <= 4


def test_pending_chunks_are_bounded(drafter):
    cache = DraftContextCache(drafter, 1024)
    feats = drafter.config.context_features
    with torch.inference_mode():
        for i in range(DraftContextCache.MAX_PENDING):
            cache.observe("r", i, torch.randn(1, feats))
    ctx = cache._ctx["r"]
    assert not ctx.pending and ctx.count == DraftContextCache.MAX_PENDING  # projected at the bound


def test_a_rejection_leaves_the_kept_rows_one_chunk(drafter):
    """Uncaptured (the CPU), pending rows flush by chunk count: the rows a rejection keeps are
    joined into one chunk, so 40 one-row chunks, a one-row rejection and 30 more leave 31 chunks
    pending and nothing projected (keeping each piece reached MAX_PENDING 26 chunks early)."""
    cache = DraftContextCache(drafter, 1024)
    g = torch.Generator().manual_seed(0)
    feats = drafter.config.context_features
    with torch.inference_mode():
        for pos in range(40):
            cache.observe("r", pos, torch.randn(1, feats, generator=g))
        for pos in range(39, 69):  # the first rejects position 39
            cache.observe("r", pos, torch.randn(1, feats, generator=g))
    ctx = cache._ctx["r"]
    assert (len(ctx.pending), ctx.pending_rows, ctx.end) == (31, 69, 0)


class _BucketedProjection:
    """Stands in for the captured projection (a CapturedFn of context_kv by row bucket, GPU
    only): eager, but it records the row counts asked and refuses any past its largest bucket."""

    def __init__(self, drafter, batch_sizes):
        self.drafter, self.batch_sizes, self.calls = drafter, batch_sizes, []

    def __call__(self, feats, pos):
        self.calls.append(feats.shape[0])
        assert feats.shape[0] <= self.batch_sizes[-1], feats.shape
        return (self.drafter.context_kv(feats, pos),)


def test_captured_projections_flush_at_the_largest_bucket_and_chunk_a_prefill(drafter):
    """With a captured projection, a request's pending rows are projected as soon as they fill
    the largest bucket (plain steps never fall back to an eager projection), a longer run (a
    prefill) in pieces of it, a run past CHUNKED_REPLAYS pieces in one eager call; the rings hold
    what one eager projection gives."""
    feats = drafter.config.context_features
    g = torch.Generator().manual_seed(3)
    truth = torch.randn(45, feats, generator=g)  # (45, F): a 21-row prefill, then 24 decodes
    caches = {}
    for name in ("eager", "bucketed"):
        cache = DraftContextCache(drafter, 1024)
        if name == "bucketed":
            cache._captured = _BucketedProjection(drafter, [4, 8])
        with torch.inference_mode():
            cache.observe("r", 0, truth[:21])
            for i in range(21, 45):
                cache.observe("r", i, truth[i : i + 1])
                if name == "bucketed":
                    assert cache._ctx["r"].pending_rows < 8  # flushed at the bucket
            cache.project(["r"])
        caches[name] = cache
    bucketed = caches["bucketed"]
    assert bucketed._captured.calls[:3] == [8, 8, 5]  # the prefill in pieces
    kv, first = bucketed.keys_values("r")
    want, want_first = caches["eager"].keys_values("r")
    assert first == want_first == 0
    torch.testing.assert_close(kv, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv, _expected(drafter, truth, 1024)[0], rtol=1e-5, atol=1e-5)
    calls = len(bucketed._captured.calls)
    long = torch.randn(40, feats, generator=g)  # past CHUNKED_REPLAYS x 8 rows: one eager call
    with torch.inference_mode():
        bucketed.observe("s", 0, long)
    assert len(bucketed._captured.calls) == calls and not bucketed._ctx["s"].pending
    kv, _ = bucketed.keys_values("s")
    torch.testing.assert_close(kv, _expected(drafter, long, 1024)[0], rtol=1e-5, atol=1e-5)


def test_errors_name_the_request_and_positions(drafter):
    cache = DraftContextCache(drafter, 16)
    feats = drafter.config.context_features
    cache.observe("r", 0, torch.randn(3, feats))
    with pytest.raises(RuntimeError, match="r: 3 rows, chunk starts at 9"):
        cache.observe("r", 9, torch.randn(1, feats))
    with pytest.raises(ValueError, match="window"):
        DraftContextCache(drafter, 0)
    cache.forget("r")
    assert "r" not in cache and cache.keys_values("r") is None


def test_batched_draft_from_cache_equals_stateless_propose(drafter):
    """Several requests, contexts of different lengths (some past the window): DFlashSource's
    draft equals `propose` on each one's last `window` hidden rows at their positions."""
    from types import SimpleNamespace

    from treeverify.engine.drafters import DFlashSource

    seed = random.randrange(2**32)
    gen = torch.Generator().manual_seed(seed)
    window = 24
    src = DFlashSource(drafter, window=window)
    feats = drafter.config.context_features
    lens = [5, 24, 31, 60]
    rows = [torch.randn(n, feats, generator=gen) for n in lens]
    seqs = []
    for i, r in enumerate(rows):
        for s in range(0, r.shape[0], 9):  # observed in chunks of 9
            src.observe(f"q{i}", s, r[s : s + 9])
        root = int(torch.randint(0, 256, (1,), generator=gen))
        seqs.append(SimpleNamespace(request_id=f"q{i}", num_cached_tokens=r.shape[0],
                                    last_token_id=root))  # fmt: skip
    got = src.propose_batch(seqs, 5, torch.device("cpu"))  # (B, 5, V)
    with torch.inference_mode():
        for b, (r, s) in enumerate(zip(rows, seqs, strict=True)):
            c = min(window, r.shape[0])
            want = drafter.propose(r[-c:][None], torch.tensor([c]), torch.tensor([s.last_token_id]),
                                   5, context_start=torch.tensor([r.shape[0] - c]))  # fmt: skip
            torch.testing.assert_close(got[b], want[0], rtol=1e-4, atol=1e-4, msg=f"seed {seed}")
    bad = SimpleNamespace(request_id="q0", num_cached_tokens=6, last_token_id=1)
    with pytest.raises(RuntimeError, match="q0: rows end at position 5, the cache holds 6"):
        src.propose_batch([bad], 5, torch.device("cpu"))


def test_ring_valid_keeps_the_newest_rows_in_any_order():
    from treeverify.spec.dflash import ring_valid

    w = 8
    # not wrapped (end 5, 5 rows): rows 0..4; wrapped (end 19 -> rows 19 % 8 = 3 newest):
    # the newest 6 positions 13..18 sit in rows 5, 6, 7, 0, 1, 2; nothing held: no row.
    got = ring_valid(torch.tensor([5, 6, 0]), torch.tensor([5, 19, 7]), w, w)
    assert got.int().tolist() == [
        [1, 1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0, 1, 1, 1],
        [0] * 8,
    ]


def test_fixed_store_lends_the_least_recent_ring(drafter):
    cache = DraftContextCache(drafter, 16)
    cache.fix(2, torch.device("cpu"))
    feats = drafter.config.context_features
    with torch.inference_mode():
        for rid in ("a", "b"):
            cache.observe(rid, 0, torch.randn(5, feats))
            cache.project([rid])
        cache.observe("a", 5, torch.randn(1, feats))  # "a" used last: "b" is the oldest
        cache.observe("c", 0, torch.randn(3, feats))
        cache.project(["c"])
    assert cache.evictions == 1 and cache.ring("b") is None  # "b" lost its rows
    assert cache.ring("a")[1:] == (6, 6) and cache.ring("c")[1:] == (3, 3)
    with torch.inference_mode():  # an evicted request starts over wherever its next chunk is
        cache.observe("b", 40, torch.randn(2, feats))
    assert cache.end("b") == 42
    with pytest.raises(RuntimeError, match="fix before serving"):
        cache.fix(4, torch.device("cpu"))


def test_pending_rows_flush_across_requests_below_chunked_replays_buckets(drafter):
    """A batch's plain steps each leave one row per request pending: a request's rows are
    projected once they fill the largest bucket, and every request's once the rows pending
    across requests fill CHUNKED_REPLAYS - 1 buckets (per request alone, a batch of 64 at a
    1024-row bucket held ~1000 steps' copies of its hidden states); the rings hold what one
    eager projection per request gives, and forgetting a request takes its pending rows out
    of the count."""
    feats = drafter.config.context_features
    g = torch.Generator().manual_seed(5)
    bound = (DraftContextCache.CHUNKED_REPLAYS - 1) * 8
    n, steps = 6, 7  # 42 rows: past the bound across requests, never 8 in one request
    truth = {f"r{i}": torch.randn(steps, feats, generator=g) for i in range(n)}
    cache = DraftContextCache(drafter, 1024)
    cache._captured = _BucketedProjection(drafter, [4, 8])
    with torch.inference_mode():
        for t in range(steps):
            for rid, rows in truth.items():
                cache.observe(rid, t, rows[t : t + 1])
                assert cache._pending_total < bound
                assert cache._pending_total == sum(c.pending_rows for c in cache._ctx.values())
        calls = cache._captured.calls
        assert calls and all(c <= 8 for c in calls)  # replays of the bucket, not eager
        assert sum(calls) == bound  # the batch's rows once: every request's together
        cache.observe("gone", 0, torch.randn(2, feats, generator=g))
        cache.forget("gone")
        assert cache._pending_total == sum(c.pending_rows for c in cache._ctx.values())
        for rid, rows in truth.items():
            kv, first = cache.keys_values(rid)
            assert first == 0
            torch.testing.assert_close(kv, _expected(drafter, rows, 1024)[0], rtol=1e-5, atol=1e-5)


def test_a_batch_flush_never_takes_a_ring_nor_projects_eagerly(drafter):
    """The batch's flush (rows pending across requests) projects only requests that hold a ring
    on a fixed store: preempted requests keep contexts with pending rows, and lending them rings
    evicted a running request (its next draft failed: no hidden states) or found no ring to
    evict (RuntimeError); and a request's own chunk past a bucket is projected alone first, so
    the batch's flush stays within CHUNKED_REPLAYS buckets of replays, never one eager call
    (review of the thirty-sixth session's change)."""
    feats = drafter.config.context_features
    g = torch.Generator().manual_seed(7)
    cache = DraftContextCache(drafter, 1024)
    cache.fix(3, torch.device("cpu"))  # max_num_seqs 2: 3 rings
    cache._captured = _BucketedProjection(drafter, [4, 8])
    eager, context_kv = [], drafter.context_kv
    with torch.inference_mode():
        for rid in ("p1", "p2", "p3"):  # ran, then were preempted: a ring each, 7 rows pending
            cache.observe(rid, 0, torch.randn(2, feats, generator=g))
            cache.project([rid])
            cache.observe(rid, 2, torch.randn(7, feats, generator=g))
        cache.observe("a", 0, torch.randn(5, feats, generator=g))  # the running batch
        cache.project(["a"])
        drafter.context_kv = lambda f, p: (eager.append(f.shape[0]), context_kv(f, p))[1]
        replays = len(cache._captured.calls)  # (a replay stand-in calls context_kv too)
        try:
            cache.observe("b", 0, torch.randn(18, feats, generator=g))  # a prefill
            meta = cache.draft_meta(["a", "b"], [1, 2])  # both still hold their rows
        finally:
            drafter.context_kv = context_kv
    assert meta[0][:2] == [5, 18]
    assert eager and eager == cache._captured.calls[replays:]  # every projection a replay
    assert all(c <= 8 for c in cache._captured.calls)
    assert cache._ctx["a"].slot is not None and cache._ctx["b"].slot is not None
    assert cache._pending_total == sum(c.pending_rows for c in cache._ctx.values())


def test_rows_a_batch_flush_leaves_pending_do_not_make_every_step_flush(drafter):
    """Requests without a ring in a fixed store (their rows under a bucket each) stay pending
    through a batch flush; once their rows alone reached CHUNKED_REPLAYS - 1 buckets, every
    later observe of a running request flushed again, a projection a plain step (a helper's
    review of the 256-row flush). The next batch flush now waits for that many new rows."""
    feats = drafter.config.context_features
    g = torch.Generator().manual_seed(9)
    cache = DraftContextCache(drafter, 1024)
    cache.fix(1, torch.device("cpu"))  # one ring: "run" holds it
    cache._captured = _BucketedProjection(drafter, [4, 8])
    bound = (DraftContextCache.CHUNKED_REPLAYS - 1) * 8
    with torch.inference_mode():
        cache.observe("run", 0, torch.randn(3, feats, generator=g))
        cache.project(["run"])
        for i in range(4):  # ringless (never projected): 7 rows each, 28 >= the bound of 24
            cache.observe(f"wait{i}", 0, torch.randn(7, feats, generator=g))
        before = len(cache._captured.calls)
        for t in range(20):  # twenty plain steps of the running request
            cache.observe("run", 3 + t, torch.randn(1, feats, generator=g))
        flushes = len(cache._captured.calls) - before
    assert flushes <= 20 // 8 + 1, flushes  # its own bucket's flushes (and the first batch one)
    assert all(cache._ctx[f"wait{i}"].slot is None for i in range(4))  # no ring lent
    assert cache._pending_total == sum(c.pending_rows for c in cache._ctx.values())
    assert cache._pending_total - cache._pending_left < bound
