"""What `LLM` tells the outside about itself: load, speculation counters, graph info, MoE balance,
and the two hooks a benchmark needs to time forwards on its own.

A mixin of `LLM` (engine/llm.py), so the server and the benchmarks ask the engine rather than
reaching into its scheduler, block manager, model, runner, drafter or budget controller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from treeverify.engine.drafters import DFlashSource

if TYPE_CHECKING:
    from treeverify.engine.block_manager import BlockManager
    from treeverify.engine.budget_controller import BudgetController
    from treeverify.engine.config import EngineConfig
    from treeverify.engine.kv_cache import KVCache
    from treeverify.engine.model_runner import ModelRunner
    from treeverify.engine.paged_attention import PagedAttention
    from treeverify.engine.scheduler import Scheduler
    from treeverify.engine.speculative import SpeculativeDecoder


@dataclass(frozen=True)
class EngineUsage:
    """A snapshot of the engine's load (for /server_info and /metrics)."""

    running: int  # requests admitted (holding pages)
    waiting: int  # requests queued (new, or preempted and waiting to re-prefill)
    used_pages: int  # KV pages held by requests
    num_pages: int  # KV pages in the pool


@dataclass(frozen=True)
class ForwardParts:
    """BENCHMARKS ONLY: what capturing and timing a forward outside the step loop needs."""

    model: torch.nn.Module
    attention: PagedAttention  # the engine's attention seam over the paged cache
    cache: KVCache


class Introspection:
    """Read-only reports of `LLM` (and `reset_stats`, which zeroes counters only)."""

    config: EngineConfig
    scheduler: Scheduler
    block_manager: BlockManager
    model: torch.nn.Module
    runner: ModelRunner
    cache: KVCache
    spec: SpeculativeDecoder | None
    controller: BudgetController | None

    def usage(self) -> EngineUsage:
        """Running and waiting requests, KV pages used of the pool."""
        sched, bm = self.scheduler, self.block_manager
        return EngineUsage(len(sched.running), len(sched.waiting), bm.num_used_pages, bm.num_pages)

    def moe_imbalance(self) -> float | None:
        """max/mean tokens per expert since startup, worst MoE layer (0.0 before any token);
        None when the model has no MoE layers. Reads the device counters: one sync."""
        counts = getattr(self.model, "moe_expert_counts", None)
        if counts is None:
            return None
        c = counts.float()  # (layers, experts)
        mean = c.mean(-1)
        ratio = (c.amax(-1) / mean.clamp_min(1e-9))[mean > 0]
        return float(ratio.max()) if ratio.numel() else 0.0

    def reset_stats(self, *, forget_acceptance: bool = False) -> None:
        """Zero the speculation counters (rounds, accept lengths, phase times, the controller's
        steps per budget). `forget_acceptance`: the adaptive controller also forgets what it
        learnt of acceptance (its measured cost curve stays): the next request starts cold."""
        if self.spec is not None:
            self.spec.reset_stats()
        if self.controller is not None:
            if forget_acceptance:
                self.controller.reset()
            self.controller.steps_by_budget = dict.fromkeys(self.controller.buckets, 0)

    @property
    def spec_stats(self) -> dict | None:
        """Speculation counters for /server_info, or None when speculation is off."""
        if self.spec is None:
            return None
        st = self.spec.stats
        return {
            "algorithm": self.spec.algorithm,
            "drafter": self.spec.drafter_name,
            "budget": self.spec.budget,
            "adaptive": None if self.controller is None else self.controller.info(),
            "num_draft_tokens": self.spec.depth,
            "rounds": st.rounds,
            "avg_spec_accept_length": round(st.avg_accept_length, 4),
            "accept_length_histogram": dict(sorted(st.histogram.items())),
            "phase_seconds": {k: round(v, 6) for k, v in st.phase_seconds.items()},
            # whole-round graph replays (engine/round_graphs.py) and their wall time
            "whole_round_steps": st.whole_round_steps,
            "whole_round_seconds": round(st.whole_round_seconds, 6),
            # rounds of the general path: wall time, the verify forwards' device time, the
            # rest's share
            "round_seconds": round(st.round_seconds, 6),
            "forward_seconds": round(st.forward_seconds, 6),
            "outside_forward_share": round(1 - st.forward_seconds / st.round_seconds, 4)
            if st.round_seconds
            else None,
            # a DFlash drafter's context: lazy projection, rows from the feed ring, spills
            "draft_context": self.spec.source.context.info
            if isinstance(self.spec.source, DFlashSource)
            else None,
        }

    @property
    def cuda_graph_info(self) -> dict:
        """For /server_info: what was captured, how long it took, replays so far (the DFlash
        draft's graphs under "draft")."""
        if self.runner.graphs is None:
            why = "disabled" if self.config.on_gpu else "CPU (eager)"
            info = {"enabled": False, "buckets": [], "reason": why}
        else:
            info = dict(self.runner.graphs.info)
            draft = None if self.spec is None else getattr(self.spec.source, "graphs", None)
            if draft is not None:
                info["draft"] = draft.info
            if self.rounds is not None:
                info["rounds"] = self.rounds.info
        if self.ahead is not None:  # (on the CPU: eager steps launched ahead, when asked for)
            info["decode_ahead"] = self.ahead.info
        return info

    # ---- benchmark hooks -------------------------------------------------------------------------
    def captured_graph(
        self, batch: int, tokens_per_request: int = 1
    ) -> torch.cuda.CUDAGraph | None:
        """BENCHMARKS ONLY: the captured forward a decode-shaped step of `batch` requests with
        `tokens_per_request` tokens each replays (1: plain decode, a tree size: a verify), or None
        without graphs. Replaying it reruns the last step planned into that bucket."""
        graphs = self.runner.graphs
        if graphs is None:
            return None
        bucket = graphs.bucket_for(batch, tokens_per_request)
        return None if bucket is None else graphs.steps[bucket].graph

    def forward_parts(self) -> ForwardParts:
        """BENCHMARKS ONLY: the model, the attention seam and the KV cache, to capture and time
        forwards over hand-made batches (bench/engine.py `verify_forward`); serving never needs
        them."""
        return ForwardParts(self.model, self.runner.attention, self.cache)
