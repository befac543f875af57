"""The speculative half of `LLM`'s step (a mixin): which budget this step's speculating requests
run at (pinned, the adaptive controller's, or the configured one), whether the step is one
whole-round replay (engine/round_graphs.py: greedy DFlash rounds, the next one launched ahead)
or drafted trees verified in the step's forward, and handing each round's accepted path to the
controller. Split out of engine/llm.py; the state it reads (spec, rounds, controller, runner)
is the engine's.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from treeverify.engine.budget_controller import FAST, GENERAL
from treeverify.engine.scheduler import ScheduledBatch
from treeverify.engine.sequence import Sequence

if TYPE_CHECKING:
    from treeverify.engine.budget_controller import BudgetController
    from treeverify.engine.decode_ahead import DecodeAhead
    from treeverify.engine.logits_processor import LogitsProcessor
    from treeverify.engine.round_graphs import RoundGraphs
    from treeverify.engine.speculative import SpeculativeDecoder, TreeBatch


class SpeculativeSteps:
    """Mixed into `LLM`: the step's speculative decisions and rounds."""

    spec: SpeculativeDecoder | None
    rounds: RoundGraphs | None
    ahead: DecodeAhead | None
    controller: BudgetController | None
    processor: LogitsProcessor

    def _speculative_step(self, batch: ScheduledBatch) -> tuple[list | None, TreeBatch | None]:
        """The speculating requests' part of a step: their budget (pinned by a request, else the
        controller's, else the configured one; a round launched ahead at another budget is taken
        first), then one whole-round replay for every decode when the step allows it (the step's
        tokens, prefill chunks after the replay in their own forward), else their drafted trees
        `tb` for the step's forward. Returns (tokens or None, tb)."""
        want = [c.seq for c in batch.decodes if c.samples and self.spec.wants(c.seq)]
        budget = self.spec.budget
        pinned = [p for s in want if (p := s.sampling_params.speculative_budget) is not None]
        if want and self.controller is not None:  # its costs' path, also read by _plan_next
            self._step_path = self._cost_path(want)
        if pinned:  # a request pinned its budget (SamplingParams.speculative_budget)
            budget = max(pinned)
        elif want and self.controller is not None:
            budget = self._controller_budget(want)
        ahead = not batch.prefills  # a new request joins next step: nothing to launch
        running = self.rounds.ahead_budget(want) if self.rounds is not None else None
        if running is not None and running != budget and not pinned:
            # the round launched ahead at the last budget runs already: take it, switch next
            budget, ahead = running, False
        self.last_budget = budget if want else None
        if budget and want and self.ahead is not None:
            # rounds this step: a plain step launched ahead gives its held pages back first (a
            # round launched ahead below holds its own; a later release would take those)
            self.ahead.discard()
        if budget and want and len(want) == len(batch.decodes):
            nxt = budget
            lookahead = self.rounds is not None and self.rounds.lookahead
            if ahead and lookahead and not pinned and self.controller is not None:
                nxt = self._plan_next(want)  # the round launched ahead runs at it
                ahead = nxt > 0  # (plain decoding next: nothing to launch)
            out = self._whole_round(want, budget, ahead, nxt)  # every decode: one replay
            if out is not None:
                if not batch.prefills:
                    self._step_budget = budget
                    return out, None
                # prefill chunks beside the rounds: their own forward after the replay
                # (the step's sampled order is decodes, then prefills)
                return out + self._forward(ScheduledBatch(prefills=batch.prefills), None), None
        if self.rounds is not None:
            self.rounds.discard()  # no whole round this step: a round launched ahead is moot
        tb = self.spec.draft_batch(want, self.device, budget) if want and budget else None
        if not batch.prefills and (budget == 0 or (tb and len(tb.seqs) == len(want))):
            decoding = len(want) == len(batch.decodes)  # every sequence at this budget
            self._step_budget = budget if decoding else None
        return None, tb

    def _device_picks(self, seqs: list[Sequence]) -> bool:
        """Whether a step's tokens need nothing but the logits (a whole round or a plain step
        launched ahead, greedy or sampled as RoundGraphs / DecodeAhead.takes say): no logprobs,
        no penalties or logit_bias."""
        return not self.processor.needed(seqs) and all(
            s.sampling_params.logprobs is None for s in seqs
        )

    def _cost_path(self, seqs: list[Sequence]) -> str:
        """The step path these requests' steps take, as the controller keeps costs by it
        (engine/budget_controller.py, "Step paths"): FAST when their tokens are picked in the
        step's graph (whole rounds, plain steps launched ahead; an engine with neither has only
        the one path), else GENERAL (read first: logprobs, penalties, logit_bias, top-p / top-k,
        or sampling without the fused pick)."""
        picker = self.rounds if self.rounds is not None else self.ahead
        if picker is None or (self._device_picks(seqs) and picker.takes(seqs)):
            return FAST
        return GENERAL

    def _controller_budget(self, seqs: list[Sequence]) -> int:
        """This step's budget: the one chosen last step for these requests, else chosen now."""
        ids, plan = tuple(s.request_id for s in seqs), self._planned
        self._planned = None
        if plan is not None and plan[0] == ids:
            return plan[1]
        return self.controller.choose(list(ids), self._step_path)

    def _plan_next(self, seqs: list[Sequence]) -> int:
        """The controller's budget for the next step, chosen now, before a round is launched
        ahead: that round runs at it (RoundGraphs.step's next_budget). (Launched at this step's
        budget, a switch or a probe found a round at the old budget in flight next step and
        took it: the probe never ran, and the lookahead was broken for nothing.)"""
        ids = tuple(s.request_id for s in seqs)  # this step's requests: its step path
        self._planned = (ids, self.controller.choose(list(ids), self._step_path))
        return self._planned[1]

    def _whole_round(self, seqs: list[Sequence], budget: int, ahead: bool,
                     next_budget: int | None = None) -> list[list[int]] | None:  # fmt: skip
        """A round for every sequence of the step as one whole-round replay (greedy, no
        penalties or logprobs, a bucket that holds it); None: take the general path. `ahead`:
        launch the next round, at `next_budget`, before reading this one (RoundGraphs.step)."""
        rounds = self.rounds
        if rounds is None or not self._device_picks(seqs) or not rounds.takes(seqs):
            return None
        stats = self.spec.stats
        t0 = time.perf_counter()
        rows = rounds.step(seqs, budget, ahead=ahead, next_budget=next_budget)  # [m, bonus, ..]
        if rows is None:
            return None
        self._step_steady = rounds.steady
        t1 = time.perf_counter()
        stats.phase_seconds["verify"] += t1 - t0  # staging, launch(es) and the round's one read
        paths: list[list[int]] = []
        out = self.spec.commit_rows(seqs, rows, paths)
        context = self.spec.source.context
        for seq, path in zip(seqs, paths, strict=True):
            context.advance(seq.request_id, len(path))  # its accepted rows are in the ring
            if self.controller is not None:
                self.controller.observe_round(seq.request_id, budget, path)
        now = time.perf_counter()
        stats.phase_seconds["commit"] += now - t1
        stats.whole_round_steps += 1
        stats.whole_round_seconds += now - t0
        return out

    def _observe_paths(self, tb) -> None:
        """Hand the controller each round's accepted node indices (its free acceptance curve)."""
        if self.controller is not None:
            for seq, path in zip(tb.seqs, tb.paths, strict=True):
                self.controller.observe_round(seq.request_id, tb.budget, path)

    def _run_round(self, batch: ScheduledBatch, tb) -> list[list[int]]:
        """A step that is one speculative round for every sequence in it: verify forward
        (captured per (batch, N) bucket), acceptance and K/V moves on the device, one read."""
        stats = self.spec.stats
        on_gpu = self.device.type == "cuda"
        if on_gpu:
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            ev[0].record()
        t0 = time.perf_counter()
        logits = self.runner.run(batch, tb).logits  # (B*N, V), tb's order
        if on_gpu:
            ev[1].record()
        host_seconds = time.perf_counter() - t0  # on a GPU only the launch
        stats.phase_seconds["verify"] += host_seconds
        out = self.spec.accept_batch(tb, logits)  # reads the results: the forward is done
        self._keep_round_logprobs(tb)
        stats.forward_seconds += ev[0].elapsed_time(ev[1]) / 1e3 if on_gpu else host_seconds
        hidden = self.runner.hidden
        if hidden is not None:  # (B*N, F), tb's order: tree i's rows start at i * N
            pairs = zip(batch.chunks, tb.paths, strict=True)
            self._observe_rows(hidden, [(c, [i * tb.nodes + node for node in path])
                                        for i, (c, path) in enumerate(pairs)])  # fmt: skip
        return out

    def _keep_round_logprobs(self, tb) -> None:
        for seq, infos in zip(tb.seqs, tb.logprobs, strict=True):
            if infos is not None:
                self._logprobs[seq.request_id].extend(infos)
