"""The feed ring (engine/feed_ring.py) and the DFlash context's use of it (CPU, fp32, the seeded
tiny DFlash drafter on tiny-llama): plain steps launched ahead write their tapped rows into one
ring and hand the context row ids. The context's rings must then hold what they hold when every
row is handed over as its own copy, through rejections, other requests' chunks in between, the
batch flushes and spills before the ring laps; an overwritten id is an error, never a wrong
row."""

from __future__ import annotations

import random

import pytest
import torch

from treeverify.engine.draft_context import DraftContextCache
from treeverify.engine.feed_ring import FeedRing
from treeverify.models.tiny import build_tiny
from treeverify.spec.dflash_io import tiny_dflash


@pytest.fixture(scope="module")
def drafter():
    cfg, model, _ = build_tiny("tiny-llama", seed=0)
    return tiny_dflash(cfg, seed=1, target_embed=model.model.embed_tokens,
                       target_lm_head=model.lm_head).eval()  # fmt: skip


def test_writes_stay_contiguous_and_gathers_refuse_overwritten_rows():
    ring = FeedRing(10, 3, torch.float32, torch.device("cpu"))
    # zeroed, not empty: a captured projection's padding rows read row 0 before any write
    assert bool((ring.buf == 0).all())
    a = torch.randn(4, 3)
    assert ring.write(a) == 0 and ring.head == 4
    b = torch.randn(4, 3)
    assert ring.write(b) == 4
    c = torch.randn(4, 3)  # 8 + 4 > 10: starts at the next lap (id 10, row 0)
    assert ring.start_of(4) == 10 and ring.write(c) == 10 and ring.head == 14
    torch.testing.assert_close(ring.gather([5, 4, 11]), torch.stack([b[1], b[0], c[1]]))
    assert not ring.live(3)  # rows 0..3 now hold c
    with pytest.raises(RuntimeError, match="row 3 requested"):
        ring.gather([3, 12])
    with pytest.raises(RuntimeError, match="requested"):
        ring.gather([14])  # not written yet
    with pytest.raises(ValueError, match="holds 10"):
        ring.write(torch.randn(11, 3))


