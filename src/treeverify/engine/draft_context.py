"""The DFlash drafter's per-request context: keys/values of committed tokens, computed once.

A DFlash draft attends from its block to the target's hidden states of the context. Everything a
context row contributes (fc -> hidden_norm -> each layer's k_proj/k_norm/rope and v_proj) depends
on that row alone, so it is computed when the row is first needed and kept: a round projects only
the rows committed since the last round (1 + accepted length), not the whole window again.

Per request the cache holds:

    kv       (capacity, n_layers, 2, Hkv, D)  rows first .. first + n - 1, in position order
    pending  [(rows_i, F), ...]               target hidden states observed since, not projected

`observe` only appends to `pending` (a plain decode step, e.g. at adaptive budget 0, costs a list
append); `project` turns every pending row of a set of requests into keys/values in ONE drafter
call (rows are independent: one flat (R, F) batch over all requests). Rows older than the window
(plus SLACK) are never projected, and the buffer is compacted to the last window + SLACK rows once
it holds twice that, so memory stays O(window) per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from treeverify.kernels.staging import to_device


@dataclass
class _Context:
    kv: torch.Tensor | None = None  # (capacity, n_layers, 2, Hkv, D)
    first: int = 0  # position of kv row 0
    n: int = 0  # projected rows held
    pending: list[torch.Tensor] = field(default_factory=list)  # (rows_i, F) each, in order
    pending_rows: int = 0  # sum of the pending chunks' rows (read every step: kept, not summed)

    @property
    def projected_end(self) -> int:
        return self.first + self.n

    @property
    def end(self) -> int:
        """One past the last observed position."""
        return self.projected_end + self.pending_rows

    def set_pending(self, chunks: list[torch.Tensor]) -> None:
        self.pending = chunks
        self.pending_rows = sum(c.shape[0] for c in chunks)


class DraftContextCache:
    MAX_PENDING = 64  # observed chunks kept before they are projected (bounds the list)
    # Rows kept beyond the window, so that dropping rejected or recomputed rows (a few at the
    # end) still leaves a full window to draft from.
    SLACK = 64

    def __init__(self, drafter, window: int):
        if window < 1:
            raise ValueError(f"window: expected >= 1, got {window}")
        self.drafter = drafter
        self.window = window
        self._ctx: dict[str, _Context] = {}
        self._captured = None  # CapturedFn of drafter.context_kv by row count, on a GPU

    def capture_projection(self, device: torch.device, max_rows: int) -> None:
        """Capture `context_kv` per row-count bucket (16, 32, .. up to `max_rows`: a round's
        committed rows, at most batch x (depth + 1)): rows are independent, so padded rows
        change nothing; a projection of more rows (a prefill, a long run of plain steps) runs
        eagerly. ~25 small launches per round become one replay."""
        from treeverify.engine.captured_fn import CapturedFn

        buckets, r = [], 16
        while r < 2 * max_rows:
            buckets.append(r)
            r *= 2
        cfg = self.drafter.config
        dtype = self.drafter.fc.weight.dtype

        def example(rows: int):
            return (torch.zeros(rows, cfg.context_features, dtype=dtype, device=device),
                    torch.zeros(rows, dtype=torch.int64, device=device))  # fmt: skip

        with torch.no_grad():  # no autograd records in the graph (plain tensors, not inference)
            self._captured = CapturedFn(lambda f, p: (self.drafter.context_kv(f, p),), example,
                                        buckets, rows_per_item=(1,))  # fmt: skip

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ctx

    def __len__(self) -> int:
        return len(self._ctx)

    def end(self, request_id: str) -> int:
        """One past the last position observed for the request (0 if none)."""
        ctx = self._ctx.get(request_id)
        return 0 if ctx is None else ctx.end

    def observe(self, request_id: str, start: int, hidden: torch.Tensor) -> None:
        """The target's hidden states (rows, F) of positions start.. . Rows already held at or
        past `start` were recomputed or rejected: they are dropped first. `hidden` must not be
        overwritten later (the engine copies graph outputs once per step)."""
        ctx = self._ctx.setdefault(request_id, _Context())
        end = ctx.end
        if start > end:
            raise RuntimeError(f"dflash context of {request_id}: {end} rows, "
                               f"chunk starts at {start}")  # fmt: skip
        if start < end:
            self._truncate(ctx, start)
        ctx.pending.append(hidden)
        ctx.pending_rows += hidden.shape[0]
        if len(ctx.pending) >= self.MAX_PENDING:
            self.project([request_id])

    def _truncate(self, ctx: _Context, start: int) -> None:
        if start >= ctx.projected_end:  # only pending rows go
            keep = start - ctx.projected_end
            joined = torch.cat(ctx.pending)[:keep] if keep else None
            ctx.set_pending([] if joined is None else [joined])
        elif start >= ctx.first:
            ctx.n = start - ctx.first
            ctx.set_pending([])
        else:  # before the rows held (a restart from scratch): nothing older is kept
            ctx.first, ctx.n = start, 0
            ctx.set_pending([])

    @torch.inference_mode()
    def project(self, request_ids: list[str]) -> None:
        """Keys/values of every pending row of these requests, in one drafter call."""
        todo = [(rid, self._ctx[rid]) for rid in request_ids
                if rid in self._ctx and self._ctx[rid].pending]  # fmt: skip
        if not todo:
            return
        feats, positions, spans = [], [], []
        for _, ctx in todo:
            rows = torch.cat(ctx.pending) if len(ctx.pending) > 1 else ctx.pending[0]  # (R_i, F)
            begin = ctx.projected_end
            skip = max(0, rows.shape[0] - self.window - self.SLACK)  # older than ever read
            if skip:
                ctx.first, ctx.n = begin + skip, 0  # everything held is older still
                begin, rows = begin + skip, rows[skip:]
            feats.append(rows)
            positions.append(torch.arange(begin, begin + rows.shape[0]))
            spans.append(rows.shape[0])
        dev = feats[0].device
        pos = to_device(torch.cat(positions), dev)  # (R,) pinned, non-blocking: no sync
        feats = torch.cat(feats)  # (R, F)
        if self._captured is not None:  # a view of the graph's output: copied out below
            kv = self._captured(feats, pos)[0]
        else:
            kv = self.drafter.context_kv(feats, pos)  # (R, n_layers, 2, Hkv, D)
        for (_, ctx), part in zip(todo, kv.split(spans), strict=True):
            ctx.set_pending([])
            self._append(ctx, part)

    def _append(self, ctx: _Context, rows: torch.Tensor) -> None:
        """rows (r, n_layers, 2, Hkv, D) at positions projected_end.. ."""
        r = rows.shape[0]
        keep_max = self.window + self.SLACK
        if ctx.n + r > 2 * keep_max:  # compact: keep the last `keep_max - r` rows held
            keep = max(0, keep_max - r)
            ctx.kv[:keep] = ctx.kv[ctx.n - keep : ctx.n].clone()
            ctx.first, ctx.n = ctx.first + ctx.n - keep, keep
        if ctx.kv is None or ctx.n + r > ctx.kv.shape[0]:
            cap = min(max(64, 2 * (ctx.n + r)), 2 * keep_max)
            grown = rows.new_empty((max(cap, ctx.n + r), *rows.shape[1:]))
            if ctx.n:
                grown[: ctx.n] = ctx.kv[: ctx.n]
            ctx.kv = grown
        ctx.kv[ctx.n : ctx.n + r] = rows
        ctx.n += r

    def keys_values(self, request_id: str) -> tuple[torch.Tensor, int] | None:
        """(the last `window` projected rows (C, n_layers, 2, Hkv, D), position of row 0), after
        projecting what is pending; None when the request has no rows."""
        ctx = self._ctx.get(request_id)
        if ctx is None:
            return None
        self.project([request_id])
        if ctx.n == 0:
            return None
        c = min(ctx.n, self.window)
        return ctx.kv[ctx.n - c : ctx.n], ctx.projected_end - c

    def forget(self, request_id: str) -> None:
        self._ctx.pop(request_id, None)
