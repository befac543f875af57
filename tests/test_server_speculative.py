"""`treeverify serve --speculative-algorithm DDTREE` (real subprocess, tiny-llama, n-gram
drafter): greedy answers equal a plain server's, streamed and not, with and without the
per-request opt-out, adaptive budget on and off; /server_info and /metrics report the
acceptance statistics and the budgets chosen."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from treeverify.server.testing import ServerProcess  # noqa: E402

PROMPTS = ["abcabcabcabcabcabc", "The capital of France is Paris. The capital of France is", "x"]


def _answers(url: str, **extra) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    out = []
    for p in PROMPTS:
        r = client.completions.create(model="tiny-llama", prompt=p, max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True, **extra})  # fmt: skip
        out.append(r.choices[0].text)
        streamed = client.completions.create(
            model="tiny-llama", prompt=p, max_tokens=24, temperature=0, stream=True,
            extra_body={"ignore_eos": True, **extra},
        )  # fmt: skip
        assert "".join(c.choices[0].text for c in streamed if c.choices) == out[-1]
    return out


def test_speculative_server_matches_plain_server():
    with ServerProcess(["--model", "tiny-llama"]) as plain:
        expected = _answers(plain.url)
        info = httpx.get(plain.url + "/server_info", timeout=10).json()
        assert info["speculative"] == {"enabled": False}
    args = ["--model", "tiny-llama", "--speculative-algorithm", "DDTREE",
            "--speculative-ddtree-budget", "8", "--speculative-num-draft-tokens", "4"]  # fmt: skip
    # every step a round, each on the general path (draft, build, verify, accept one by one)
    with ServerProcess(args + ["--no-speculative-adaptive", "--disable-round-graphs"]) as spec:
        assert _answers(spec.url) == expected
        assert _answers(spec.url, speculative=False) == expected
        info = httpx.get(spec.url + "/server_info", timeout=10).json()["speculative"]
        assert info["enabled"] and info["algorithm"] == "DDTREE" and info["budget"] == 8
        assert info["adaptive"] is None
        assert info["rounds"] > 0 and info["avg_spec_accept_length"] > 1.0
        assert sum(info["accept_length_histogram"].values()) == info["rounds"]
        assert set(info["phase_seconds"]) == {"draft", "build", "verify", "accept", "commit"}
        assert info["phase_seconds"]["verify"] > 0
        assert info["drafter"] == "ngram"
        assert 0 < info["forward_seconds"] <= info["round_seconds"]
        assert 0 <= info["outside_forward_share"] < 1
        metrics = httpx.get(spec.url + "/metrics", timeout=10).text
        assert 'treeverify_spec_round_seconds_total{model="tiny-llama",part="round"}' in metrics
        assert info["whole_round_steps"] == 0  # --disable-round-graphs: the general path
        assert 'treeverify_spec_round_phase_seconds_total{model="tiny-llama",phase="verify"}' in (
            metrics
        )
        assert "treeverify_spec_accept_length" in metrics
    # The adaptive budget (on by default for DDTREE): buckets up to --speculative-ddtree-budget;
    # it starts at the top, so the first step of the first request is a budget-8 round.
    with ServerProcess(args) as adaptive_server:
        assert _answers(adaptive_server.url) == expected
        info = httpx.get(adaptive_server.url + "/server_info", timeout=10).json()["speculative"]
        adaptive = info["adaptive"]
        assert adaptive["buckets"] == [0, 4, 8] and adaptive["current"] in (0, 4, 8)
        assert set(adaptive["cost_seconds_batch1"]) == {"0", "4", "8"}  # measured at startup
        steps = adaptive["steps_by_budget"]
        assert steps["8"] > 0 and sum(steps.values()) >= info["rounds"] > 0
        assert info["whole_round_steps"] > 0  # greedy n-gram rounds as whole rounds (eager)
        metrics = httpx.get(adaptive_server.url + "/metrics", timeout=10).text
        for budget, n in steps.items():
            line = f'treeverify_spec_budget_steps_total{{budget="{budget}",model="tiny-llama"}}'
            assert f"{line} {float(n)}" in metrics
        current = float(adaptive["current"])
        assert f'treeverify_spec_budget_current{{model="tiny-llama"}} {current}\n' in metrics
        trials = float(adaptive["cost_trials"])
        assert f'treeverify_spec_cost_trials_total{{model="tiny-llama"}} {trials}\n' in metrics
        trials = float(adaptive["accept_trials"])
        assert f'treeverify_spec_accept_trials_total{{model="tiny-llama"}} {trials}\n' in metrics
        holds = float(adaptive["burst_holds"])
        assert f'treeverify_spec_burst_holds_total{{model="tiny-llama"}} {holds}\n' in metrics
        probes, switches = float(adaptive["explorations"]), float(adaptive["switches"])
        assert f'treeverify_spec_probes_total{{model="tiny-llama"}} {probes}\n' in metrics
        line = f'treeverify_spec_budget_switches_total{{model="tiny-llama"}} {switches}\n'
        assert line in metrics
        # the decision log: every event names budgets the controller has, in decision order;
        # while the whole log is shown, its moves are the switches counted and the first one
        # leaves the start (the top bucket)
        log = adaptive["recent_decisions"]
        assert all(e["from"] in (0, 4, 8) and e["to"] in (0, 4, 8) for e in log), log
        steps_seen = [e["step"] for e in log]  # empty when the controller never left the top
        assert steps_seen == sorted(steps_seen)  # (its costs are timed: a busy machine moves them)
        assert all(s <= adaptive["decision_index"] for s in steps_seen)
        # (a plain trial measures plain decoding for a few steps; `current` stays)
        moves = [e for e in log if e["kind"] not in ("probe", "interval_restart", "plain_trial")]
        assert sum(e["kind"] == "probe" for e in log) <= probes
        if len(log) < 32:
            assert len(moves) == switches and (not moves or moves[0]["from"] == 8), log
        assert set(adaptive["overstated_costs"]) >= {"fast"}
        # speculative_budget pins a request's rounds (the gate's speculation probe uses it):
        # same answers, and every step of those requests is a round (<= 1 + 4 tokens each)
        rounds = info["rounds"]
        assert _answers(adaptive_server.url, speculative_budget=8) == expected
        info = httpx.get(adaptive_server.url + "/server_info", timeout=10).json()["speculative"]
        assert info["rounds"] - rounds >= 2 * len(PROMPTS) * -(-23 // 5)
        for bad in (5, 0, "8", True):
            r = httpx.post(adaptive_server.url + "/v1/completions", timeout=10,
                           json={"model": "tiny-llama", "prompt": "x", "max_tokens": 2,
                                 "speculative_budget": bad})  # fmt: skip
            assert r.status_code == 400, (bad, r.text)
            assert r.json()["error"]["param"] == "speculative_budget", r.text
        r = httpx.post(adaptive_server.url + "/v1/completions", timeout=10,
                       json={"model": "tiny-llama", "prompt": "x", "max_tokens": 2,
                             "speculative_budget": 8, "speculative": False})  # fmt: skip
        assert r.status_code == 400 and "speculative=false" in r.text, r.text
        assert httpx.get(adaptive_server.url + "/health", timeout=10).status_code == 200


def test_dflash_server_runs_whole_rounds_and_reports_them():
    """The default pair (tiny-code + its DFlash drafter): greedy rounds run as whole-round
    replays (eager on the CPU), counted in /server_info and /metrics."""
    args = ["--model", "tiny-code", "--speculative-algorithm", "DDTREE",
            "--no-speculative-adaptive"]  # fmt: skip
    with ServerProcess(args) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
        r = client.completions.create(model="tiny-code", prompt="def add(a, b):\n", max_tokens=32,
                                      temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        assert r.usage.completion_tokens == 32
        info = httpx.get(server.url + "/server_info", timeout=10).json()["speculative"]
        assert info["drafter"] == "dflash" and info["whole_round_steps"] > 0
        assert info["whole_round_seconds"] > 0 and info["rounds"] >= info["whole_round_steps"]
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        line = next(m for m in metrics.splitlines()
                    if m.startswith('treeverify_spec_round_seconds_total{model="tiny-code",'
                                    'part="whole_round"}'))  # fmt: skip
        assert float(line.split()[-1]) > 0
