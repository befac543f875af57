"""The drafters behind one interface: per-position distributions for the next L positions.

    source.propose_batch(seqs, depth, device) -> (B, L, V) fp32 logits on the device
    source.observe(request_id, start, hidden)   the target's hidden states of committed tokens

`NgramSource` needs nothing from the target. `DFlashSource` is handed, per sequence, the target's
hidden states (the configured layers' outputs, concatenated) of every token its KV cache gains,
as chunks and accepted tree paths commit; it keeps the drafter's keys/values of them
(`DraftContextCache`: each row projected once) and drafts from the last `window` of them with the
sequence's last token (the round's root, not yet in the cache) as block position 0. On a GPU with
CUDA graphs, `DFlashSource.capture` captures the draft forward per batch bucket
(engine/draft_graphs.py): a round is then the context projection, one copy per request into the
fixed input buffer, and one replay; otherwise (CPU, no graphs, a batch past every bucket, a
context past the captured width) it runs eagerly over the contexts padded to the longest.
"""

from __future__ import annotations

from pathlib import Path

import torch

from treeverify.engine.draft_context import DraftContextCache
from treeverify.engine.sequence import Sequence
from treeverify.kernels.staging import to_device
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

    def __init__(self, drafter, window: int = 2048):
        self.drafter = drafter
        self.target_layer_ids = list(drafter.target_layer_ids)
        self.window = window
        self.context = DraftContextCache(drafter, window)  # request -> keys/values of its rows
        self.graphs = None  # DraftGraphs once captured (a GPU with CUDA graphs)

    def capture(self, batch_sizes: list[int], depths: list[int], max_context: int,
                device: torch.device) -> list[dict]:  # fmt: skip
        """Capture the draft forward per batch bucket and depth over contexts of at most
        min(window, max_context) rows (a context never holds more than the target's max
        context); returns the per-bucket report."""
        from treeverify.engine.draft_graphs import DraftGraphs

        width = min(self.window, max_context)
        self.graphs = DraftGraphs(self.drafter, batch_sizes, depths, width, device)
        self.context.capture_projection(device, max_rows=max(batch_sizes) * (max(depths) + 1))
        return self.graphs.report

    def observe(self, request_id: str, start: int, hidden: torch.Tensor) -> None:
        """Rows for cache positions start.. (earlier rows past `start` were recomputed or
        rejected: dropped). `hidden` must not be overwritten later (the caller copies graph
        outputs once per step)."""
        self.context.observe(request_id, start, hidden)

    def forget(self, request_id: str) -> None:
        self.context.forget(request_id)

    @torch.inference_mode()
    def propose_batch(self, seqs: list[Sequence], depth: int, device) -> torch.Tensor:
        """(B, L, V): every sequence's last `window` context rows' keys/values (rows committed
        since its last round projected first, all sequences in one call), one draft: a graph
        replay when captured (the result is then a view of the graph's output, overwritten by
        the next round), else eager over the contexts padded to the longest."""
        self.context.project([s.request_id for s in seqs])
        kvs, firsts = [], []
        for seq in seqs:
            held = self.context.keys_values(seq.request_id)
            if held is None:
                raise RuntimeError(f"dflash: no target hidden states for {seq.request_id}")
            kv, first = held  # (C_b, n_layers, 2, Hkv, D), position of row 0
            if first + kv.shape[0] != seq.num_cached_tokens:
                raise RuntimeError(
                    f"dflash context of {seq.request_id}: rows end at position "
                    f"{first + kv.shape[0]}, the cache holds {seq.num_cached_tokens} tokens"
                )
            kvs.append(kv)
            firsts.append(first)
        if self.graphs is not None:
            tokens, starts = [s.last_token_id for s in seqs], [s.num_cached_tokens for s in seqs]
            logits = self.graphs.propose(kvs, tokens, starts, depth)
            if logits is not None:
                return logits
        dev = kvs[0].device
        padded = torch.nn.utils.rnn.pad_sequence(kvs, batch_first=True)  # (B, C, nl, 2, Hkv, D)
        meta = torch.tensor(
            [
                [kv.shape[0] for kv in kvs],
                [s.last_token_id for s in seqs],
                [s.num_cached_tokens for s in seqs],
            ],
        )
        meta = to_device(meta, dev)  # (3, B): context lengths, roots, the blocks' first positions
        return self.drafter.propose_from_kv(padded, meta[0], meta[1], meta[2], depth)


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
