"""`StepBatch`: one step's forward inputs, flat, for every kind of chunk at once: prefill chunks
and plain decodes (host lists from the scheduler) and speculative trees (a `TreeBatch`, already
on the device). One builder, one forward (`ModelRunner.run`), whatever the step mixes.

Chunk order is the scheduler's (decodes, then prefills); a tree takes its decode chunk's place
with its N nodes: node i at position P + depth(i), slot P + i, its ancestor-or-self mask row.
Consecutive trees are taken as one slice of the TreeBatch, so a step that is all trees (a whole
speculative round) does no per-sequence work and no host copy of the trees; a step that is all
chains keeps everything on the host until one copy per input (the plan builds the chain masks).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from treeverify.kernels.bits import chain_bits
from treeverify.kernels.staging import to_device

if TYPE_CHECKING:
    from treeverify.engine.scheduler import ScheduledBatch
    from treeverify.engine.speculative import TreeBatch


@functools.lru_cache(maxsize=256)
def cached_chain(n: int) -> torch.Tensor:
    """chain_bits(n) on the host, made once per n: (n, ceil(n/32)) int32; callers copy, never
    write."""
    return chain_bits(n)


def padded_chain(tokens: list[int], start: int, slots: list[int], n: int,
                 scratch_slot: int) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """One request's prefill chunk of P <= n tokens as a chain of n rows (a (1, n) bucket):
    ids, positions, KV slots (n,) int64 and valid rows (n,) bool. Rows past P are padding: token
    0 at the last position, K/V to the scratch slot, not valid (out of the MoE counts and the
    logits row); the chain mask (`cached_chain`) keeps them from every real row. The one layout
    of a padded prefill, whether staged for its graph or run eagerly."""
    p = len(tokens)
    if not 1 <= p <= n:
        raise ValueError(f"tokens: {p} tokens in a chain of {n} rows; expected 1..{n}")
    pad = n - p
    ids = torch.tensor(tokens + [0] * pad, dtype=torch.int64)
    pos = torch.arange(start, start + n, dtype=torch.int64).clamp(max=start + p - 1)
    slot = torch.tensor(list(slots) + [scratch_slot] * pad, dtype=torch.int64)
    return ids, pos, slot, torch.arange(n) < p


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


@dataclass
class StepLogits:
    """A forward's logits rows and which belong to whom."""

    logits: torch.Tensor  # (R, V) fp32
    spans: list[tuple[int, int]]  # per sampled sequence (batch.sampled order): (first row, rows)

    def per_sequence(self) -> list[torch.Tensor]:
        """Per sampled sequence its rows: the last token's (1, V), or every tree node's (N, V)."""
        return [self.logits[a : a + n] for a, n in self.spans]


