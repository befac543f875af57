"""engine/drafter_feed.py: what a step hands the DFlash drafter's context, and what each pending
row keeps alive. A pending view keeps its whole copy alive until it is projected (256 rows
later at most), so a decode's row must not share a copy with a prefill chunk's rows: at a large
target's width (F = 3 x 7168) one 1-row view per request pinned GBs (a helper's review of the
256-row flush, thirty-seventh session)."""

from __future__ import annotations

import types

import torch

from treeverify.engine.drafter_feed import DrafterFeed

F = 24


def chunk(rid: str, start: int, n: int):
    return types.SimpleNamespace(seq=types.SimpleNamespace(request_id=rid), start=start,
                                 num_tokens=n)  # fmt: skip


def feed_of(observed: list) -> DrafterFeed:
    feed = DrafterFeed()
    source = types.SimpleNamespace(
        observe=lambda rid, start, rows: observed.append((rid, start, rows))
    )
    feed.spec = types.SimpleNamespace(source=source)
    return feed


def test_decode_rows_share_one_copy_and_a_prefill_chunk_has_its_own():
    hidden = torch.randn(2 + 100, F)  # two decodes, then a 100-row prefill chunk
    observed = []
    chunks = [chunk("a", 7, 1), chunk("b", 3, 1), chunk("p", 0, 100)]
    feed_of(observed)._observe(chunks, {}, {}, hidden)
    by = {rid: (start, rows) for rid, start, rows in observed}
    assert by["a"][0] == 7 and by["b"][0] == 3 and by["p"][0] == 0
    torch.testing.assert_close(by["a"][1], hidden[0:1])
    torch.testing.assert_close(by["b"][1], hidden[1:2])
    torch.testing.assert_close(by["p"][1], hidden[2:])
    row_bytes = F * hidden.element_size()
    # the decodes' copy holds their two rows only; the prefill's its 100
    assert by["a"][1].untyped_storage().nbytes() == 2 * row_bytes
    assert by["a"][1].untyped_storage().data_ptr() == by["b"][1].untyped_storage().data_ptr()
    assert by["p"][1].untyped_storage().nbytes() == 100 * row_bytes
    # copies: a later overwrite of the step's output (a graph replay) changes none of them
    hidden.fill_(float("nan"))
    assert all(not rows.isnan().any() for _, _, rows in observed)


def test_decode_rows_apart_each_get_their_own_one_row_copy():
    hidden = torch.randn(1 + 50 + 1, F)  # a decode, a prefill chunk, a decode
    observed = []
    feed_of(observed)._observe([chunk("a", 4, 1), chunk("p", 0, 50), chunk("b", 9, 1)], {}, {},
                               hidden)  # fmt: skip
    by = {rid: rows for rid, _, rows in observed}
    row_bytes = F * hidden.element_size()
    assert by["a"].untyped_storage().nbytes() == row_bytes
    assert by["b"].untyped_storage().nbytes() == row_bytes
    torch.testing.assert_close(by["b"], hidden[51:52])
