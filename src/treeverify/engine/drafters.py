"""The drafters behind one interface: per-position distributions for the next L positions.

    source.propose_batch(seqs, depth, device) -> (B, L, V) fp32 logits on the device
    source.observe(request_id, start, hidden)   the target's hidden states of committed tokens

`NgramSource` needs nothing from the target. `DFlashSource` keeps, per sequence, the target's
hidden states (the configured layers' outputs, concatenated) of every token in its KV cache,
appended as chunks and accepted tree paths commit; the drafter runs on the last `window` of them
with the sequence's last token (the round's root, not yet in the cache) as block position 0.
"""

from __future__ import annotations

from pathlib import Path

import torch

from treeverify.engine.sequence import Sequence
from treeverify.models.shipped import SHIPPED_DRAFTERS, own_drafter, shipped_dir
from treeverify.spec.ngram import NgramDrafter


class NgramSource:
    name = "ngram"
    target_layer_ids: list[int] = []

    def __init__(self, vocab_size: int):
        self.drafter = NgramDrafter(vocab_size)

    def propose_batch(self, seqs: list[Sequence], depth: int, device) -> torch.Tensor:
        """(B, L, V) on `device`: the votes are found on the host and sent as (b, d, token)
        triples (a few hundred bytes), the distributions are built on the device."""
        votes = [(b, d, t) for b, s in enumerate(seqs)
                 for d, t in self.drafter.votes(s.all_token_ids, depth)]  # fmt: skip
        v = torch.tensor(votes, dtype=torch.int64).reshape(-1, 3)  # (K, 3)
        return self.drafter.logits_from_votes(v, len(seqs), depth, device)

    def observe(self, request_id: str, start: int, hidden: torch.Tensor) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass


class DFlashSource:
    name = "dflash"

    MAX_PENDING = 64  # observed chunks kept as a list before they are joined (bounds memory)

    def __init__(self, drafter, window: int = 2048):
        self.drafter = drafter
        self.target_layer_ids = list(drafter.target_layer_ids)
        self.window = window
        # request -> joined rows (cached tokens, F), plus chunks observed since (joined lazily:
        # a plain decode step, e.g. at adaptive budget 0, then costs a list append, not a cat
        # of the whole context per request)
        self.context: dict[str, torch.Tensor] = {}
        self._pending: dict[str, list[torch.Tensor]] = {}
        self._rows: dict[str, int] = {}

    def observe(self, request_id: str, start: int, hidden: torch.Tensor) -> None:
        """Rows for cache positions start.. (earlier rows past `start` were recomputed or
        rejected: dropped). `hidden` must not be overwritten later (the caller copies graph
        outputs once per step)."""
        have = self._rows.get(request_id, 0)
        if start > have:
            raise RuntimeError(f"dflash context of {request_id}: {have} rows, "
                               f"chunk starts at {start}")  # fmt: skip
        if start < have:
            self.context[request_id] = self.rows(request_id)[:start]
        parts = self._pending.setdefault(request_id, [])
        parts.append(hidden)
        self._rows[request_id] = start + hidden.shape[0]
        if len(parts) >= self.MAX_PENDING:
            self.rows(request_id)

    def rows(self, request_id: str) -> torch.Tensor | None:
        """The request's context rows (cached tokens, F), joined now if chunks are pending."""
        parts = self._pending.pop(request_id, None)
        have = self.context.get(request_id)
        if parts:
            have = torch.cat(parts if have is None else [have, *parts])
            self.context[request_id] = have
        return have

    def forget(self, request_id: str) -> None:
        self.context.pop(request_id, None)
        self._pending.pop(request_id, None)
        self._rows.pop(request_id, None)

    @torch.inference_mode()
    def propose_batch(self, seqs: list[Sequence], depth: int, device) -> torch.Tensor:
        """(B, L, V): every sequence's last `window` context rows, padded, in one drafter call."""
        ctxs = []
        for seq in seqs:
            ctx = self.rows(seq.request_id)
            if ctx is None or ctx.shape[0] == 0:
                raise RuntimeError(f"dflash: no target hidden states for {seq.request_id}")
            ctxs.append(ctx[-self.window :])  # (C_b, F)
        dev = ctxs[0].device
        padded = torch.nn.utils.rnn.pad_sequence(ctxs, batch_first=True)  # (B, C, F)
        lens = [c.shape[0] for c in ctxs]
        meta = torch.tensor(
            [
                lens,
                [s.last_token_id for s in seqs],
                [s.num_cached_tokens - n for s, n in zip(seqs, lens, strict=True)],
            ],
        ).to(dev)  # (3, B): context lengths, roots, positions of context row 0
        return self.drafter.propose(padded, meta[0], meta[1], depth, context_start=meta[2])


def make_source(
    path: str, model: torch.nn.Module, config, dtype, device
) -> NgramSource | DFlashSource:
    """ "ngram", "tiny-dflash" (a seeded drafter for tiny targets, tests), a shipped drafter
    ("tiny-code-dflash") or a DFlash directory."""
    if path == "ngram":
        return NgramSource(config.vocab_size)
    from treeverify.spec.dflash_io import load_dflash, tiny_dflash

    embed, head = model.model.embed_tokens, model.lm_head
    if path == "tiny-dflash":
        drafter = tiny_dflash(config, target_embed=embed, target_lm_head=head, dtype=dtype)
        drafter = drafter.to(device)
    elif shipped_dir(path) is not None or Path(path).is_dir():
        directory = shipped_dir(path) or path
        drafter = load_dflash(directory, embed, head, dtype=dtype, device=device)
    else:
        raise ValueError(
            f"speculative_draft_model_path: expected 'ngram', 'tiny-dflash', a shipped drafter "
            f"({', '.join(SHIPPED_DRAFTERS)}) or a DFlash directory, got {path!r}"
        )
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < config.num_hidden_layers]
    if bad:
        raise ValueError(f"speculative_draft_model_path: the drafter taps target layers {bad} "
                         f"outside 0..{config.num_hidden_layers - 1}")  # fmt: skip
    return DFlashSource(drafter.eval())


def resolve_drafter(path: str | None, model: str) -> str:
    """The drafter to use when speculating: `path` if given, else the model's own shipped drafter
    (tiny-code -> tiny-code-dflash), else the weight-free n-gram drafter."""
    if path is not None:
        return path
    return own_drafter(model) or "ngram"


def default_depth(source: NgramSource | DFlashSource) -> int:
    """Draft depth when none is given: a DFlash drafter's whole block (block_size - 1), the
    n-gram drafter's 4."""
    if isinstance(source, DFlashSource):
        return source.drafter.block_size - 1
    return 4
