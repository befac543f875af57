"""The drafter's feed: the target's hidden states of every token committed to the cache, handed
to a DFlash drafter's context (engine/draft_context.py `observe`), from whichever path ran the
step. A mixin of `LLM` (with engine/spec_step.py's `SpeculativeSteps`).

    prefill chunks, plain decodes   each chunk's rows of the step's tapped hidden states (T, F)
    a tree (general path)           its root and accepted path's rows, gathered
    a plain step launched ahead     its taken rows (engine/decode_ahead.py), or their ids in
                                    the context's feed ring (engine/feed_ring.py, default)
    a whole round                   nothing here: its graph writes the accepted rows into the
                                    rings itself (engine/round_graphs.py)

A graph replay overwrites its output buffers, and the drafter projects pending rows later
(every largest-bucket of rows, or at the next round), so what it keeps must be a copy: one clone
a step for its one-row chunks (decodes), one per longer chunk (a prefill's), one gather for the
trees' (a gather copies). A pending view keeps its whole copy alive, so a decode's row must not
share one with a prefill chunk's thousands (a helper's review: at F = 3 x 7168, GBs pinned by
1-row views once pending rows flush at 256). No host read: the gather's index goes up through
pinned memory. The n-gram drafter reads tokens, not hidden states (its `observe` does nothing;
the runner taps no layers for it).
"""

from __future__ import annotations

import torch

from treeverify.kernels.staging import to_device


class DrafterFeed:
    """Needs `self.spec` (its `source.observe`)."""

    def _observe(self, chunks: list, trees: dict[str, int], paths: dict,
                 hidden: torch.Tensor) -> None:  # fmt: skip
        """Hand the drafter the hidden states (T, F) of the tokens this step committed to the
        cache, `chunks` in the forward's row order: a chunk's tokens, or a tree's root and
        accepted path (`trees`: request -> node count, `paths`: request -> accepted nodes)."""
        row, plain, tree_rows = 0, [], []
        for c in chunks:
            tree = trees.get(c.seq.request_id)
            n = c.num_tokens if tree is None else tree  # a tree: its node count
            if tree is None:
                plain.append((c, row, n))
            else:
                tree_rows.append((c, [row + node for node in paths[c.seq.request_id]]))
            row += n
        if plain:
            self._observe_plain(plain, hidden)
        if tree_rows:
            self._observe_rows(hidden, tree_rows)

    def _observe_plain(self, plain: list[tuple], hidden: torch.Tensor) -> None:
        """(chunk, first row, rows) of `hidden` each: the one-row chunks' rows in one copy when
        they are one run of rows (decodes come first in a step), else one each; a longer chunk
        in its own copy."""
        observe = self.spec.source.observe
        ones = [(c, start) for c, start, n in plain if n == 1]
        if ones:
            lo, hi = ones[0][1], ones[-1][1] + 1
            if hi - lo == len(ones):  # one run: one copy (a replay overwrites `hidden`)
                kept = hidden[lo:hi].clone()  # (len(ones), F)
                for c, start in ones:
                    observe(c.seq.request_id, c.start, kept[start - lo : start - lo + 1])
            else:
                for c, start in ones:
                    observe(c.seq.request_id, c.start, hidden[start : start + 1].clone())
        for c, start, n in plain:
            if n > 1:
                observe(c.seq.request_id, c.start, hidden[start : start + n].clone())

    def _observe_rows(self, hidden: torch.Tensor, parts: list[tuple]) -> None:
        """Hand the drafter each (chunk, its rows of `hidden`): a tree's root and accepted path.
        Every part's rows in one gather (one pinned upload, no sync; the gather copies, so a
        later graph replay cannot overwrite what the drafter keeps)."""
        flat = [r for _, rows in parts for r in rows]
        index = to_device(torch.tensor(flat), hidden.device)  # (sum rows,)
        kept = hidden.index_select(0, index)  # (sum rows, F): always a copy
        for (c, _), part in zip(parts, kept.split([len(r) for _, r in parts]), strict=True):
            self.spec.source.observe(c.seq.request_id, c.start, part)

    def _observe_ahead(self, chunks: list, hidden: torch.Tensor) -> None:
        """A plain step launched ahead: its kept rows (n, F), one per chunk in order (already a
        copy, made right after its replay)."""
        rows = [hidden] if len(chunks) == 1 else hidden.split(1)  # (1, F) each
        for c, r in zip(chunks, rows, strict=True):
            self.spec.source.observe(c.seq.request_id, c.start, r)

    def _observe_ring(self, chunks: list, ids: list[int]) -> None:
        """A plain step launched ahead whose rows went into the context's feed ring
        (engine/feed_ring.py): one id per chunk in order, handed over in one call."""
        items = [(c.seq.request_id, c.start, i) for c, i in zip(chunks, ids, strict=True)]
        self.spec.source.context.observe_ring(items)
