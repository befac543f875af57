"""The drafters behind one interface: per-position distributions for the next L positions.

    source.propose_batch(seqs, depth, device) -> (B, L, V) logits on the device
                                                  (fp32; DFlash on CUDA: the lm_head's bf16)
    source.observe(request_id, start, hidden)   the target's hidden states of committed tokens

`NgramSource` needs nothing from the target (its whole rounds keep each request's newest tokens
in device rings, engine/ngram_rings.py). `DFlashSource` is handed, per sequence, the target's
hidden states (the configured layers' outputs, concatenated) of every token its KV cache gains,
as chunks and accepted tree paths commit; it keeps the drafter's keys/values of them
(`DraftContextCache`: each row projected once, into one ring per request in a device store) and
drafts from the newest `window` of them with the sequence's last token (the round's root, not yet
in the cache) as block position 0. On a GPU with CUDA graphs, `DFlashSource.capture` fixes the
store and captures the draft forward per batch bucket (engine/draft_graphs.py): a round is then
the projection of the rows committed since the last one, one small copy and one replay that reads
the rings in place; otherwise (CPU, no graphs, a batch past every bucket) the same draft runs
eagerly.
"""

from __future__ import annotations

from pathlib import Path

import torch

from treeverify.engine.draft_context import DraftContextCache
from treeverify.engine.ngram_rings import NgramTokenRings
from treeverify.engine.sequence import Sequence
from treeverify.kernels.staging import to_device
from treeverify.models.layers import ROPE_TABLE_SLACK
from treeverify.models.shipped import SHIPPED_DRAFTERS, own_drafter, shipped_dir
from treeverify.spec.ngram import NgramDrafter


class NgramSource:
    name = "ngram"
    target_layer_ids: list[int] = []

    def __init__(self, vocab_size: int):
        self.drafter = NgramDrafter(vocab_size)
        d = self.drafter  # whole rounds draft on the device from these (bit-identical logits)
        self.context = NgramTokenRings(vocab_size, d.window, d.max_n, d.floor)

    def capture(self, max_requests: int, device: torch.device) -> None:
        """Fix the token rings (one per request) for captured whole rounds."""
        self.context.fix(max_requests, device)

    def logits_dtype(self) -> torch.dtype:
        """The n-gram drafter's distributions are fp32."""
        return torch.float32

    def propose_batch(self, seqs: list[Sequence], depth: int, device) -> torch.Tensor:
        """(B, L, V) on `device`: the votes are found on the host and sent as (b, d, token)
        triples (a few hundred bytes), the distributions are built on the device."""
        votes = [(b, d, t) for b, s in enumerate(seqs)
                 for d, t in self.drafter.votes(s.tail_token_ids(self.drafter.window),
                                                depth)]  # fmt: skip
        v = torch.tensor(votes, dtype=torch.int64).reshape(-1, 3)  # (K, 3)
        return self.drafter.logits_from_votes(v, len(seqs), depth, device)

    def observe(self, request_id: str, start: int, hidden: torch.Tensor) -> None:
        pass

    def forget(self, request_id: str) -> None:
        self.context.forget(request_id)


class DFlashSource:
    name = "dflash"

    def __init__(self, drafter, window: int = 2048):
        self.drafter = drafter
        self.target_layer_ids = list(drafter.target_layer_ids)
        self.window = window
        self.context = DraftContextCache(drafter, window)  # request -> keys/values of its rows
        self.graphs = None  # DraftGraphs once captured (a GPU with CUDA graphs)

    def capture(self, batch_sizes: list[int], depths: list[int], max_context: int,
                device: torch.device, max_requests: int) -> list[dict]:  # fmt: skip
        """Fix the context store (a ring for each of `max_requests` requests, the window clipped
        to `max_context`: a context never holds more than the target's max context) and capture
        the draft forward per batch bucket and depth; returns the per-bucket report."""
        from treeverify.engine.draft_graphs import DraftGraphs

        self.context.fix(max_requests, device, window=max_context)
        self.graphs = DraftGraphs(self.context, batch_sizes, depths, device)
        self.context.capture_projection(device, max_rows=max(batch_sizes) * (max(depths) + 1))
        return self.graphs.report

    def logits_dtype(self) -> torch.dtype:
        """The drafter's (bf16 on CUDA when nothing rescales them, else fp32)."""
        return self.drafter.logits_dtype()

    def observe(self, request_id: str, start: int, hidden: torch.Tensor) -> None:
        """Rows for cache positions start.. (earlier rows past `start` were recomputed or
        rejected: dropped). `hidden` must not be overwritten later (the caller copies graph
        outputs once per step)."""
        self.context.observe(request_id, start, hidden)

    def forget(self, request_id: str) -> None:
        self.context.forget(request_id)

    @torch.inference_mode()
    def propose_batch(self, seqs: list[Sequence], depth: int, device) -> torch.Tensor:
        """(B, L, V): every sequence's newest `window` context rows (rows committed since its
        last round projected first, all sequences in one call), read in place from the rings by
        one draft: a graph replay when captured (the result is then a view of the graph's
        output, overwritten by the next round), else eager."""
        rids = [s.request_id for s in seqs]
        self.context.project(rids)
        tokens = [s.last_token_id for s in seqs]
        meta = self.context.draft_meta(rids, tokens)  # (4, B): rows, roots, ends, slots
        for seq, end in zip(seqs, meta[2], strict=True):
            if end != seq.num_cached_tokens:
                raise RuntimeError(
                    f"dflash context of {seq.request_id}: rows end at position "
                    f"{end}, the cache holds {seq.num_cached_tokens} tokens"
                )
        if self.graphs is not None:
            logits = self.graphs.propose(rids, tokens, depth)
            if logits is not None:
                return logits
        dev = self.context.kv.device
        rows = self.context.eager_rows(meta[2])
        return self.context.draft(to_device(torch.tensor(meta), dev), depth, rows)


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
    drafter = drafter.eval().fuse_for_inference()
    # its block and context rows sit where the target's positions do (models/layers.py)
    drafter.rope.tabulate(config.max_position_embeddings + ROPE_TABLE_SLACK, dtype, device)
    return DFlashSource(drafter)


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
