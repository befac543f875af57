"""One speculative round for the decoding sequences of a step (DDTree or a single chain).

Per decoding sequence: the drafter proposes per-position distributions for the next L tokens,
`treeverify.spec.build_tree` picks the best `budget` nodes (DDTree, Algorithm 1; CHAIN keeps one
path of the same size), the tree's nodes get reserved KV slots after the sequence's current
position, the model verifies every node in the step's single forward (tree attention), the walk
accepts the longest path the target agrees with, the accepted nodes' K/V are moved to
contiguous positions, and the reservation is committed (rejected slots freed).

The root of each tree is the sequence's last token (not yet in the KV cache), so a round commits
`accepted nodes + 1` tokens (the bonus comes from the target at the last accepted node).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from treeverify.engine import faults
from treeverify.engine.block_manager import BlockManager
from treeverify.engine.drafters import DFlashSource, NgramSource
from treeverify.engine.kv_cache import KVCache
from treeverify.engine.sequence import Sequence
from treeverify.spec import accept_greedy, accept_sampled, build_tree, parents_to_tree_mask
from treeverify.spec.tree_oracle import build_tree_host


@dataclass
class SpecTree:
    """A sequence's tree for this step (host lists; node 0 = the root = its last token)."""

    tokens: list[int]  # (T,)
    parents: list[int]  # (T,), parents[0] = -1
    depths: list[int]  # (T,)
    slots: list[int]  # (T,) KV slot of each node: node i at position P + i
    mask: torch.Tensor  # (T, W) int32 ancestor-or-self bits
    accepted_path: list[int] | None = None  # after accept: node indices committed, root first


PHASES = ("draft", "build", "verify", "accept", "commit")


@dataclass
class SpecStats:
    rounds: int = 0
    committed: int = 0  # tokens committed by rounds, bonus included
    histogram: dict[int, int] | None = None
    # Host wall seconds per round phase, summed ("verify" is the step's forward, set by the LLM).
    phase_seconds: dict[str, float] | None = None

    @property
    def avg_accept_length(self) -> float:
        return self.committed / self.rounds if self.rounds else 0.0


