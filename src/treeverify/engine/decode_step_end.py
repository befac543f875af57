"""The end of a decode step launched ahead (engine/decode_ahead.py): the tokens (greedy, or each
row sampled by its staged temperature and draw key) and the advance of the bucket's stage to the
next step, in two Triton launches instead of ~7 kernels (greedy) or ~25 (sampled).

In PyTorch the step's end is an argmax over the vocabulary (one or two reduction kernels for
(b, V) logits) and five small kernels of the advance (ids where valid, positions and prefix
lengths + 1, the new position's slot from the staged page table). Measured on the H200 the
step launched ahead runs ~50 us (vocabularies of 128-129k) / ~20 us (tiny-code's 8k) longer
than the forward alone (docs/performance.md, thirtieth session); these kernels are suspected.
Here:

    chunk_pick     grid (b, ceil(V / CHUNK)): each program the best of one chunk of a row and
                   its first index (engine/pick_kernels.py; a sampled row's Gumbel-max scores)
    finish         grid (b,): the row's token = the first chunk holding the row's max, its
                   index (so the first index of the max overall, as torch.argmax); then the
                   advance of that row (padding rows, valid 0, keep their inputs and take the
                   scratch slot)

On by default since measured on an H100 (greedy steps 2-6% faster than the PyTorch end,
thirty-sixth session; TREEVERIFY_FUSED_DECODE_STEP=0, or no Triton: DecodeAhead falls back to
the PyTorch ops, which are the reference: tests/test_decode_step_end_interpret.py compares
them on the CPU interpreter, ties across and within chunks included). NaN logits: torch.argmax
picks the first NaN, this the first finite max (a NaN row is a broken model either way).
"""

from __future__ import annotations

import functools

import torch

from treeverify.engine.pick_kernels import CHUNK, chunk_picks, pick_tokens_torch


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def finish(PV, PI, NC, Tok, Ids, Pos, Prefix, Valid, Table, Slots, page_size, pages,
               table_stride, scratch, NP: tl.constexpr):  # fmt: skip
        r = tl.program_id(0)
        chunks = tl.arange(0, NP)  # (NP,)
        v = tl.load(PV + r * NC + chunks, mask=chunks < NC, other=float("-inf"))
        best = tl.max(v, axis=0)
        k = tl.min(tl.where(v == best, chunks, NP), axis=0)  # the first chunk holding it
        k = tl.minimum(k, NC - 1)
        tok = tl.load(PI + r * NC + k)  # int64
        tl.store(Tok + r, tok)
        live = tl.load(Valid + r) != 0
        step = live.to(tl.int64)
        tl.store(Ids + r, tl.where(live, tok, tl.load(Ids + r)))
        tl.store(Pos + r, tl.load(Pos + r) + step)
        pre = tl.load(Prefix + r) + step.to(tl.int32)  # the new position
        tl.store(Prefix + r, pre)
        page_index = tl.minimum(pre // page_size, pages - 1)  # (never read past the pages held)
        page = tl.load(Table + page_index.to(tl.int64) * table_stride + r).to(tl.int64)
        slot = page * page_size + (pre % page_size).to(tl.int64)
        tl.store(Slots + r, tl.where(live, slot, scratch))

    return finish


def end_step(logits: torch.Tensor, v: dict[str, torch.Tensor], b: int, scratch: int,
             page_size: int, chunk: int = CHUNK,
             sampled: bool = False) -> torch.Tensor:  # fmt: skip
    """The (b,) tokens of `logits` (b, V) fp32 (greedy; with `sampled` each row by its staged
    temperature and draw key: engine/pick_kernels.py), and the stage twin `v` (StepStage.views)
    advanced in place to the next step (ids, positions, prefix lengths, slots of rows 0..b-1).
    Capture-safe (its workspace comes from the allocator: the graph's pool when captured)."""
    n, vocab = logits.shape
    if n != b or logits.stride(1) != 1:
        raise ValueError(f"logits: expected ({b}, V) with unit column stride, got "
                         f"{tuple(logits.shape)} strides {logits.stride()}")  # fmt: skip
    finish = _kernels()
    # the drawn token sits one past the input's position (v["pos"] before the advance)
    picks = (v["temp"], v["key"], v["pos"]) if sampled else (None, None, None)
    part_v, part_i = chunk_picks(logits, *picks, pos_offset=1, chunk=chunk)  # (b, nc) each
    nc = part_v.shape[1]
    tokens = torch.empty(b, dtype=torch.int64, device=logits.device)  # (b,)
    table = v["table"]  # (P, B) int32, pages-major
    finish[(b,)](part_v, part_i, nc, tokens, v["ids"], v["pos"], v["prefix"], v["valid"], table,
                 v["slots"], page_size, table.shape[0], table.stride(0), scratch,
                 NP=1 << max(0, (nc - 1).bit_length()))  # fmt: skip
    return tokens


def end_step_torch(logits: torch.Tensor, v: dict[str, torch.Tensor], b: int, scratch: int,
                   state, sampled: bool = False) -> torch.Tensor:  # fmt: skip
    """The same in PyTorch ops (the reference, and the default): the tokens, then the advance;
    `state` an engine/round_state.RoundState (its node-slot lookup)."""
    if sampled:  # each row by its staged temperature and key, at the next position
        tokens = pick_tokens_torch(logits, v["temp"][:b], v["key"][:b], v["pos"][:b], pos_offset=1)
    else:
        tokens = logits.argmax(-1)  # (b,) int64, the sampler's greedy choice
    valid = v["valid"][:b]  # (b,) int32: padding rows stay as they were
    ids = v["ids"][:b]  # (b,) int64
    ids.copy_(torch.where(valid != 0, tokens, ids))
    v["pos"][:b].add_(valid)
    v["prefix"][:b].add_(valid)
    state.node_slots(v, b, 1, scratch)  # position = the new prefix length
    return tokens
