"""The n-gram drafter's per-request history on the device, for whole rounds (round_graphs.py).

The general path drafts n-gram trees on the host (`NgramSource.propose_batch`: suffix matches
over each sequence's token list, votes sent to the device). A whole round must draft inside its
graph, so each request's newest tokens live in one device store, a ring per request, laid out
as the DFlash context rings (engine/draft_context.py) so that the round body treats both alike:

    tokens  (slots + 1, W) int64   request r's token at position p at tokens[slot_r, p % W];
                                   the last slot is scratch (padding requests read and write it);
                                   W = window + SLACK

Per request, on the host: its slot, `end` (one past the last position in the ring: the round's
root position, the root itself is the draft meta's root token) and `count` (positions
end - count .. end - 1 held). A draft rebuilds each request's right-aligned history of `window`
tokens (the ring's newest window - 1 and the root; -1 before the first held position) and runs
the device matcher (spec/ngram_device.py), whose logits equal the host drafter's bit for bit: a
whole n-gram round drafts what the general path drafts. The round writes its accepted tokens
(root first) into the ring on the device; the host advances `end` and `count` (`advance`).

Tokens reach the rings from the host's token lists only when a round is staged (`prepare`):
after a prefill, plain decode steps or a general-path round, the missing tail is written in one
copy. Nothing is observed per step, so plain decoding pays nothing for it.

The draft meta row 0 ("rows read") counts history tokens including the root (>= 1 for a real
request; 0 marks padding), at most `window`, so the round state's advance (rows + m, clipped at
`window`) keeps it right across rounds launched ahead.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from treeverify.engine.sequence import Sequence
from treeverify.kernels.staging import to_device
from treeverify.spec.ngram_device import ngram_logits


@dataclass
class _Ring:
    slot: int | None = None
    end: int = 0  # one past the last position held
    count: int = 0  # positions end - count .. end - 1


class NgramTokenRings:
    SLACK = 64  # positions past the window: rows a discarded round launched ahead wrote

    def __init__(self, vocab_size: int, window: int, max_n: int, floor: float):
        if window < 2:
            raise ValueError(f"window: expected >= 2, got {window}")
        self.vocab_size, self.max_n, self.floor = vocab_size, max_n, floor
        self.window = window  # history tokens a draft reads, the root included
        self.width = window + self.SLACK  # W
        self.tokens: torch.Tensor | None = None  # (slots + 1, W) int64
        self._rings: OrderedDict[str, _Ring] = OrderedDict()  # least recently used first
        self._free: list[int] = []
        self.fixed = False

    # ---- the store -----------------------------------------------------------------------------
    @property
    def slots(self) -> int:
        return 0 if self.tokens is None else self.tokens.shape[0] - 1

    @property
    def scratch_slot(self) -> int:
        return self.slots

    def _allocate(self, slots: int, device: torch.device) -> None:
        store = torch.full((slots + 1, self.width), -1, dtype=torch.int64, device=device)
        old = self.slots
        if self.tokens is not None and old:
            store[:old] = self.tokens[:old]
        self._free += list(range(slots - 1, old - 1, -1))  # popped from the end: lowest first
        self.tokens = store

    def fix(self, slots: int, device: torch.device) -> None:
        """Size the store once, for captured rounds (their addresses are baked in)."""
        if self._rings:
            raise RuntimeError("NgramTokenRings.fix: requests are held; fix before serving")
        self.tokens, self._free = None, []
        self._allocate(slots, device)
        self.fixed = True

    def _acquire(self, ring: _Ring, device: torch.device, keep: set[str]) -> None:
        if not self._free:
            if not self.fixed:
                self._allocate(max(4, 2 * self.slots), device)
            else:  # the least recently used request outside `keep` gives its ring up
                victim = next((r for rid, r in self._rings.items()
                               if rid not in keep and r.slot is not None), None)  # fmt: skip
                if victim is None:
                    raise RuntimeError("NgramTokenRings: no ring free and none to evict")
                self._free.append(victim.slot)
                victim.slot, victim.end, victim.count = None, 0, 0
        ring.slot = self._free.pop()

    # ---- requests ------------------------------------------------------------------------------
    def __contains__(self, request_id: str) -> bool:
        return request_id in self._rings

    def __len__(self) -> int:
        return len(self._rings)

    def prepare(self, seqs: list[Sequence], device: torch.device) -> None:
        """Bring each ring up to its sequence's root (the last token, position num_tokens - 1):
        the missing positions of the newest window - 1 written from the host's token list, all
        requests in one copy (none missing: returns before any torch call)."""
        keep = {s.request_id for s in seqs}
        rows, values = [], []
        for seq in seqs:
            ring = self._rings.get(seq.request_id)
            if ring is None:
                ring = self._rings[seq.request_id] = _Ring()
            self._rings.move_to_end(seq.request_id)
            root = seq.num_tokens - 1
            if ring.slot is not None and ring.end == root:
                continue
            if ring.slot is None:
                if self.tokens is None:
                    self._allocate(4, device)
                self._acquire(ring, device, keep)
            first = max(0, root - (self.window - 1))
            if ring.end <= root and ring.end - ring.count <= first and ring.end >= first:
                first = ring.end  # the held positions are still the right ones: append
                count = min(self.width, ring.count + root - first)
            else:  # rolled back, evicted or too far behind: the window written anew
                count = root - first
            history = seq.all_token_ids
            rows += [ring.slot * self.width + p % self.width for p in range(first, root)]
            values += history[first:root]
            ring.end, ring.count = root, count
        if rows:
            idx = to_device(torch.tensor(rows, dtype=torch.int64), self.tokens.device)
            val = to_device(torch.tensor(values, dtype=torch.int64), self.tokens.device)
            self.tokens.view(-1).index_copy_(0, idx, val)

    def draft_meta(self, request_ids: list[str], last_tokens: list[int],
                   batch: int | None = None) -> list[list[int]]:  # fmt: skip
        """The (4, batch) rows a draft reads: history tokens (the root included, at most
        `window`), the root token, the ring's end (the root's position), its slot; padding
        requests: nothing read, token 0, end 0, the scratch ring. RuntimeError naming a request
        that was not prepared."""
        counts, ends, slots = [], [], []
        for rid in request_ids:
            ring = self._rings.get(rid)
            if ring is None or ring.slot is None:
                raise RuntimeError(f"ngram rings: {rid} was not prepared")
            counts.append(min(self.window, ring.count + 1))
            ends.append(ring.end)
            slots.append(ring.slot)
        pad = (batch or len(request_ids)) - len(request_ids)
        return [counts + [0] * pad, list(last_tokens) + [0] * pad, ends + [0] * pad,
                slots + [self.scratch_slot] * pad]  # fmt: skip

    def draft(self, meta: torch.Tensor, depth: int, rows: int | None = None) -> torch.Tensor:
        """(B, L, V) log-probabilities from the rings: meta (4, B) int64 on the device
        (`draft_meta`). Capture-safe: fixed shapes, the rings read by one gather."""
        w, window = self.width, self.window
        j = torch.arange(window, device=meta.device)  # (H,) history column
        back = (window - 1) - j  # (H,) positions before the root
        pos = meta[2][:, None] - back[None, :]  # (B, H)
        ring = meta[3][:, None] * w + pos.remainder(w)  # (B, H)
        history = self.tokens.view(-1)[ring.clamp(min=0)]  # (B, H)
        history[:, -1] = meta[1]  # the root
        history = torch.where(back[None, :] < meta[0][:, None], history, -1)  # (B, H)
        return ngram_logits(history, depth, self.vocab_size, self.max_n, self.floor)

    def write_rows(self, rows: torch.Tensor, pos: torch.Tensor, ring: torch.Tensor,
                   tokens: torch.Tensor, hidden: torch.Tensor | None) -> None:  # fmt: skip
        """A round's accepted tokens into the rings, at the indices RoundState.path_rows made:
        the tokens of flat node rows `rows` (path node d, root first) into ring rows `ring` (the
        scratch ring's past the path's end). rows, ring (R,) int64; tokens (b, n)."""
        self.tokens.view(-1).index_copy_(0, ring, tokens.reshape(-1).index_select(0, rows))

    def advance(self, request_id: str, rows: int) -> None:
        """`rows` positions from `end` on were written by a round on the device."""
        ring = self._rings[request_id]
        ring.end += rows
        ring.count = min(self.width, ring.count + rows)
        self._rings.move_to_end(request_id)

    def has_pending(self, request_ids: list[str]) -> bool:
        """Nothing is ever pending: `prepare` writes what a round needs when it is staged."""
        return False

    def eager_rows(self, ends: list[int]) -> int | None:
        """A draft always reads the whole window (the argument of DraftContextCache's)."""
        return None

    def history(self, request_id: str) -> tuple[int, list[int]] | None:
        """(first position, the held tokens in position order), a copy for checks and
        debugging; None when the request holds no ring."""
        ring = self._rings.get(request_id)
        if ring is None or ring.slot is None:
            return None
        pos = torch.arange(ring.end - ring.count, ring.end) % self.width
        return ring.end - ring.count, self.tokens[ring.slot, pos.to(self.tokens.device)].tolist()

    def forget(self, request_id: str) -> None:
        ring = self._rings.pop(request_id, None)
        if ring is not None and ring.slot is not None:
            self._free.append(ring.slot)
