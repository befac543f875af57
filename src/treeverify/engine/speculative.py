"""One speculative round for the decoding sequences of a step (DDTree or a single chain).

For all speculating sequences at once (`draft_batch` / `accept_batch`): reserve N-1 KV slots
after each sequence's current position; the drafter proposes per-position distributions for the
next L tokens in one call; one batched `treeverify.spec.build_tree` picks the best `budget` nodes
per sequence (DDTree, Algorithm 1; CHAIN keeps one path of the same size) and the tree masks are
compiled on the device; the model verifies every node in one forward (a captured graph per
(batch, N) bucket); the walks accept the longest paths the target agrees with, on the device;
the accepted nodes' K/V move to contiguous positions in one gather/scatter per cache tensor; one
host read returns the committed tokens, and the reservations are committed (rejected slots
freed). A step that mixes trees with prefill runs them in the same forward (engine/step_batch.py
puts each tree in its sequence's place, on the device) and accepts them with the same
`accept_batch`.

Greedy rounds of a DFlash drafter skip all of this host orchestration: engine/round_graphs.py
runs the same steps as one captured graph, and only `commit_rows` (shared) runs on the host.

The root of each tree is the sequence's last token (not yet in the KV cache), so a round commits
`accepted nodes + 1` tokens (the bonus comes from the target at the last accepted node).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from treeverify.engine.block_manager import BlockManager
from treeverify.engine.captured_fn import CapturedFn
from treeverify.engine.config import tree_nodes
from treeverify.engine.drafters import DFlashSource, NgramSource
from treeverify.engine.kv_cache import KVCache
from treeverify.engine.logits_processor import LogitsProcessor
from treeverify.engine.sampler import TokenLogprobs, draw_nodes, rows_logprobs
from treeverify.engine.sequence import Sequence
from treeverify.kernels.staging import take_rows, to_device
from treeverify.spec import (
    accept_greedy,
    build_tree,
    parents_to_tree_mask,
)


@dataclass
class TreeBatch:
    """The round's trees for B speculating sequences, on the device, fixed size N = budget + 1
    per tree (DDTree's padding nodes, when fewer rank paths exist, are never accepted)."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # (B, N) int64, node 0 = the root = each sequence's last token
    parents: torch.Tensor  # (B, N) int64, -1 for roots and padding
    depths: torch.Tensor  # (B, N) int64
    slots: torch.Tensor | None  # (B, N) int64 on the device: node i at position P_b + i;
    # None until needed (`device_slots`): a staged verify step leaves it in its stage's twin
    mask: torch.Tensor  # (B*N, W) int32 ancestor-or-self bits
    max_depth: int
    started: float  # perf_counter at the round's start
    budget: int = 0  # this round's tree budget (nodes besides the root)
    slots_host: torch.Tensor | None = None  # (B, N) int64 `slots` on the host (staged as is)
    paths: list[list[int]] = field(default_factory=list)  # after accept: committed nodes
    # after accept, per sequence: its committed tokens' logprobs (None unless it asked)
    logprobs: list[list[TokenLogprobs] | None] = field(default_factory=list)

    @property
    def nodes(self) -> int:
        return self.tokens.shape[1]

    def device_slots(self) -> torch.Tensor:
        """(B, N) slots on the device: the staged verify step's copy, else one upload."""
        if self.slots is None:
            self.slots = to_device(self.slots_host, self.tokens.device)
        return self.slots


PHASES = ("draft", "build", "verify", "accept", "commit")


@dataclass
class SpecStats:
    rounds: int = 0
    committed: int = 0  # tokens committed by rounds, bonus included
    histogram: dict[int, int] | None = None
    # Host wall seconds per round phase, summed ("verify" is the step's forward, set by the LLM).
    phase_seconds: dict[str, float] | None = None
    round_seconds: float = 0.0  # wall time of general-path rounds (draft start .. commit end)
    forward_seconds: float = 0.0  # the rounds' verify forwards: device time (CUDA events)
    # Whole-round replays (engine/round_graphs.py: no separate verify forward to time), not in
    # round_seconds: steps and their wall seconds
    whole_round_steps: int = 0
    whole_round_seconds: float = 0.0

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
        processor: LogitsProcessor | None = None,
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
        self.processor = processor  # penalties / logit_bias, shared with plain decoding
        # Set by capture() on a GPU, per budget (each a graph bucket): the build + mask compile,
        # and the greedy walk + K/V move (keyed by the tree's node count).
        self._build: dict[int, CapturedFn] = {}
        self._accept: dict[int, CapturedFn] = {}
        self._max_depth = depth
        self.reset_stats()

    def capture(self, batch_sizes: list[int], device: torch.device,
                budgets: list[int] | None = None) -> None:  # fmt: skip
        """Capture the DDTree build + mask compile and the greedy accept + K/V move per batch
        bucket and per budget (default: the configured one): one replay each instead of ~100
        small launches per round. (The drafter is not captured here: the n-gram search is host
        work; DFlash's draft forward is captured by `DFlashSource.capture` at the depths
        `draft_depth` gives, engine/draft_graphs.py.)"""
        for budget in budgets or [self.budget]:
            self._capture_budget(batch_sizes, device, budget)

    def _capture_budget(self, batch_sizes: list[int], device: torch.device, budget: int) -> None:
        n, depth, v = self.nodes_for(budget), self.depth, self.vocab_size
        if self.algorithm == "DDTREE":

            def build(logits, roots):
                return self.trees(logits, roots, budget)

            dtype = self.source.logits_dtype()  # the draft's own: no widening copy into it

            def example(b: int):
                return (torch.zeros(b, depth, v, dtype=dtype, device=device),
                        torch.zeros(b, dtype=torch.int64, device=device))  # fmt: skip

            self._build[budget] = CapturedFn(build, example, batch_sizes,
                                             rows_per_item=(1, 1, 1, n))  # fmt: skip
        self._max_depth = n - 1 if self.algorithm == "CHAIN" else depth
        scratch = self.cache.scratch_slot

        def example_accept(b: int):  # padding rows: lone roots at the scratch slot (no-op)
            z = torch.zeros(b, n, dtype=torch.int64, device=device)
            return z, z - 1, z.clone(), z + scratch

        self._accept[n] = CapturedFn(self._greedy_accept_move, example_accept, batch_sizes,
                                     rows_per_item=(1,))  # fmt: skip

    def reset_stats(self) -> None:
        self.stats = SpecStats(histogram={}, phase_seconds=dict.fromkeys(PHASES, 0.0))

    @property
    def tree_tokens(self) -> int:
        """Nodes of a round's tree at the configured (largest) budget, root included."""
        return self.nodes_for(self.budget)

    def nodes_for(self, budget: int) -> int:
        """Nodes of a budget-`budget` round's tree, root included (its verify bucket's n)."""
        return tree_nodes(self.algorithm, budget, self.depth)

    def draft_depth(self, budget: int) -> int:
        """L, the positions a budget-`budget` round drafts: the configured depth (DDTREE), the
        chain's length (CHAIN)."""
        return self.nodes_for(budget) - 1 if self.algorithm == "CHAIN" else self.depth

    def trees(self, logits: torch.Tensor, roots: torch.Tensor, budget: int):
        """The round's trees from the draft (B, L, V) and the roots (B,): tokens, parents,
        depths (B, N) int64 and the ancestor-or-self mask (B*N, W) int32. DDTREE: the best
        `budget` nodes (on CUDA the heap kernel writes the mask in the same launch); CHAIN: the
        top token at each depth. Capture-safe (the general path's captured build and the whole
        round's graph both run it)."""
        depth = self.draft_depth(budget)
        if self.algorithm == "CHAIN":
            b, n = roots.shape[0], self.nodes_for(budget)
            tokens = torch.cat((roots[:, None], logits.argmax(-1)), dim=1)  # (B, N)
            idx = torch.arange(n, device=roots.device)
            parents = (idx - 1).expand(b, n).contiguous()  # (B, N)
            depths = idx.expand(b, n).contiguous()  # (B, N)
            return tokens, parents, depths, parents_to_tree_mask(parents, max_depth=depth)
        tree = build_tree(logits, budget, roots, with_mask=True)
        mask = tree.mask  # (B*N, W), or None off CUDA: compiled from the parents
        if mask is None:
            mask = parents_to_tree_mask(tree.parents, max_depth=depth)
        return tree.tokens, tree.parents, tree.depths, mask

    def _time(self, phase: str, t0: float) -> float:
        now = time.perf_counter()
        self.stats.phase_seconds[phase] += now - t0
        return now

    def wants(self, seq: Sequence) -> bool:
        """The per-request opt-out (logprobs, penalties and logit_bias are all served
        speculatively, equal to plain decoding)."""
        return seq.sampling_params.speculative

    def draft_batch(self, seqs: list[Sequence], device: torch.device,
                    budget: int | None = None) -> TreeBatch | None:  # fmt: skip
        """Reserve N-1 slots per sequence (those whose pages fit), draft all of them in one
        drafter call and build every tree in one batched, sync-free `build_tree`. `budget`:
        this round's (1..the configured one; default the configured one)."""
        t_start = time.perf_counter()
        budget = self.budget if budget is None else budget
        if not 1 <= budget <= self.budget:
            raise ValueError(f"budget: expected 1..{self.budget}, got {budget}")
        n = self.nodes_for(budget)
        chosen = []
        for seq in seqs:
            if self.bm.can_allocate(seq, n - 1):
                self.bm.reserve(seq, n - 1)
                chosen.append(seq)
        if not chosen:
            return None
        depth = self.draft_depth(budget)
        logits = self.source.propose_batch(chosen, depth, device)  # (B, L, V)
        t0 = self._time("draft", t_start)
        roots = to_device(torch.tensor([s.last_token_id for s in chosen], dtype=torch.int64),
                          device)  # (B,) pinned, non-blocking: no stream sync  # fmt: skip
        if budget in self._build:
            tokens, parents, depths, mask = self._build[budget](logits, roots)  # one replay
        else:
            tokens, parents, depths, mask = self.trees(logits, roots, budget)  # (B, N).., (B*N, W)
        slots_host = self.bm.span_slots(chosen, [s.num_tokens - 1 for s in chosen], n)  # (B, N)
        self._time("build", t0)
        return TreeBatch(chosen, tokens, parents, depths, None, mask, depth, t_start, budget,
                         slots_host=slots_host)  # fmt: skip

    def _move_and_pack(self, tokens, parents, slots, path, length, bonus) -> torch.Tensor:
        """Move the accepted nodes' K/V to positions P+1.. (one fixed-shape gather/scatter per
        cache tensor) and pack (B, 2 + 2K) int64: [length, bonus, committed K, path K]."""
        k = min(path.shape[1], tokens.shape[1])
        path = path[:, :k]  # (B, K) accepted node per depth, -1 past the end
        node = path.clamp(min=0)
        keep = torch.arange(k, device=path.device)[None, :] < length[:, None]  # (B, K)
        dst = slots[:, :k]  # depth d of the path belongs at position P + d
        src = torch.where(keep, slots.gather(1, node), dst)  # (B, K) no-op past the end
        self.cache.move_slots(src.reshape(-1), dst.reshape(-1))
        committed = tokens.gather(1, node)  # (B, K)
        return torch.cat((length[:, None], bonus[:, None], committed, path), dim=1)

    def accept_move_pack(self, tokens, parents, posterior, slots, max_depth: int) -> torch.Tensor:
        """The greedy walk of (B, N) verified trees (posterior: each node's target token), the
        accepted K/V moved, the result packed as `_move_and_pack` packs it: (B, 2 + 2K) int64
        [length, bonus, committed K, path K] (whole rounds read length and bonus from it). With
        TREEVERIFY_FUSED_ACCEPT on a GPU: one kernel for the walk, the pack and the move's
        indices, one kernel a cache tensor for the move (~12 launches -> 3); else the walk, then
        `_move_and_pack`. Capture-safe either way."""
        from treeverify import env
        from treeverify.spec import walk_cuda

        if env.fused_accept() and walk_cuda.usable(tokens):
            packed, src, dst, _, _ = walk_cuda.walk_pack_cuda(
                tokens, parents, posterior, slots, max_depth)  # fmt: skip
            self.cache.move_rows(src, dst)
            return packed
        acc = accept_greedy(tokens, parents, posterior, max_depth=max_depth)
        return self._move_and_pack(tokens, parents, slots, acc.path, acc.length, acc.bonus)

    def _greedy_accept_move(self, tokens, parents, posterior, slots):
        return (self.accept_move_pack(tokens, parents, posterior, slots, self._max_depth),)

    def commit_rows(self, seqs: list[Sequence], rows: list[list[int]],
                    paths: list[list[int]]) -> list[list[int]]:  # fmt: skip
        """Commit a round's packed results read back to the host, one row per sequence
        [m, bonus, committed tokens K, path K]: the block manager keeps m - 1 reserved slots
        (the accepted nodes, root excluded), each path's m nodes are appended to `paths`.
        Returns each sequence's committed tokens (accepted nodes + bonus)."""
        k = (len(rows[0]) - 2) // 2 if rows else 0
        out = []
        hist = self.stats.histogram
        for seq, row in zip(seqs, rows, strict=True):
            m = row[0]
            self.bm.commit(seq, m - 1)
            toks = row[2 : 2 + m][1:] + [row[1]]
            out.append(toks)
            paths.append(row[2 + k : 2 + k + m])
            hist[len(toks)] = hist.get(len(toks), 0) + 1
            self.stats.committed += len(toks)
        self.stats.rounds += len(out)
        return out

    @staticmethod
    def _round_logprobs(tb: TreeBatch, logits: torch.Tensor,
                        out: list[list[int]]) -> list[list[TokenLogprobs] | None]:  # fmt: skip
        """Per request, its committed tokens' logprobs (None: not asked). Lossless acceptance
        drew committed token j from the row of path node j: its logprobs are that row's (the
        rows were processed as plain decoding's are). Every asking request's rows gathered by
        one pinned index and read once (logits (B, N, V))."""
        want = [i for i, s in enumerate(tb.seqs) if s.sampling_params.logprobs is not None]
        result: list[list[TokenLogprobs] | None] = [None] * len(tb.seqs)
        if not want:
            return result
        b, n, v = logits.shape
        flat = [i * n + node for i in want for node in tb.paths[i]]
        rows = take_rows(logits.reshape(b * n, v), flat)  # (M, V)
        ks = [tb.seqs[i].sampling_params.logprobs for i in want for _ in tb.paths[i]]
        infos = rows_logprobs(rows, [t for i in want for t in out[i]], ks)
        at = 0
        for i in want:
            result[i], at = infos[at : at + len(out[i])], at + len(out[i])
        return result

    def accept_batch(self, tb: TreeBatch, logits: torch.Tensor) -> list[list[int]]:
        """Walk every verified tree (logits (B*N, V)) on the device, move the accepted K/V,
        read the results once, commit on the host. Returns each sequence's committed tokens
        (accepted nodes + bonus). All-greedy batches replay one captured graph on a GPU."""
        t0 = time.perf_counter()
        b, n = tb.tokens.shape
        logits = logits.view(b, n, -1)  # (B, N, V)
        if self.processor is not None and self.processor.needed(tb.seqs):
            # each node with the counts of the committed tokens plus its own path's
            logits = self.processor.apply(logits, self.processor.rows(tb.seqs), tb.tokens,
                                          tb.parents, tb.max_depth)  # fmt: skip
        greedy = all(s.sampling_params.temperature == 0 for s in tb.seqs)
        self._max_depth = tb.max_depth
        if greedy and n in self._accept:
            packed = self._accept[n](tb.tokens, tb.parents, logits.argmax(-1),
                                     tb.device_slots())[0]  # fmt: skip
        else:
            # every node's own draw (a sampled request's node at depth d: plain decoding's draw
            # for the token d places on), then one walk for the whole batch
            posterior = draw_nodes(logits, tb.depths, tb.max_depth, tb.seqs)  # (B, N)
            packed = self.accept_move_pack(tb.tokens, tb.parents, posterior, tb.device_slots(),
                                           tb.max_depth)  # fmt: skip
        t0 = self._time("accept", t0)
        out = self.commit_rows(tb.seqs, packed.tolist(), tb.paths)  # the round's one read
        tb.logprobs.extend(self._round_logprobs(tb, logits, out))
        now = self._time("commit", t0)
        self.stats.round_seconds += now - tb.started
        return out