def _steps(seed: int, feats: int):
    """A random history for 3 requests: prompts (chunks), plain steps of all running requests
    in one batch (rows 1 each, maybe a bucket's padding rows), rejections (a request's next row
    starts before its end), and reads."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    ends = {}
    for _ in range(400):
        kind = rng.random()
        if kind < 0.05 or len(ends) < 2:
            rid = f"r{rng.randrange(3)}"
            start = 0 if rid not in ends else max(0, ends[rid] - rng.randint(0, 3))
            n = rng.randint(1, 30)
            ends[rid] = start + n
            yield "chunk", [(rid, start)], torch.randn(n, feats, generator=gen)
        elif kind < 0.1:
            yield "read", sorted(ends), None
        else:
            items = []
            for rid in sorted(ends):
                start = ends[rid] - (rng.randint(1, 3) if rng.random() < 0.05 else 0)
                start = max(0, start)
                ends[rid] = start + 1
                items.append((rid, start))
            pad = rng.choice([0, 0, 1, 3])  # a bucket's padding rows: written, never observed
            yield "step", items, torch.randn(len(items) + pad, feats, generator=gen)


@pytest.mark.parametrize("lazy", [False, True], ids=["eager-flush", "lazy"])
@pytest.mark.parametrize("by_ring", [True, False], ids=["ring-projection", "general-projection"])
@pytest.mark.parametrize("bucket", [None, 8], ids=["cpu-flush", "bucketed-flush"])
def test_ring_ids_give_the_rows_that_copies_give(drafter, bucket, by_ring, lazy):
    """Two caches fed the same random history, one every plain step's rows as copies
    (`observe`), one as ring ids (`ring_write` + `observe_ring`): after every read their rings
    hold the same keys/values, equal to a projection from scratch. `bucket`: a captured
    projection's largest bucket (batch flushes at 3 x 8 rows) or the CPU's flush every
    MAX_PENDING rows; the ring is small, so it spills before it laps. `by_ring`: the ids
    projected by engine/ring_projection.py's gather-project-scatter (TREEVERIFY_RING_PROJECTION,
    eager here) or gathered for the general projection. `lazy` (TREEVERIFY_CONTEXT_LAZY): the
    ids stay pending until a read or the ring's pressure projects them."""
    from test_draft_context import _BucketedProjection, _expected

    seed = random.randrange(2**32)
    feats, window = drafter.config.context_features, 48
    copies, ringed = DraftContextCache(drafter, window), DraftContextCache(drafter, window)
    if bucket:
        for c in (copies, ringed):
            c._captured = _BucketedProjection(drafter, [bucket])
    ringed.enable_ring(6)
    ringed.ring_projection = by_ring
    ringed.lazy = lazy
    truth: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for kind, items, rows in _steps(seed, feats):
            if kind == "chunk":
                ((rid, start),) = items
                for c in (copies, ringed):
                    c.observe(rid, start, rows)
                truth[rid] = torch.cat([truth.get(rid, rows[:0])[:start], rows])
            elif kind == "step":
                first = ringed.ring_write(rows)
                ringed.observe_ring([(rid, s, first + i) for i, (rid, s) in enumerate(items)])
                for i, (rid, s) in enumerate(items):
                    copies.observe(rid, s, rows[i : i + 1].clone())
                    truth[rid] = torch.cat([truth[rid][:s], rows[i : i + 1]])
            else:
                for rid in items:
                    assert ringed.end(rid) == copies.end(rid) == truth[rid].shape[0], seed
                    kv, first = ringed.keys_values(rid)
                    want, want_first = _expected(drafter, truth[rid], window)
                    assert first == want_first, seed
                    torch.testing.assert_close(kv, want, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")
                    kv2, _ = copies.keys_values(rid)
                    torch.testing.assert_close(kv, kv2, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")
    assert ringed._ring is not None and ringed._ring.writes > 100
    assert (ringed.ring_projected > 100) == by_ring, ringed.ring_projected
    assert ringed._ring.head > 2 * ringed._ring.rows, "the ring must have lapped"


def test_a_write_that_would_reach_pending_ids_spills_them_first(drafter):
    """Rows pending as ids (a request that never reaches a flush: a small stretch each) are
    copied out before the ring laps onto them; the context's rows stay right."""
    from test_draft_context import _expected

    feats = drafter.config.context_features
    cache = DraftContextCache(drafter, 1024)
    cache.lazy = False  # the eager rule's spill (lazy projects at the ring's pressure instead)
    cache.enable_ring(2)
    rows = cache._ring_rows()
    g = torch.Generator().manual_seed(5)
    truth = torch.randn(rows + 40, feats, generator=g)  # more rows than the ring holds
    with torch.inference_mode():
        cache.observe("r", 0, truth[:1])
        for i in range(1, truth.shape[0]):
            first = cache.ring_write(truth[i : i + 1])  # the first write sizes the ring
            cache.MAX_PENDING = 10**6  # then nothing flushes: every row stays pending as an id
            cache.observe_ring([("r", i, first)])
        assert cache.ring_spills >= 1
        kv, first = cache.keys_values("r")
    assert first == 0
    torch.testing.assert_close(kv, _expected(drafter, truth, 1024)[0], rtol=1e-5, atol=1e-5)


def test_ring_write_refuses_more_rows_than_it_was_enabled_for(drafter):
    cache = DraftContextCache(drafter, 16)
    cache.enable_ring(2)
    with pytest.raises(RuntimeError, match="3 rows, enabled for 2"):
        cache.ring_write(torch.randn(3, drafter.config.context_features))
    cache.ring_write(torch.randn(2, drafter.config.context_features))  # sizes the ring
    with pytest.raises(RuntimeError, match="sized for writes of 2 rows, asked for 4"):
        cache.enable_ring(4)


def test_rows_written_before_a_spill_and_observed_after_it_are_kept(drafter):
    """As the engine runs it: step k + 1 is written (launched ahead) before step k's rows are
    observed, so a spill at k + 1's write cannot see k's ids; observing them must lower the
    floor again, or the ring laps onto them while they are pending."""
    from test_draft_context import _expected

    feats = drafter.config.context_features
    cache = DraftContextCache(drafter, 1024)
    cache.lazy = False  # the eager rule's spill (lazy projects at the ring's pressure instead)
    cache.enable_ring(1)
    g = torch.Generator().manual_seed(6)
    truth = torch.randn(3 * (cache._ring_rows() + 8), feats, generator=g)
    with torch.inference_mode():
        cache.observe("r", 0, truth[:1])
        in_flight = (1, cache.ring_write(truth[1:2]))
        cache.MAX_PENDING = 10**6  # nothing flushes: rows stay pending as ids until a spill
        for i in range(2, truth.shape[0]):
            nxt = (i, cache.ring_write(truth[i : i + 1]))  # launched before the last is read
            cache.observe_ring([("r", *in_flight)])
            in_flight = nxt
        cache.observe_ring([("r", *in_flight)])
        assert cache.ring_spills >= 2
        kv, first = cache.keys_values("r")
    assert first == 0
    torch.testing.assert_close(kv, _expected(drafter, truth, 1024)[0], rtol=1e-5, atol=1e-5)


def test_steady_plain_steps_never_spill(drafter):
    """b=8 plain steps launched ahead (each written before the last is observed), a captured
    projection's largest bucket of 256 rows: the batch flush projects every pending id long
    before the ring laps onto it, so no write needs a spill (with a floor that only fell, every
    lap copied out whatever was pending: a helper's review)."""
    from test_draft_context import _BucketedProjection

    b, feats = 8, drafter.config.context_features
    cache = DraftContextCache(drafter, 64)
    cache.lazy = False  # the eager rule (the lazy one's ring pressure: the test below)
    cache._captured = _BucketedProjection(drafter, [16, 32, 64, 128, 256])
    cache.enable_ring(b)
    rids = [f"r{i}" for i in range(b)]
    g = torch.Generator().manual_seed(7)
    with torch.inference_mode():
        for rid in rids:
            cache.observe(rid, 0, torch.randn(4, feats, generator=g))
        pos, in_flight = 4, cache.ring_write(torch.randn(b, feats, generator=g))
        for _ in range(1000):
            nxt = cache.ring_write(torch.randn(b, feats, generator=g))
            cache.observe_ring([(rid, pos, in_flight + i) for i, rid in enumerate(rids)])
            pos, in_flight = pos + 1, nxt
    assert cache._ring.head > 4 * cache._ring.rows  # it lapped
    assert cache.ring_spills == 0


def test_lazy_plain_steps_are_projected_only_when_read_or_when_the_ring_needs_room(drafter):
    """TREEVERIFY_CONTEXT_LAZY: b=8 plain steps launched ahead, a largest bucket of 256 rows (the
    eager rule projects a request's every 256 rows, the batch's every 768): no row is projected
    while the ring has room, a read projects the request's pending rows (equal to a projection
    from scratch), and a run past the ring's size projects at the ring's pressure, never
    spilling; a finished request's rows are dropped unprojected."""
    from test_draft_context import _BucketedProjection, _expected

    b, feats, window = 8, drafter.config.context_features, 512
    cache = DraftContextCache(drafter, window)
    cache.lazy = True
    cache._captured = _BucketedProjection(drafter, [16, 32, 64, 128, 256])
    cache.enable_ring(b)
    rids = [f"r{i}" for i in range(b)]
    g = torch.Generator().manual_seed(8)
    truth = {rid: torch.randn(4, feats, generator=g) for rid in rids}
    with torch.inference_mode():
        for rid in rids:
            cache.observe(rid, 0, truth[rid])
        pos = 4

        def steps(n: int) -> None:
            nonlocal pos
            for _ in range(n):  # each written, then observed (the read-ahead order is tested above)
                rows = torch.randn(b, feats, generator=g)
                first = cache.ring_write(rows)
                cache.observe_ring([(rid, pos, first + i) for i, rid in enumerate(rids)])
                for i, rid in enumerate(rids):
                    truth[rid] = torch.cat([truth[rid], rows[i : i + 1]])
                pos += 1

        steps(100)  # 800 rows: under the ring's 4 x 256 + 4 x 8
        assert cache.ring_projected == 0 and cache.ring_pressure_projections == 0
        kv, first = cache.keys_values("r3")  # a read (a round's draft_meta does the same)
        torch.testing.assert_close(kv, _expected(drafter, truth["r3"], window)[0],
                                   rtol=1e-5, atol=1e-5)  # fmt: skip
        assert cache.ring_projected == 100  # r3's rows only
        cache.forget("r5")  # finished: its 100 pending rows dropped unprojected
        rids.remove("r5")
        steps(200)  # laps the ring: projected at its pressure
        assert cache.ring_pressure_projections >= 1 and cache.ring_spills == 0
        for rid in rids:
            kv, first = cache.keys_values(rid)
            want, want_first = _expected(drafter, truth[rid], window)
            assert first == want_first
            torch.testing.assert_close(kv, want, rtol=1e-5, atol=1e-5)


def test_ring_refuses_rows_of_another_width_or_type(drafter):
    """The ring is made once (at the first write, or before capture with the engine's dtype):
    rows of another type or width are refused by name, never silently converted."""
    feats = drafter.config.context_features
    cache = DraftContextCache(drafter, 16)
    cache.enable_ring(2)
    cache.ring_write(torch.randn(2, feats))  # fp32 rows size the ring
    with pytest.raises(RuntimeError, match="ring_write: rows \\(2, .*bfloat16"):
        cache.ring_write(torch.randn(2, feats).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match=f"the ring holds \\(, {feats}\\)"):
        cache.ring_write(torch.randn(1, feats + 1))


def test_capturing_the_ring_projection_needs_a_fixed_store_and_an_enabled_ring(drafter):
    cache = DraftContextCache(drafter, 16)
    with pytest.raises(RuntimeError, match="fix the store and enable the ring first"):
        cache.capture_ring_projection(drafter.config.context_features, torch.float32,
                                      torch.device("cpu"))  # fmt: skip
    cache.fix(2, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="enable the ring first"):
        cache.capture_ring_projection(drafter.config.context_features, torch.float32,
                                      torch.device("cpu"))  # fmt: skip


@pytest.mark.parametrize("by_ring", [True, False], ids=["ring-projection", "general-projection"])
@pytest.mark.parametrize("slots", [2, 3])
@pytest.mark.parametrize("run", range(3))
def test_lazy_rows_in_a_fixed_store_with_fewer_rings_than_requests(drafter, by_ring, slots, run):
    """Lazy, a fixed store of fewer rings than requests (reads evict), every step written one
    step ahead of its observe (the engine's launch-ahead order), prompts and rejections between:
    after each read the rows a request holds equal a projection of its true rows at those
    positions (no overwritten or misplaced id is ever projected), through pressure projections
    and spills of ringless requests' ids."""
    from test_draft_context import _BucketedProjection

    seed = random.randrange(2**32)
    feats, window = drafter.config.context_features, 24
    cache = DraftContextCache(drafter, window)
    cache.lazy = True
    cache.fix(slots, torch.device("cpu"))
    cache._captured = _BucketedProjection(drafter, [8])
    cache.enable_ring(6)
    cache.ring_projection = by_ring
    truth: dict[str, torch.Tensor] = {}
    held = None  # a step written, not yet observed
    rng = random.Random(seed)

    def settle():
        nonlocal held
        if held is not None:
            items, first = held
            cache.observe_ring([(rid, s, first + i) for i, (rid, s) in enumerate(items)])
            held = None

    with torch.inference_mode():
        for kind, items, rows in _steps(seed, feats):
            if kind == "chunk":
                settle()
                ((rid, start),) = items
                cache.observe(rid, start, rows)
                truth[rid] = torch.cat([truth.get(rid, rows[:0])[:start], rows])
            elif kind == "step":
                first = cache.ring_write(rows)  # before the step in flight is observed
                settle()
                held = (items, first)
                for i, (rid, s) in enumerate(items):
                    truth[rid] = torch.cat([truth[rid][:s], rows[i : i + 1]])
            else:
                settle()
                pick = ([r for r in items if rng.random() < 0.7] or items[:1])[:slots]
                cache.project(pick)
                for rid in pick:
                    h = cache._held(rid)
                    if h is None:  # evicted, nothing observed since
                        continue
                    slot, c, end = h
                    assert end == truth[rid].shape[0], seed
                    idx = torch.arange(end - c, end) % cache.width
                    kv = cache.kv[slot].index_select(0, idx)
                    want = drafter.context_kv(truth[rid][end - c : end], torch.arange(end - c, end))
                    torch.testing.assert_close(kv, want, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")
    assert cache._ring.head > 2 * cache._ring.rows, "the ring must have lapped"


def test_lazy_batch_flush_counts_copies_left_in_copies(drafter):
    """Lazy: what a batch flush could not take (ringless requests' copied rows) is counted in
    copied rows, and when those go (the requests finish) while ring ids are pending, the next
    batch flush comes after three buckets of copies again (a review: the two units were mixed,
    and 28 copied rows sat past the bound of 24 with no flush)."""
    from test_draft_context import _BucketedProjection

    feats = drafter.config.context_features
    g = torch.Generator().manual_seed(1)
    cache = DraftContextCache(drafter, 1024)
    cache.lazy = True
    cache.fix(4, torch.device("cpu"))
    cache._captured = _BucketedProjection(drafter, [4, 8])  # flush 8: a batch bound of 24 copies
    cache.enable_ring(4)
    run = ["a", "b", "c", "d"]
    with torch.inference_mode():
        for r in run:  # each holds a ring of the store
            cache.observe(r, 0, torch.randn(1, feats, generator=g))
            cache.project([r])
        for i in range(4):  # ringless (no ring left): 7 copied rows each, a batch flush
            cache.observe(f"w{i}", 0, torch.randn(7, feats, generator=g))
        assert cache._pending_left == 28
        pos = 1
        for _ in range(10):  # plain steps launched ahead: their ids stay pending
            first = cache.ring_write(torch.randn(4, feats, generator=g))
            cache.observe_ring([(r, pos, first + j) for j, r in enumerate(run)])
            pos += 1
        for i in range(4):  # the ringless requests finish: no copied row left
            cache.forget(f"w{i}")
        assert cache._batch_pending() == 0 and cache._pending_left == 0
        before = len(cache._captured.calls)
        for r in run:  # steps read first: 7 copied rows each, 28 >= 24
            cache.observe(r, cache.end(r), torch.randn(7, feats, generator=g))
        assert len(cache._captured.calls) > before, "28 copied rows held, no batch flush"