class SpeculativeDecoder:
    def __init__(
        self,
        block_manager: BlockManager,
        cache: KVCache,
        vocab_size: int,
        *,
        algorithm: str = "DDTREE",
        budget: int = 16,
        depth: int = 4,
        source: NgramSource | DFlashSource | None = None,
    ):
        if algorithm not in ("DDTREE", "CHAIN"):
            raise ValueError(f"algorithm: expected DDTREE or CHAIN, got {algorithm!r}")
        if not 1 <= budget <= 1024 or depth < 1:
            raise ValueError(f"budget/depth: expected 1..1024 / >= 1, got {budget}/{depth}")
        self.bm, self.cache = block_manager, cache
        self.algorithm, self.budget, self.depth = algorithm, budget, depth
        self.source = source or NgramSource(vocab_size)
        self.drafter_name = self.source.name
        self.vocab_size = vocab_size
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = SpecStats(histogram={}, phase_seconds=dict.fromkeys(PHASES, 0.0))

    @property
    def tree_tokens(self) -> int:
        """Nodes of every round's tree, root included (the captured verify bucket's n)."""
        if self.algorithm == "CHAIN":
            return 1 + min(self.depth, self.budget)
        return 1 + min(self.budget, self.depth * self.vocab_size)

    def _time(self, phase: str, t0: float) -> float:
        now = time.perf_counter()
        self.stats.phase_seconds[phase] += now - t0
        return now

    def wants(self, seq: Sequence) -> bool:
        """Per-request opt-out; logprob requests run plain decoding (one token per step)."""
        p = seq.sampling_params
        return p.speculative and p.logprobs is None

    def draft(self, seq: Sequence) -> SpecTree | None:
        """Build and reserve a tree for a decoding sequence; None when its pages do not fit."""
        t0 = time.perf_counter()
        depth = self.depth if self.algorithm == "DDTREE" else min(self.depth, self.budget)
        logits = self.source.propose(seq, depth)  # (L, V), host (n-gram) or device (DFlash)
        t0 = self._time("draft", t0)
        if self.algorithm == "CHAIN":  # one path: the top token at each depth
            tokens = [seq.last_token_id, *logits.argmax(-1).tolist()]  # one read
            parents = list(range(-1, len(tokens) - 1))
        else:
            # A host drafter's logits build on the host with the heap (Algorithm 1 as published,
            # equal node for node to the batched GPU build, and cheaper for one small tree);
            # device logits use the capture-safe GPU build.
            build = build_tree_host if logits.device.type == "cpu" else build_tree
            tree = build(logits[None], self.budget, torch.tensor([seq.last_token_id],
                                                                 device=logits.device))  # fmt: skip
            n = int(tree.num_nodes[0])
            tokens = tree.tokens[0, :n].tolist()
            parents = tree.parents[0, :n].tolist()
        t = len(tokens)
        if t > 1 and not self.bm.can_allocate(seq, t - 1):
            return None
        root = seq.num_tokens - 1  # the root's position (its slot came with the decode chunk)
        if t > 1:
            self.bm.reserve(seq, t - 1)
        slots = [self.bm.slot(seq, root + i) for i in range(t)]
        par = torch.tensor([parents])  # (1, T)
        depths = [0] * t
        for i in range(1, t):
            depths[i] = depths[parents[i]] + 1
        tree = SpecTree(tokens, parents, depths, slots, parents_to_tree_mask(par))
        self._time("build", t0)
        return tree

    def accept(self, seq: Sequence, tree: SpecTree, logits: torch.Tensor) -> list[int]:
        """Walk the verified tree (logits (T, V)); move the accepted K/V; commit; the tokens."""
        t0 = time.perf_counter()
        t = len(tree.tokens)
        dev = logits.device
        toks = torch.tensor([tree.tokens], device=dev)  # (1, T)
        par = torch.tensor([tree.parents], device=dev)  # (1, T)
        p = seq.sampling_params
        if p.temperature == 0:
            acc = accept_greedy(toks, par, logits.argmax(-1)[None], max_depth=max(1, *tree.depths))
        else:
            gen = torch.Generator(device=dev).manual_seed(
                ((p.seed if p.seed is not None else hash(seq.request_id) & 0x7FFFFFFF) * 1_000_003
                 + seq.num_tokens) & 0x7FFF_FFFF_FFFF_FFFF
            )  # fmt: skip
            acc = accept_sampled(
                toks, par, logits[None], p.temperature, p.top_p if p.top_p < 1 else None,
                min(p.top_k, logits.shape[-1]) if p.top_k > 0 else None,  # k >= V: all tokens
                gen, max_depth=max(1, *tree.depths),
            )  # fmt: skip
        # one device->host read: [accepted nodes (root included), bonus, path...]
        head = torch.cat((acc.length[:1], acc.bonus[:1], acc.path[0])).tolist()
        m, bonus_token, path = head[0], head[1], head[2 : 2 + head[0]]
        t0 = self._time("accept", t0)
        if m > 1:  # node path[k] was written at slot of position P+path[k]; it belongs at P+k
            self.cache.move([tree.slots[i] for i in path[1:]], tree.slots[1:m])
        if t > 1:
            self.bm.commit(seq, m - 1)
        self._time("commit", t0)
        bonus = faults.diverge_bonus(bonus_token, logits.shape[-1])  # planted only
        committed = [tree.tokens[i] for i in path[1:]] + [bonus]
        tree.accepted_path = path
        self.stats.rounds += 1
        self.stats.committed += len(committed)
        self.stats.histogram[len(committed)] = self.stats.histogram.get(len(committed), 0) + 1
        return committed