@dataclass
class StepBatch:
    ids: torch.Tensor  # (T,) int64, on the device
    positions: torch.Tensor  # (T,) int64, on the device
    slots: torch.Tensor  # (T,) int64 KV slot per token (host or device: the plan copies it)
    block_tables: list[list[int]]  # per chunk: its page ids
    prefix_lens: list[int]  # per chunk: tokens cached before it
    query_lens: list[int]  # per chunk: its tokens this step (a tree: its N nodes)
    mask: torch.Tensor | None  # (T, W) int32 on the device when trees are in it; None: chains
    logits_rows: list[int] | None  # rows to project, in order; None: every row
    spans: list[tuple[int, int]]  # per sampled sequence: (first logits row, rows)
    prompt_spans: list[tuple[str, int, int, int]]  # (request id, first position, row, rows)
    decode_shaped: bool  # every chunk one sampled token, or every chunk a tree of one size

    @classmethod
    def build(cls, batch: ScheduledBatch, tb: TreeBatch | None, device: torch.device,
              prompt_from: dict[str, int] | None = None) -> StepBatch:  # fmt: skip
        """`tb`: the step's trees (its sequences' decode chunks run their trees instead).
        `prompt_from`: request id -> first prompt position whose logits row it still needs
        (prompt logprobs): position p's row predicts prompt token p + 1."""
        prompt_from = prompt_from or {}
        tree_index = {s.request_id: i for i, s in enumerate(tb.seqs)} if tb is not None else {}
        n_tree = tb.nodes if tb is not None else 0
        ids, pos, slots = [], [], []  # per segment: host lists or device tensors
        host = ([], [], [])  # the current run of chain chunks
        run: list[tuple[int, int]] = []  # the current run of trees: (tree index, start)
        qlens, rows, spans, prompt_spans = [], [], [], []
        tree_rows = []  # (first token row, first tree index, trees) per run of trees
        total = 0

        def flush_host():
            if host[0]:
                for out, part in zip((ids, pos, slots), host, strict=True):
                    out.append(torch.tensor(part, dtype=torch.int64))
                    part.clear()

        def flush_trees():
            if run:
                i0, k = run[0][0], len(run)
                starts = to_device(torch.tensor([s for _, s in run]), device)  # (k,)
                ids.append(tb.tokens[i0 : i0 + k].reshape(-1))
                pos.append((starts[:, None] + tb.depths[i0 : i0 + k]).reshape(-1))
                slots.append(tb.device_slots()[i0 : i0 + k].reshape(-1))
                tree_rows.append((total - k * n_tree, i0, k))
                run.clear()

        for c in batch.chunks:
            t = tree_index.get(c.seq.request_id)
            base = total
            if t is None:
                flush_trees()
                host[0].extend(c.token_ids)
                host[1].extend(range(c.start, c.start + c.num_tokens))
                host[2].extend(c.slots)
                qlens.append(c.num_tokens)
                total += c.num_tokens
                if c.samples:
                    spans.append((len(rows), 1))
                    rows.append(base + c.num_tokens - 1)
                rid = c.seq.request_id
                if rid in prompt_from:
                    lo = max(c.start, prompt_from[rid])
                    hi = min(c.start + c.num_tokens, c.seq.num_prompt_tokens - 1)
                    if hi > lo:
                        prompt_spans.append((rid, lo, len(rows), hi - lo))
                        rows += range(base + lo - c.start, base + hi - c.start)
            else:
                flush_host()
                if run and run[-1][0] != t - 1:  # not the next tree of the batch: a new slice
                    flush_trees()
                run.append((t, c.start))
                qlens.append(n_tree)
                total += n_tree
                spans.append((len(rows), n_tree))
                rows += range(base, base + n_tree)
        flush_host()
        flush_trees()
        decode_shaped = (bool(qlens) and all(q == qlens[0] for q in qlens)
                         and all(c.samples for c in batch.chunks)
                         and (qlens[0] == 1 or len(tree_index) == len(batch.chunks)))  # fmt: skip
        if tree_rows:  # trees in the step: ids, positions, slots and the mask on the device
            ids = [to_device(x, device) for x in ids]
            pos = [to_device(x, device) for x in pos]
            slots = [to_device(x, device) for x in slots]
            mask = cls._mask(qlens, tree_index, batch, tb, tree_rows, device)
        else:
            mask = None
        return cls(
            ids=to_device(_cat(ids), device),
            positions=to_device(_cat(pos), device),
            slots=_cat(slots),
            block_tables=[c.seq.block_table for c in batch.chunks],
            prefix_lens=[c.start for c in batch.chunks],
            query_lens=qlens,
            mask=mask,
            logits_rows=None if rows == list(range(total)) else rows,
            spans=spans,
            prompt_spans=prompt_spans,
            decode_shaped=decode_shaped,
        )

    @staticmethod
    def _mask(qlens, tree_index, batch, tb, tree_rows, device) -> torch.Tensor:
        """(T, W) int32 on the device: chains for plain chunks, the trees' own rows."""
        if len(tree_rows) == 1 and tree_rows[0][2] == len(batch.chunks):  # all trees, in order
            return tb.mask
        words = max(math.ceil(max(qlens) / 32), tb.mask.shape[1])
        host = torch.zeros(sum(qlens), words, dtype=torch.int32)
        row = 0
        for c, q in zip(batch.chunks, qlens, strict=True):
            if c.seq.request_id not in tree_index:
                bits = cached_chain(q)
                host[row : row + q, : bits.shape[1]] = bits
            row += q
        mask = to_device(host, device)
        n = tb.nodes
        for first, i0, k in tree_rows:  # device copies of the trees' rows, no host read
            mask[first : first + k * n, : tb.mask.shape[1]] = tb.mask[i0 * n : (i0 + k) * n]
        return mask
