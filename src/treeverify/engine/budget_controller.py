"""The adaptive tree budget: each round's budget, 0 (plain decoding) included, from measured
acceptance and measured cost, so that speculation never loses to plain decoding.

Objective (docs/ddtree.md, "Adaptive budget"): for the n speculating requests of a step, with one
budget B per step drawn from a few graph buckets (0, 4, 8, 16, ..., the configured maximum),

    R(B) = sum_r (1 + A_r(B)) / cost(n, B),        R(0) = n / cost(n, 0),

expected committed tokens per second. A_r(B) is request r's expected accepted drafts in a budget-B
tree; cost(n, B) the measured seconds of one step at that batch size and budget.

A_r(B) comes from the free curve of every round, a decayed mean per bucket of its gain over
the bucket below, per request, shrunk toward its class's engine-wide curve (a prior worth
`prior_rounds` rounds): engine/acceptance_curves.py.

Hysteresis: a switch needs R(best) > (1 + switch_margin) R(current) on `confirm` consecutive
decisions and at least `min_dwell` steps at the current budget. Leaving the rounds for plain
decoding needs a wider margin, `plain_margin` (1.0) / sqrt(n requests), halving every
`plain_halflife` (16) decisions in a row that plain decoding is ahead: rounds are the only
evidence of acceptance, and on recorded code and prose a dip in it puts plain 5-50% ahead for
a while, text no drafter predicts 110% (docs/ddtree.md, "Leaving the rounds").
Exploration: below the largest bucket, now and then one step runs a larger bucket, so budgets
above the current one (never measured by the free curve) get fresh evidence and a batch at 0
can come back. `probe="hybrid"`
(default): from plain decoding, in turns, the speculating bucket of best estimated rate and the
largest (the largest every time until 2026-12-05), else one bucket up; "top": always the
largest; "up": always one up. A probe at the top measures every bucket's gain in one round (the
free curve), one bucket up only its own: replayed on recorded tiny-code traces at the H200's step
costs (scripts/sim_adaptive.py), probing one bucket up left the controller at 0 through most of
a code generation (0.77x of the best fixed budget), probing the top recovered most of that; at
the engine's 2026-12-04 costs (plain 0.28 ms, rounds 0.42-0.57 ms) a top probe from a
speculating budget cost 1-3% against the best fixed budget, one bucket up ~0.5%, so hybrid
takes each where it pays (docs/ddtree.md).
A plain step measures no acceptance, so it fades the requests' own curves toward the
engine-wide one (`plain_decay` a step): a dip that sent a request to plain decoding does not
hold it there once the engine's recent rounds say otherwise (docs/ddtree.md: at plain decoding's
0.20 ms a step the replay lost 8-12% to such dips without it).
The interval is `explore_every` steps times cost(probe) / cost(current) (a probe that costs 4
plain steps comes 4x less often), doubled after each probe that changed nothing, up to
`explore_max` steps, and back to the start when a request without its own measurements joins
(new text, maybe predictable): engine/budget_probes.py.

Stale costs and thin evidence: cost trials (a bucket whose stale cost, at the least it could
be, would win: a dwell there measures it), acceptance trials (a bucket above with too few rounds
whose optimistic rate would win) and plain trials (plain decoding's stale cost re-measured):
engine/budget_trials.py, engine/plain_trials.py.

Step paths: what a step costs depends on more than (batch size, budget). Steps whose tokens
are picked inside their graph (greedy or fused-sampled: plain steps launched ahead, whole rounds)
cost a fraction of those that read the logits first (logprobs, penalties, top-p / top-k, sampling
without the fused pick: plain steps read first, rounds on the general path): on the H100 a
sampled plain step read first took 0.69 ms against 0.2 launched ahead, a sampled general round
2-3 ms against 0.4-0.6 whole. One table for both learned a mixture (a server with greedy and
sampled traffic, or bench_pair's texts one after another on the same engines) and held
plain-step costs of 0.7-6.8 ms on sampled text. So the engine names each step's path (FAST or
GENERAL) and every path keeps its own cost table, cost-trial marks and plain trials; a path
first seen starts from a stale copy of the fast path's table (calibrated on greedy steps), which
its steps and trials then correct. The acceptance curves are shared (they are the requests').

Acceptance classes: the engine-wide curve a request starts from is kept per class, greedy
(T=0) or sampled (T>0), the class the engine names for each request (`note_request`; unnamed:
greedy). Acceptance at T=1 is a fraction of greedy acceptance on the same text (prose: τ 1.3
against 4.9 on the H100), so one engine-wide curve taught by greedy requests sent every new
sampled request into rounds on the greedy prior: after greedy passes on the same engine, the
DFlash engine ran budget 32 on 267 of 910 steps of sampled prose at b=1, 0.60x plain (H100,
2026-12-05, `step_kinds.py --warm`). A class never measured has no prior: its first round
measures it (every bucket at or below the current one, the free curve).

Torch-free: the engine feeds it paths and step times; tests feed it synthetic curves.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from dataclasses import dataclass, field

from treeverify.engine import budget_events as ev
from treeverify.engine import budget_trials
from treeverify.engine.acceptance_curves import (
    Curve,
    RequestCurve,
    estimate_curve,
    fade,
    feed_round,
)
from treeverify.engine.age_prior import AgePrior
from treeverify.engine.budget_config import ControllerConfig
from treeverify.engine.budget_costs import CostModel
from treeverify.engine.budget_excursions import Excursions
from treeverify.engine.budget_probes import Probes
from treeverify.engine.budget_trials import accept_trial, cost_trial, judge_accept_trial
from treeverify.engine.cost_bursts import BurstGaps, BurstHold
from treeverify.engine.cost_trial_gaps import CostTrialGaps
from treeverify.engine.plain_trials import PlainTrials

# "wall": elapsed time (serving). "process": CPU seconds of this process, for a benchmark on a CPU
# shared with other work, where wall time measures the neighbours (use one torch thread).
CLOCKS = {"wall": time.perf_counter, "process": time.process_time}
MAX_TRACKED_REQUESTS = 4096  # per-request curves kept; finished requests are forgotten anyway
# Plain steps between fades of the requests' own acceptance (plain_decay each): a fade voids
# every request's cached sums, which the next full decision recomputes (at 8 requests ~2/3 of
# the controller's Python a plain step with 4); the replay suite's every row is the same at 4,
# 8 and 16 (thirty-eighth session), and at 16 a plain step's decision at 8 requests took
# 10.6-10.7 us against 14.4 (CPU, scripts/controller_cost.py, with the arrival check cached too)
FADE_EVERY = 16
# Decisions after the one that chose a request's round during which that round may still be
# unobserved: the engine plans the next step's budget before reading this step's round (one
# decision), and a step launched ahead is read a step later (a second). Past it, a request
# whose round never came back (the planned step was dropped) counts as an arrival again.
AWAIT_DECISIONS = 2


# Step paths (see "Step paths" above): tokens picked in the step's graph, or read first.
FAST, GENERAL = "fast", "general"
# Acceptance classes (see "Acceptance classes" above): whose engine-wide curve a request starts
# from. A request the engine did not name is greedy (tests, replays: one class, as before).
GREEDY, SAMPLED = "greedy", "sampled"


@dataclass
class _PathCosts:
    """One step path's cost table, its cost trials' marks ((n, budget) -> decision of the
    trial) and its plain trials."""

    cost: CostModel
    tried: dict[tuple[int, int], int] = field(default_factory=dict)
    bursts: BurstGaps = field(default_factory=BurstGaps)  # trials of overstated costs
    trial_gaps: CostTrialGaps = field(default_factory=CostTrialGaps)  # `cost_trial_backoff`
    plain_trials: PlainTrials = field(default_factory=PlainTrials)


def budget_buckets(max_budget: int, smallest: int = 4) -> tuple[int, ...]:
    """0, then powers of two from `smallest` below `max_budget`, then `max_budget` itself."""
    if max_budget < 1:
        raise ValueError(f"max_budget: expected >= 1, got {max_budget}")
    out, b = [0], smallest
    while b < max_budget:
        out.append(b)
        b *= 2
    out.append(max_budget)
    return tuple(out)


class BudgetController:
    def __init__(self, buckets: tuple[int, ...], cost: CostModel | None = None,
                 config: ControllerConfig | None = None):  # fmt: skip
        if not buckets or buckets[0] != 0 or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"buckets: expected increasing, starting at 0, got {buckets}")
        self.buckets = tuple(buckets)
        self.cfg = config or ControllerConfig()
        self.cost = cost or CostModel(self.cfg.cost_window)  # the fast path's, calibrated
        self.paths: dict[str, _PathCosts] = {FAST: _PathCosts(self.cost)}
        self.path = FAST  # the path whose table `cost`, `_tried` and `plain_trials` are
        self.pinned: int | None = None  # calibration: every step at this budget
        self.clock = time.perf_counter  # what step costs are measured with (see CLOCKS)
        self.classes: dict[str, str] = {}  # request -> acceptance class (`note_request`)
        # what a round entered from plain decoding and left at once costs beyond two plain
        # steps (a measurement, like the cost table: it outlives `reset`)
        self.excursions = Excursions()
        # `age_prior_tokens`: the classes' curves by request age (the ages outlive `reset`)
        self.age = (AgePrior(self.cfg.age_prior_tokens, keep=MAX_TRACKED_REQUESTS)
                    if self.cfg.age_prior_tokens else None)  # fmt: skip
        self._step_ids: list[str] = []  # the requests of the decision under way
        self.reset()

    def reset(self) -> None:
        """Forget acceptance and decisions (the cost table stays, every entry stale: measured
        before serving, by calibration or an earlier workload)."""
        for p, costs in self.paths.items():
            costs.cost.mark_stale()
            self.paths[p] = _PathCosts(costs.cost)  # trial marks and plain trials start over
        self._bind(FAST)
        self.step_index = 0  # decisions made: the clock of cost freshness
        self.cost_trials = 0
        self.accept_trials = 0
        self._trial_from: int | None = None  # the bucket an acceptance trial left, until judged
        self._cost_trial_at: int | None = None  # the decision a cost trial started at
        self.requests: dict[str, RequestCurve] = {}
        # request -> the decision that chose its first round, not yet observed: the engine
        # launches a step ahead, so the decision after a probe comes before its round is read,
        # and counted as arrivals there its requests restarted the probes' interval (the H100's
        # b=8 sampled groups: a second probe ~50 decisions after the first, fortieth session).
        # Held AWAIT_DECISIONS decisions at most: a planned step the engine dropped never
        # reports back (a helper's review)
        self._awaiting: dict[str, int] = {}
        # the engine-wide curve per acceptance class (each request's class outlives a reset:
        # it is the request's, not something learnt)
        self.class_curves: dict[str, Curve] = {GREEDY: {}}
        if self.age is not None:
            self.age.reset()
        # (request ids, rates) of the last full decision while at plain decoding: reused by
        # the decisions between full ones (`_decide`); None after anything that moves them
        # whether some of those requests had no rounds of their own, and whether some bucket
        # came near plain's rate (`Probes.near_plain`; no round is observed at plain decoding, so
        # none of these moves until the requests change)
        self._plain_rates: tuple[tuple[str, ...], dict[int, float | None], bool, bool] | None = None
        # (request ids, budget, rates, whether some bucket came near plain's) of the last full
        # decision at a round budget: reused by the decisions between full ones when
        # `decide_every` > 1 (the rounds observed since move them a little: read a step late)
        self._round_rates: tuple[tuple[str, ...], int, dict[int, float | None], bool] | None = None
        # sum over a step's requests of (1 + A_r(B)) per budget: unchanged until a round is
        # observed (plain steps at budget 0 observe none), so kept and read every step
        self._accept_sums: dict[tuple[str, ...], list[float | None]] = {}
        self.current = self.buckets[-1]  # start at the top: one round measures every budget
        self.since_switch = 0
        self.probes = Probes(self.cfg.explore_every)  # exploration (engine/budget_probes.py)
        self._pending: tuple[int, int] | None = None  # (candidate, consecutive wins)
        self._plain_wins = 0
        self._hold = BurstHold()  # plain decoding held through a burst of its own cost
        self._plain_unfaded = 0  # plain steps since the last fade
        self._quiet_left = 0  # `plain_quiet`: decisions left in plain decoding's quiet stretch
        self.steps_by_budget: dict[int, int] = dict.fromkeys(self.buckets, 0)
        self.switches = 0
        self.events = ev.DecisionEvents()  # probes, switches, trials: when and why
        self._batch_size, self._batch_since = 0, 0  # the last decision's, and since when

    def use_path(self, path: str) -> None:
        """Make `path`'s table the one decisions read (`cost`, `_tried`: (n, budget) -> step
        of its cost trial, `plain_trials`: plain decoding's stale cost re-measured); a path
        first seen starts from a stale copy of the fast path's. A plain trial under way on the
        path left ends here, its decision state restored (it measures its own path's plain
        steps only while they run; resumed later, it restored a dwell and a pending switch
        from hundreds of decisions before: review of the thirty-sixth session's change)."""
        trial = self.plain_trials.trial
        if trial is not None and path != self.path:
            self.since_switch, self._pending = trial.since_switch, trial.pending
            self.plain_trials.trial = None
        self._bind(path)

    def _bind(self, path: str) -> None:
        """`path` the one decisions read (`cost`, `_tried`, `plain_trials` are its)."""
        costs = self._costs_of(path)
        self.path = path
        self.cost, self._tried, self.plain_trials = costs.cost, costs.tried, costs.plain_trials
        self._bursts, self._trial_gaps = costs.bursts, costs.trial_gaps

    def _costs_of(self, path: str) -> _PathCosts:
        """`path`'s table and trials; a path first seen: a stale copy of the fast path's."""
        costs = self.paths.get(path)
        if costs is None:
            costs = self.paths[path] = _PathCosts(self.paths[FAST].cost.stale_copy())
        return costs

    # ---- estimates -----------------------------------------------------------------------------
    def note_request(self, request_id: str, cls: str) -> None:
        """The acceptance class (GREEDY or SAMPLED) of a request, before its first decision:
        which engine-wide curve it starts from. Kept until `forget`."""
        if cls not in (GREEDY, SAMPLED):
            raise ValueError(f"cls: expected {GREEDY!r} or {SAMPLED!r}, got {cls!r}")
        # not capped: a request is noted when queued, and a cap would drop the classes of the
        # oldest, the running ones, under a long queue; `forget` (every finish and abort) keeps
        # it to the requests in flight
        self.classes[request_id] = cls
        self._accept_sums.clear()
        self._plain_rates = self._round_rates = None

    def _all_sampled(self, request_ids: list[str]) -> bool:
        """Whether every request of the step samples (`sampled_arrival_factor`'s batches)."""
        if not self.cfg.sampled_arrival_factor:
            return False
        classes = self.classes
        return all(classes.get(rid) == SAMPLED for rid in request_ids)

    def _class_curve(self, request_id: str) -> Curve:
        cls = self.classes.get(request_id, GREEDY)
        curve = self.class_curves.get(cls)
        if curve is None:
            curve = self.class_curves[cls] = {}
        return curve

    def _prior_curve(self, request_id: str) -> Curve:
        """The curve the request's own estimate shrinks toward: its class's, at its age with
        `age_prior_tokens`."""
        flat = self._class_curve(request_id)
        if self.age is None:
            return flat
        return self.age.prior(self.classes.get(request_id, GREEDY), request_id, flat)

    def accept_estimate(self, request_id: str, budget: int) -> float | None:
        """A_r(B) = the sum of the estimated gains of each bucket up to B over the one below;
        None when some bucket up to B was never measured."""
        own = self.requests.get(request_id)
        return self._sum_gains(own, budget, self._prior_curve(request_id))

    def global_estimate(self, budget: int, cls: str = GREEDY) -> float | None:
        """The engine-wide A(B) of a class (what its requests with no rounds of their own start
        from)."""
        return self._sum_gains(None, budget, self.class_curves.get(cls, {}))

    def _sum_gains(self, own: RequestCurve | None, budget: int,
                   engine: Curve) -> float | None:  # fmt: skip
        """A(B): the curve at the largest bucket <= B (the gains of every bucket up to B)."""
        curve = estimate_curve(self.buckets, own, engine, self.cfg.prior_rounds)
        return curve[bisect.bisect_right(self.buckets, budget) - 1]

    def rate(self, request_ids: list[str], budget: int, cost: float | None = None) -> float | None:
        """R(B) in committed tokens per second for these requests in one step; None when the
        cost or some request's acceptance at B is unknown. The sums over the requests are made
        for every bucket at once and kept until a round is observed (a step asks for a rate per
        bucket; each summing its own gains was O(buckets^2 x requests) of Python per step).
        `cost`: seconds per step to assume instead of the cost model's estimate."""
        if cost is None:
            cost = self.cost.estimate(len(request_ids), budget)
        if cost is None:
            return None
        if len(self._accept_sums) > 64:  # batches come and go between rounds: stay small
            self._accept_sums.clear()
        key = tuple(request_ids)
        sums = self._accept_sums.get(key)
        if sums is None:
            sums = [0.0] * len(self.buckets)
            k = self.cfg.prior_rounds
            for rid in request_ids:  # 1 + A_r(B): the bonus token and the accepted drafts
                own = self.requests.get(rid)
                for j, a in enumerate(estimate_curve(self.buckets, own, self._prior_curve(rid), k)):
                    sums[j] = None if a is None or sums[j] is None else sums[j] + (1.0 + a)
            self._accept_sums[key] = sums
        total = sums[bisect.bisect_right(self.buckets, budget) - 1]  # the bucket B falls in
        return None if total is None else total / cost

    @property
    def explorations(self) -> int:
        """Probes made since the last reset."""
        return self.probes.count

    # ---- the decision --------------------------------------------------------------------------
    def choose(self, request_ids: list[str], path: str = FAST) -> int:
        """The budget for this step's speculating requests (0: decode them plainly); `path`:
        the step path they take (FAST or GENERAL: whose costs to read)."""
        if not request_ids:  # R(B) is per request: a step without any has no rate to weigh
            raise ValueError("request_ids: expected at least one speculating request, got none")
        if path != self.path:
            self.use_path(path)
        self.step_index += 1
        self._step_ids = request_ids
        if len(request_ids) != self._batch_size:
            self._batch_size, self._batch_since = len(request_ids), self.step_index
        if self.pinned is not None:
            return self._count(self.pinned)
        if self.plain_trials.step(self):
            return self._count(0)
        ids = (path, *request_ids)
        cached, at_rounds = self._plain_rates, self._round_rates
        if (self._quiet_left and cached is not None and cached[0] == ids
                and self.current == 0 and self._pending is None):  # fmt: skip
            return self._quiet_decision()
        self._quiet_left = 0
        every = budget_trials.TRIAL_CHECK_EVERY  # (one binding: the trials read it there too)
        if (cached is not None and self.current == 0 and self._pending is None
                and cached[0] == ids and self.step_index % every):  # fmt: skip
            _, rates, arrived, pays = cached  # at plain decoding, nothing but plain's cost moved
        elif (at_rounds is not None and self._pending is None
              and at_rounds[:2] == (ids, self.current)
              and self.step_index % self.cfg.decide_every):  # fmt: skip
            # at a round budget between full decisions: the last rates (an arrival they saw
            # was acted on then; its round is awaited now)
            _, _, rates, pays = at_rounds
            arrived = False
        else:
            rates = self._decide(request_ids)
            arrived = any(rid not in self.requests and not self._awaited(rid)
                          for rid in request_ids)  # fmt: skip
            # some bucket near plain's rate (read on arrivals, and at plain decoding: `far`)
            pays = (Probes.near_plain(self, rates, self._all_sampled(request_ids))
                    if arrived or self.current == 0 else True)  # fmt: skip
            self._plain_rates = (ids, rates, arrived, pays) if self.current == 0 else None
            keep = self.current != 0 and self.cfg.decide_every > 1
            self._round_rates = (ids, self.current, rates, pays) if keep else None
        self.since_switch += 1
        self.probes.since += 1
        if arrived and pays and self.probes.restart(self):
            why = "a request without rounds joined; a bucket may pay"
            self.events.add(self.step_index, ev.INTERVAL_RESTART, self.current, self.current,
                            len(request_ids), why)  # fmt: skip
        up = self.probes.target(self, rates)
        # at plain decoding with every bucket's rate far below plain's (the arrival rule's
        # test): the probes' interval may back off further (explore_far_factor)
        far = self.current == 0 and not pays
        # a rate unknown at `up` calls for a probe at once, unless the round that measures it
        # is chosen already and not yet observed (steps launched ahead: the lagged replay's
        # first sampled group probed twice in a row)
        unknown = rates.get(up) is None and not all(self._awaited(r) for r in request_ids)
        if up is not None and (unknown or self.probes.due(self, len(request_ids), up, far)):
            note = self.probes.probed(self, far)
            self.events.add(self.step_index, ev.PROBE, self.current, up, len(request_ids), note)
            self._fade_pending(request_ids)  # before the probe's round is observed
            self._await_round(request_ids)
            return self._count(up)  # one step at the probe's budget; `current` stays
        if self.current == 0 and self.cfg.plain_decay < 1.0:
            self._plain_unfaded += 1
            if self._plain_unfaded >= FADE_EVERY:
                self._fade_pending(request_ids)
        elif self.current:  # a stretch at plain ended: its last steps' fade now, before the
            self._fade_pending(request_ids)  # rounds' newer acceptance is observed
            self._await_round(request_ids)
        if self.current == 0 and self.cfg.plain_quiet:
            self._open_quiet(len(request_ids), up, far, rates)
        return self._count(self.current)

    def _open_quiet(self, n: int, up: int | None, far: bool,
                    rates: dict[int, float | None]) -> None:  # fmt: skip
        """`plain_quiet`: after a decision at plain decoding, the next decisions with the same
        requests return 0 on counters alone while nothing can fall due: up to plain_quiet - 1 of
        them, fewer when a probe would be due sooner at today's costs (the costs its steps
        observe move that a little) or the fade's count would reach FADE_EVERY; none while the
        probe's rate is unknown (its await expires) or the rates are not kept (a fade voided
        them). The decision after the stretch is a full one (`_decide`): the trials' checks
        and the rates come every plain_quiet decisions instead of on 1 in TRIAL_CHECK_EVERY."""
        if self._plain_rates is None or up is None or rates.get(up) is None:
            return
        k = min(self.cfg.plain_quiet - 1, self.probes.quiet(self, n, up, far))
        if self.cfg.plain_decay < 1.0:
            k = min(k, FADE_EVERY - 1 - self._plain_unfaded)
        if k > 0:
            self._quiet_left = k

    def _quiet_decision(self) -> int:
        """One decision of the quiet stretch: what a decision at plain decoding that reuses
        its rates and finds nothing due changes (the counters), nothing else. Its last one lets
        the rates go, so the decision after the stretch is a full one."""
        self._quiet_left -= 1
        if not self._quiet_left:
            self._plain_rates = None
        self.since_switch += 1
        self.probes.since += 1
        if self.cfg.plain_decay < 1.0:
            self._plain_unfaded += 1  # (the stretch ends before a fade falls due)
        return self._count(0)

    def _await_round(self, request_ids: list[str]) -> None:
        """A round was chosen for these requests: those without rounds of their own are no
        arrivals until it is observed (or they are forgotten), and the arrival test reused at
        plain decoding is made again."""
        if not self.cfg.await_rounds:
            return
        new = [rid for rid in request_ids if rid not in self.requests]
        if new:
            if len(self._awaiting) >= MAX_TRACKED_REQUESTS:
                self._awaiting.clear()  # rounds discarded unobserved: bounded all the same
            self._awaiting.update(dict.fromkeys(new, self.step_index))
            self._plain_rates = None

    def _awaited(self, request_id: str) -> bool:
        """Whether a round chosen for this request within the last AWAIT_DECISIONS decisions
        is still to be observed."""
        at = self._awaiting.get(request_id)
        return at is not None and self.step_index - at <= AWAIT_DECISIONS

    def _fade_pending(self, request_ids: list[str]) -> None:
        """The fade of the plain steps since the last one, applied now (every FADE_EVERY plain
        steps, and before a round: a probe's, or the first after a stretch at plain decoding,
        so no fade lands on acceptance newer than the steps it stands for)."""
        if self._plain_unfaded:
            self._fade(request_ids, self.cfg.plain_decay**self._plain_unfaded)
            self._plain_unfaded = 0

    def _decide(self, request_ids: list[str]) -> dict[int, float | None]:
        """Every bucket's rate, then the switch, trial and judgement rules (which may move
        `current`); returns the rates. At plain decoding with the same requests, `choose`
        runs this every TRIAL_CHECK_EVERY decisions only (the other decisions reuse its rates):
        a plain step observes no round, so only plain decoding's cost and the fade move the
        rates there, and the four `rate` calls and the rules were ~25 us of a ~150 us CPU
        plain step (the GPU's DFlash plain step was host-bound, +154 us over plain decoding's;
        thirty-sixth session). A probe's round, a request joining or leaving, and a reset void
        the reused rates at once, and a switch that is pending (winning, not yet confirmed) is
        decided every step, as before."""
        rates = {b: self.rate(request_ids, b) for b in self.buckets}
        known = {b: r for b, r in rates.items() if r is not None}
        cur = self.current
        if known and rates.get(cur) is not None:
            judge_accept_trial(self, rates, len(request_ids))
            cur = self.current
            # at plain decoding in a burst of its cost: no switch (engine/cost_bursts.py)
            held = self._hold.held(self.cost, cur, len(request_ids), self.step_index)
            if held:
                self._pending = None
            else:
                best = max(known, key=lambda b: (known[b], -b))  # ties: the smaller budget
                # a batch of requests none of which has rounds of its own (a new group) is
                # judged on its class's prior alone: the dwell and the confirmation guard a
                # budget chosen on these requests' own noisy rounds, which it has none of
                # (not inside a cost trial's dwell: its steps measure a cost, the device's,
                # whichever requests run them)
                at_once = (self.cfg.new_batch_at_once and not self._cost_trial_dwell()
                           and not any(rid in self.requests for rid in request_ids))  # fmt: skip
                self._consider(best, known[best], rates[cur], rates.get(0), len(request_ids),
                               at_once)  # fmt: skip
            if self.current == cur:
                cost_trial(self, request_ids, rates[cur], held)
            if self.current == cur and not self.plain_trials.running:  # one trial at a time: a
                # plain trial restores the dwell it found, which would cut an acceptance
                # trial's dwell to one round
                accept_trial(self, request_ids, rates[cur])
        return rates

    def _cost_trial_dwell(self) -> bool:
        """Whether a cost trial is in its dwell (under min_dwell decisions since it moved)."""
        at = self._cost_trial_at
        return at is not None and self.step_index - at < self.cfg.min_dwell

    def _fade(self, request_ids: list[str], d: float) -> None:
        """A plain step measures no acceptance: the requests' own estimates lose weight
        (`plain_decay` a step) toward the engine-wide curve, so a dip that sent a request to
        plain decoding does not hold it there once the engine's recent rounds say otherwise.
        Applied every FADE_EVERY plain steps (d = plain_decay ** steps): each fade voids the
        rates' cached sums, which a plain step then recomputed in full (~2/3 of its decision's
        Python at 8 requests)."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                fade(req.curve, d)
        self._accept_sums.clear()

    def _consider(self, best: int, best_rate: float, cur_rate: float, plain_rate: float | None,
                  n: int, at_once: bool = False) -> None:  # fmt: skip
        """Switch to `best` when it beats the current budget by the margin on `confirm`
        decisions after the dwell; to plain decoding (rate `plain_rate`, n requests) by the
        wider margin that narrows while plain stays ahead. `at_once`: no dwell and no
        confirmation (the margins stay): a new group of requests, on its class's prior."""
        margin = self.cfg.switch_margin
        if self.current != 0 and plain_rate is not None:  # decisions in a row plain has won
            self._plain_wins = self._plain_wins + 1 if plain_rate > (1 + margin) * cur_rate else 0
        if best == 0:  # leaving the rounds, the only evidence of acceptance: a wider margin
            # / sqrt(n): n requests' summed acceptance averages their bursts out
            wide = self.cfg.plain_margin * 0.5 ** (self._plain_wins / self.cfg.plain_halflife)
            wide /= n**0.5
            margin = max(margin, wide)
        if best == self.current or best_rate <= (1 + margin) * cur_rate:
            self._pending = None
            return
        wins = self._pending[1] + 1 if self._pending and self._pending[0] == best else 1
        self._pending = (best, wins)
        first = self.switches == 0  # leaving the start: one round has measured every budget
        if first or at_once or (wins >= self.cfg.confirm
                                and self.since_switch >= self.cfg.min_dwell):  # fmt: skip
            # an acceptance trial still in its dwell (only `at_once` switches there) is over:
            # judged later it would move this group back to the bucket it left
            self._trial_from = None
            kind = ev.FIRST if first else ev.NEW_BATCH if at_once else ev.SWITCH
            why = f"rate {best_rate:.4g} vs {cur_rate:.4g} (margin {margin:.3g})"
            self._move(kind, best, n, why)
            if at_once and not first and not self.cfg.new_batch_restarts_probes:
                self.probes.not_a_change()  # the class's prior moved it, not what a probe saw
            if (best == 0 and not first and not at_once and self.cfg.plain_probe_after
                    and Probes.excursion_priced(self, n)):  # fmt: skip
                # plain steps measure no acceptance: only a probe can show the dip that moved
                # it is over, and a probe from plain decoding priced by its excursion is spaced
                # ~100 decisions at b=8
                # (`since` counts this decision after it: the probe comes on the Nth after)
                self.probes.soon = self.probes.since + 1 + self.cfg.plain_probe_after

    def _move(self, kind: str, to: int, n: int, why: str) -> None:
        """`current` to `to` (a switch or a trial, `kind` in the decision log): the pending
        switch is dropped and the dwell starts over; a probe made due soon by a switch to
        plain decoding (`plain_probe_after`) is moot once the rounds are back."""
        self.events.add(self.step_index, kind, self.current, to, n, why)
        self.current, self._pending, self.since_switch = to, None, 0
        self.switches += 1
        if to:
            self.probes.soon = None

    def _count(self, budget: int) -> int:
        self.steps_by_budget[budget] = self.steps_by_budget.get(budget, 0) + 1
        if budget == 0 and self.age is not None:  # a plain step: a token a request older
            crossed = [self.age.grow(rid, 1) for rid in self._step_ids]
            if any(crossed):  # an older bin's prior: the cached rates are stale
                self._accept_sums.clear()
                self._plain_rates = None
        return budget

    # ---- feedback ------------------------------------------------------------------------------
    def observe_round(self, request_id: str, budget: int, path: list[int]) -> None:
        """A verified round at `budget`: path = accepted node indices, root (0) first."""
        if request_id not in self.requests and len(self.requests) >= MAX_TRACKED_REQUESTS:
            del self.requests[next(iter(self.requests))]  # the oldest (an aborted one, likely)
        req = self.requests.setdefault(request_id, RequestCurve())
        self._awaiting.pop(request_id, None)
        self._accept_sums.clear()  # every estimate may move (the engine-wide curve does)
        self._plain_rates = None
        # every bucket's gain over the one below added to each curve in place (feed_round)
        decay, mine, engine = self.cfg.decay, req.curve, self._class_curve(request_id)
        decay_e = decay
        if self.cfg.engine_decay_per_step and self._batch_size > 1:
            decay_e = decay ** (1.0 / self._batch_size)  # n rounds a step: decay a step
        fed = [(mine, decay), (engine, decay_e)]
        if self.age is not None:  # the class's curve at the request's age, then it ages
            fed.append((self.age.curve(self.classes.get(request_id, GREEDY), request_id), decay_e))
            self.age.grow(request_id, len(path))
        feed_round(self.buckets, path, budget, fed)

    def observe_step(self, n: int, budget: int, seconds: float, path: str = FAST) -> None:
        """Wall seconds of one decode-only step of n requests at `budget`, on step `path`
        (its table; the path decisions read stays as it is)."""
        self._costs_of(path).cost.observe(n, budget, seconds, at=self.step_index)

    def observe_wall(self, n: int, budget: int | None, seconds: float) -> None:
        """Wall seconds of every step of n decoding requests, steady or not, at `budget` (0:
        plain; None: not every decode at one budget, or prefills beside them): what a round
        entered from plain decoding and left at once costs (engine/budget_excursions.py)."""
        # plain's cost only where an excursion is priced: this runs every engine step
        pricing = budget == 0 and n > 0 and self.excursions.pricing
        self.excursions.observe(n, budget, seconds, self.cost.estimate(n, 0) if pricing else None)

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self._awaiting.pop(request_id, None)
        self.classes.pop(request_id, None)
        if self.age is not None:
            self.age.forget(request_id)
        self._accept_sums.clear()
        self._plain_rates = self._round_rates = None

    def info(self) -> dict:
        """For /server_info."""
        return {
            "buckets": list(self.buckets),
            "current": self.current,
            "steps_by_budget": {str(b): c for b, c in sorted(self.steps_by_budget.items())},
            "switches": self.switches,
            "explorations": self.explorations,  # probes
            "cost_trials": self.cost_trials,
            "accept_trials": self.accept_trials,
            # bursts of slow host steps (docs/ddtree.md): decisions held at plain decoding, and
            # per step path the costs now 2x or more their lowest median (the ratio)
            "burst_holds": self._hold.holds,
            "overstated_costs": {p: c.cost.overstated_entries() for p, c in self.paths.items()},
            "accept_curve": {
                str(b): round(a, 4)
                for b in self.buckets[1:]
                if (a := self.global_estimate(b)) is not None
            },  # fmt: skip
            # every class's engine-wide curve (greedy's is accept_curve)
            "accept_curve_by_class": {
                cls: {
                    str(b): round(a, 4)
                    for b in self.buckets[1:]
                    if (a := self.global_estimate(b, cls)) is not None
                }
                for cls in self.class_curves
            },  # fmt: skip
            # `age_prior_tokens`: by class and age bin (its first age, tokens), each bucket's
            # gain over the one below
            "accept_gains_by_age": self.age.info() if self.age is not None else {},
            "cost_seconds_batch1": {str(b): s for b, s in self.cost.curve(1).items()},
            # batch size -> what a round entered from plain decoding and left at once cost
            # beyond two plain steps (median of the last few): a probe's real price
            "excursion_extra_seconds": {str(n): s for n, s in self.excursions.info().items()},
            "cost_path": self.path,  # the step path of the last decision (whose costs above)
            "cost_seconds_batch1_by_path": {
                p: {str(b): s for b, s in c.cost.curve(1).items()} for p, c in self.paths.items()
            },
            # decisions in a row plain decoding has been ahead (what narrows the margin to
            # leave the rounds), and the knobs in force: what a 3 a.m. reader needs to explain
            # a budget
            "plain_ahead_decisions": self._plain_wins,
            # decisions between plain trials, by batch size (doubling while they confirm)
            "plain_trial_gaps": self.plain_trials.gaps(),
            "cost_trial_waits": self._trial_gaps.factors(),  # x cost_fresh_steps, by "n:budget"
            # the last probes, switches and trials: at which decision, from where, and why
            "decision_index": self.step_index,
            "recent_decisions": self.events.recent(),
            "config": dataclasses.asdict(self.cfg),
        }
