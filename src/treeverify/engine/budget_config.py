"""The adaptive budget controller's knobs (engine/budget_controller.py; docs/ddtree.md): one
dataclass, validated at construction, each error naming the knob."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass
class ControllerConfig:
    decay: float = 0.95  # acceptance: ~20 rounds of memory per request
    prior_rounds: float = 8.0  # weight of the engine-wide curve in a request's estimate
    cost_window: int = 9  # step cost: median of the last this many steps (robust to a stall)
    switch_margin: float = 0.05  # R(best) must beat R(current) by this fraction ...
    confirm: int = 2  # ... on this many consecutive decisions ...
    min_dwell: int = 8  # ... after at least this many steps at the current budget
    probe: str = "hybrid"  # an exploration step: the largest bucket from plain decoding, else one
    # bucket up ("hybrid"); always the largest ("top"), or always one up ("up")
    explore_every: int = 16  # steps between probes below the largest bucket ...
    explore_max: int = 256  # ... backing off to at most this many while probes change nothing
    explore_far_factor: float = 2.0  # ... times this at plain decoding while every bucket's
    # rate is under arrival_probe_factor of plain's (replay: unpredictable text 0.962 -> 0.968x
    # plain at the H100 table, every predictable row and the code after unpredictable text
    # unchanged; 1: as before)
    excursion_min_batch: int = 2  # from plain decoding with at least this many requests, a
    # probe is spaced by its measured price (the round and the plain step after it, read first:
    # engine/budget_excursions.py), not the steady table's (H100, forty-second session: b=8
    # prose sampled 0.866-0.871x -> 0.933-0.958x plain, code b=8 1.17-1.19x -> 1.19-1.24x; b=1
    # untouched: spacing it too lost predictable text in the replay); 0: off
    arrival_probe_factor: float = 0.6  # a request without rounds of its own restarts the probe
    # interval only when some bucket's rate on its class's prior is within this factor of plain
    # decoding's (0: always, as before)
    sampled_arrival_factor: float = 0.8  # ... this factor instead where every request of the
    # step samples (the sampled class's prior; also the far test at plain decoding); 0: the same
    # (H100 b=8 queue, prose at T=1: budget 4 on the prior at ~0.65 of plain's rate restarted the
    # interval on each group, two probes a pass at ~2 ms each; scripts/sim_probe_cycle.py). 0.8
    # by default since the fifty-seventh session: ~1 probe a pass instead of 3 on the H100, prose
    # sampled +5.6% / -0.4% paired against 0 (+15% under the old decay), code unchanged; replay:
    # the cycle gone, the suite identical (docs/ddtree.md)
    new_batch_at_once: bool = True  # a step whose requests have no rounds of their own (a new
    # group) switches on its class's prior with no dwell nor confirmation: after greedy groups
    # the H200 ran a new sampled group of 8 at budget 32 for 6 of its 131 steps (2026-12-05)
    plain_probe_after: int = 0  # after a switch to plain decoding that the requests' own
    # rounds made (not a new group's on its prior) with `excursion_min_batch` requests or more,
    # a probe on the Nth decision after it, whatever the probes' interval (0: off). The replayed
    # b=8 queues of code left the rounds on a dip (the engine-wide curve remembers ~2.5 steps
    # at b=8) and ran ~100 plain decisions before the next probe found the rounds again
    # (scripts/sim_trial_backoff.py)
    await_rounds: bool = True  # a request whose first round is chosen but not yet observed (a
    # step launched ahead) is no arrival meanwhile; False: as before, for A/B (the decision
    # after each probe of a new group restarted the probes' interval on the GPU)
    new_batch_restarts_probes: bool = True  # such a switch counts as a change a probe saw (the
    # next probe starts the interval over); False: it is the prior's, not a probe's (the
    # decision log showed each sampled group's second probe coming from this restart)
    cost_trials: bool = True  # try a budget whose stale cost hides a better rate, plain
    # decoding's included (plain trials, stale_plain_floor); False: neither (A/B)
    trial_steady_batch: int = 0  # a cost or plain trial only at a batch size that has held for
    # this many decisions (0: any): a draining group's tail (n = 6, 5, ... 1 a few decisions
    # each) spent dwells on trials near its end on the H100 at b=8 (fortieth session's log);
    # not yet measured on a GPU (PAIR_AB="trial_steady_batch=8")
    cost_fresh_steps: int = 256  # a cost measured this many steps ago or less is fresh; a cost
    # trial per (batch size, budget) at most once per this many steps
    cost_trial_backoff: bool = False  # ... that many times 2, 4, ... 16 while trials confirm
    # the entry's cost (within 15%), as plain trials already wait (engine/cost_trial_gaps.py;
    # the H100's b=8 code passes spent 8-25 of ~143 steps at 64 on repeated trials)
    accept_trials: bool = True  # a dwell one bucket up when its gain lacks evidence (False: A/B)
    accept_evidence: float = 2.0  # rounds of a request's own below which a gain lacks evidence
    accept_optimism: float = 0.35  # a trial's bucket assumed to add this x the current one's gain
    plain_decay: float = 0.95  # a plain step fades a request's own acceptance toward the
    # engine-wide curve by this factor (1: never; with plain decoding at 0.20 ms a step the CPU
    # replay lost 8-12% to dips that held requests at 0 without it, docs/ddtree.md)
    plain_margin: float = 1.0  # plain decoding must beat the rounds by this fraction / sqrt(n
    # requests) to be chosen (a dip in bursty acceptance is weak evidence; plain measures none) ...
    stale_plain_floor: float = 0.5  # a stale plain cost may be overstated down to this
    # fraction of itself: when plain decoding at that cost would beat the rounds, a plain
    # trial (a few plain steps, then back) measures it (a stall while calibrating held a CPU
    # engine in rounds on text no drafter predicts at 0.66x plain; docs/ddtree.md)
    plain_trials_per_batch: bool = False  # True: every batch size spaces its own plain trials
    # (before the forty-third session); False: a size with no plain cost of its own (derived
    # from other sizes') waits out the engine's last trial (engine/plain_trials.py)
    decide_every: int = 1  # at a round budget with the same requests, the rates and the
    # switch rules every this many decisions (1, 2 or 4: a divisor of the trials' period),
    # the last rates reused between (a round observed moves them a little): the rates' sums
    # over the requests are most of `choose`'s Python at b=8, on a step that may be host-bound
    plain_quiet: int = 0  # at plain decoding with the same requests, a decision opens a quiet
    # stretch of up to this many - 1 decisions that return 0 on counters alone (no rates, no
    # trial or probe tests), ended before a probe could fall due at today's costs and before
    # the next fade; the decision after it is a full one (0: off, the rates reused on 3
    # decisions in 4; else 5..64). A call costs several times more inside a step than
    # alone (cold caches), and the DFlash engine's plain step at b=8 is host-bound (H100,
    # fifty-fourth session)
    engine_decay_per_step: bool = True  # the engine-wide curve's memory counted in steps, not
    # request-rounds: at n requests each of a step's n rounds decays it by decay ** (1 / n)
    # (False, the default until the fifty-sixth session: by decay, as a request's own: at b=8
    # ~2.5 steps of memory, every request's shrunk estimate moving together on the last few
    # rounds). Every GPU A/B at b=8 favoured it (docs/ddtree.md); b=1 is unchanged
    age_prior_tokens: int = 0  # a request's estimate shrinks toward its class's curve at its
    # age: bins of generated tokens [0, t), [t, 2t), [2t, 4t), [4t, ...) for t = this (0: one
    # curve a class): tiny-code's acceptance climbs with a request's age, and a group arriving
    # at once made the curve young, holding matured requests at plain decoding until a probe
    # (engine/age_prior.py)
    plain_halflife: float = 16.0  # ... halving every this many decisions plain keeps winning,
    # down to switch_margin (CPU replay over 3 trace sets: docs/ddtree.md, "Leaving the rounds")

    def __post_init__(self) -> None:
        if not 0.0 < self.decay < 1.0:
            raise ValueError(f"decay: expected in (0, 1), got {self.decay}")
        if self.cost_window < 1:
            raise ValueError(f"cost_window: expected >= 1, got {self.cost_window}")
        if self.switch_margin < 0 or self.prior_rounds < 0:
            raise ValueError("switch_margin, prior_rounds: expected >= 0")
        if self.confirm < 1 or self.min_dwell < 0 or self.explore_every < 1:
            raise ValueError("confirm, explore_every: expected >= 1; min_dwell >= 0")
        if self.probe not in ("top", "up", "hybrid"):
            raise ValueError(f"probe: expected 'top', 'up' or 'hybrid', got {self.probe!r}")
        if not 0.0 <= self.arrival_probe_factor <= 1.0:
            raise ValueError(
                f"arrival_probe_factor: expected in [0, 1], got {self.arrival_probe_factor}"
            )
        if not 0.0 <= self.sampled_arrival_factor <= 1.0:  # (nan fails too)
            raise ValueError(
                f"sampled_arrival_factor: expected in [0, 1], got {self.sampled_arrival_factor}"
            )
        if self.explore_max < self.explore_every:
            raise ValueError("explore_max: expected >= explore_every")
        if not 1.0 <= self.explore_far_factor < math.inf:  # (nan fails too)
            raise ValueError(
                f"explore_far_factor: expected a finite number >= 1, got {self.explore_far_factor}"
            )
        if self.excursion_min_batch < 0:
            raise ValueError(f"excursion_min_batch: expected >= 0, got {self.excursion_min_batch}")
        if self.plain_probe_after < 0:
            raise ValueError(f"plain_probe_after: expected >= 0, got {self.plain_probe_after}")
        if self.decide_every not in (1, 2, 4):
            raise ValueError(f"decide_every: expected 1, 2 or 4, got {self.decide_every}")
        if not (self.plain_quiet == 0 or 5 <= self.plain_quiet <= 64):
            raise ValueError(  # (1-4: full decisions as often as without it, or more)
                f"plain_quiet: expected 0 (off) or 5..64, got {self.plain_quiet}"
            )
        if self.cost_fresh_steps < 1:
            raise ValueError(f"cost_fresh_steps: expected >= 1, got {self.cost_fresh_steps}")
        if self.trial_steady_batch < 0:
            raise ValueError(f"trial_steady_batch: expected >= 0, got {self.trial_steady_batch}")
        if self.accept_evidence < 0 or self.accept_optimism < 0:
            raise ValueError("accept_evidence, accept_optimism: expected >= 0")
        if self.plain_margin < 0:
            raise ValueError(f"plain_margin: expected >= 0, got {self.plain_margin}")
        if not 0.0 < self.stale_plain_floor <= 1.0:
            raise ValueError(f"stale_plain_floor: expected in (0, 1], got {self.stale_plain_floor}")
        if self.plain_halflife <= 0:
            raise ValueError(f"plain_halflife: expected > 0, got {self.plain_halflife}")
        if self.age_prior_tokens < 0:
            raise ValueError(f"age_prior_tokens: expected >= 0, got {self.age_prior_tokens}")
        if not 0.0 < self.plain_decay <= 1.0:
            raise ValueError(f"plain_decay: expected in (0, 1], got {self.plain_decay}")

    def with_settings(self, settings: list[str]) -> ControllerConfig:
        """A copy with "KNOB=VALUE" settings applied (the benchmarks' command lines: --set,
        --controller-set), each value parsed as the knob's type and validated; a ValueError
        names an unknown knob or a bad value."""
        knobs = {}
        for kv in settings:
            name, sep, value = kv.partition("=")
            if not sep or name not in {f.name for f in dataclasses.fields(self)}:
                raise ValueError(f"controller setting {kv!r}: expected KNOB=VALUE with a "
                                 f"ControllerConfig knob")  # fmt: skip
            kind = type(getattr(self, name))
            if kind is bool:  # anything else is a typo, not False
                flags = {"1": True, "true": True, "on": True, "yes": True,
                         "0": False, "false": False, "off": False, "no": False}  # fmt: skip
                if value.lower() not in flags:
                    raise ValueError(f"{name}: expected true or false, got {value!r}")
                knobs[name] = flags[value.lower()]
                continue
            try:
                knobs[name] = kind(value)
            except ValueError:
                what = {int: "an integer", float: "a number"}.get(kind, f"a {kind.__name__}")
                raise ValueError(f"{name}: expected {what}, got {value!r}") from None
            if kind is float and not math.isfinite(knobs[name]):  # nan passes every `<` check
                raise ValueError(f"{name}: expected a finite number, got {value!r}")
        return dataclasses.replace(self, **knobs)
