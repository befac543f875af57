"""Prometheus metrics (prometheus-client), one registry per app so several apps can coexist.

Names follow the ``<namespace>:<name>`` habit of SGLang/vLLM, with the ``treeverify`` prefix:
requests by endpoint and HTTP status, prompt and generation tokens, time to first token and
inter-token latency histograms, KV usage and the MoE expert imbalance (max/mean tokens per expert
of the worst layer; absent for dense models), all refreshed from the engine loop's snapshot on
each scrape.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from treeverify.server.engine_loop import Stats

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        self.requests = Counter(
            "treeverify_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "treeverify_prompt_tokens", "Prompt tokens submitted", ["model"], registry=r
        )
        self.generation_tokens = Counter(
            "treeverify_generation_tokens", "Tokens generated", ["model"], registry=r
        )
        self.ttft = Histogram(
            "treeverify_time_to_first_token_seconds",
            "Time to first token",
            ["model"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "treeverify_inter_token_latency_seconds",
            "Time between tokens of a request",
            ["model"],
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.kv_usage = Gauge(
            "treeverify_kv_cache_usage_ratio", "Fraction of KV pages in use", ["model"], registry=r
        )
        self.running = Gauge("treeverify_num_running_reqs", "Running", ["model"], registry=r)
        self.waiting = Gauge("treeverify_num_waiting_reqs", "Waiting", ["model"], registry=r)
        self.moe_imbalance = Gauge(
            "treeverify_moe_expert_imbalance",
            "max/mean tokens per routed expert, worst MoE layer (NaN: dense model)",
            ["model"],
            registry=r,
        )

        self.spec_phase = Gauge(
            "treeverify_spec_round_phase_seconds_total",
            "Host wall seconds spent per speculative-round phase since start",
            ["model", "phase"],
            registry=r,
        )
        self.spec_round = Gauge(
            "treeverify_spec_round_seconds_total",
            "Speculative rounds since start: 'round' = wall time of general-path batched "
            "rounds, 'verify_forward' = the verify forwards' device time within them, "
            "'whole_round' = wall time of whole-round graph replays (greedy DFlash rounds: "
            "draft to accept in one replay, no separate verify forward to time)",
            ["model", "part"],
            registry=r,
        )
        self.spec_accept = Gauge(
            "treeverify_spec_accept_length",
            "Tokens committed per speculative round, bonus included (mean since start)",
            ["model"],
            registry=r,
        )

        self.spec_budget_steps = Gauge(
            "treeverify_spec_budget_steps_total",
            "Decode steps of speculating requests by the tree budget the adaptive controller "
            "chose (0: plain decoding), since start",
            ["model", "budget"],
            registry=r,
        )
        self.spec_budget_current = Gauge(
            "treeverify_spec_budget_current",
            "The adaptive controller's current tree budget (0: plain decoding)",
            ["model"],
            registry=r,
        )
        self.spec_cost_trials = Gauge(
            "treeverify_spec_cost_trials_total",
            "Times the adaptive controller moved to a budget to re-measure its stale step cost "
            "(docs/ddtree.md, stale costs), since start",
            ["model"],
            registry=r,
        )
        self.spec_accept_trials = Gauge(
            "treeverify_spec_accept_trials_total",
            "Times the adaptive controller moved one budget up to measure a gain its requests "
            "had too little evidence of (docs/ddtree.md, acceptance trials), since start",
            ["model"],
            registry=r,
        )

        self.spec_probes = Gauge(
            "treeverify_spec_probes_total",
            "Probe steps of the adaptive controller (one step at a larger budget to refresh "
            "its acceptance estimates; docs/ddtree.md, exploration), since start",
            ["model"],
            registry=r,
        )
        self.spec_switches = Gauge(
            "treeverify_spec_budget_switches_total",
            "Times the adaptive controller changed its current budget (switches and trials; "
            "/server_info's recent_decisions says when and why), since start",
            ["model"],
            registry=r,
        )
        self.spec_burst_holds = Gauge(
            "treeverify_spec_burst_holds_total",
            "Decisions the adaptive controller held at plain decoding because a burst of slow "
            "host steps had doubled its measured cost (docs/ddtree.md, bursts), since start",
            ["model"],
            registry=r,
        )

    def observe_tokens(self, n: int, dt: float | None, first: bool) -> None:
        """``n`` tokens came ``dt`` s after the previous event (or the request, if first)."""
        self.generation_tokens.labels(self.model_name).inc(n)
        if dt is None or n <= 0:
            return
        if first:
            self.ttft.labels(self.model_name).observe(dt)
            return
        for _ in range(n):
            self.itl.labels(self.model_name).observe(dt / n)

    def render(self, stats: Stats) -> bytes:
        m = self.model_name
        self.kv_usage.labels(m).set(stats.used_pages / max(stats.num_pages, 1))
        self.running.labels(m).set(stats.running)
        self.waiting.labels(m).set(stats.waiting)
        self.moe_imbalance.labels(m).set(
            float("nan") if stats.moe_imbalance is None else stats.moe_imbalance
        )
        if stats.spec is not None:
            self.spec_accept.labels(m).set(stats.spec["avg_spec_accept_length"])
            for phase, secs in stats.spec["phase_seconds"].items():
                self.spec_phase.labels(m, phase).set(secs)
            self.spec_round.labels(m, "round").set(stats.spec.get("round_seconds", 0.0))
            self.spec_round.labels(m, "verify_forward").set(stats.spec.get("forward_seconds", 0.0))
            self.spec_round.labels(m, "whole_round").set(stats.spec.get("whole_round_seconds", 0.0))
            adaptive = stats.spec.get("adaptive")
            if adaptive:
                for budget, steps in adaptive["steps_by_budget"].items():
                    self.spec_budget_steps.labels(m, budget).set(steps)
                self.spec_budget_current.labels(m).set(adaptive["current"])
                self.spec_cost_trials.labels(m).set(adaptive["cost_trials"])
                self.spec_accept_trials.labels(m).set(adaptive["accept_trials"])
                self.spec_burst_holds.labels(m).set(adaptive["burst_holds"])
                self.spec_probes.labels(m).set(adaptive["explorations"])
                self.spec_switches.labels(m).set(adaptive["switches"])
        return generate_latest(self.registry)
