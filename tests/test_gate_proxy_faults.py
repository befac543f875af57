"""Planted faults behind a fault proxy (tests/gate_doubles.py) in front of real servers: each is
caught by the probe made for it, with exit 2; the same path without the fault passes.

- temperature ignored (greedy always): the sampled probe's frequency test;
- chat answered by another model (tiny-kimi behind tiny-llama's chat route): the chat probe
  and the oracle, against a golden recorded on the healthy server;
- deterministic garbage for prompts over 1,500 tokens: the long-context copy probe, on a
  copying stand-in model (the random-weight tiny models cannot copy; the probe skips them);
- speculation silently off (every request sent with "speculative": false) on a server whose
  /server_info says it speculates: the speculation probe, which counts the rounds it caused.
"""

from __future__ import annotations

import json

import pytest

from gate_doubles import CopyModel, FaultProxy
from treeverify.gate import cli
from treeverify.server.testing import ServerProcess


@pytest.fixture(scope="module")
def llama():
    with ServerProcess(["--model", "tiny-llama", "--context-length", "512"]) as srv:
        yield srv


def _gate(url: str, tmp_path, *args: str) -> tuple[int, dict]:
    j = tmp_path / "r.json"
    rc = cli.main(["--url", url, "--quiet", "--json", str(j), *args])
    return rc, json.loads(j.read_text())


def _verdicts(report: dict) -> dict:
    return {p["name"]: p for p in report["probes"]}


@pytest.mark.parametrize("fault", ["none", "greedy"])
def test_temperature_ignored_is_caught(llama, fault, tmp_path):
    with FaultProxy(llama.url, fault) as proxy:
        rc, report = _gate(proxy.url, tmp_path, "--only", "sampled")
    p = _verdicts(report)["sampled"]
    if fault == "none":
        assert rc == 0 and p["verdict"] == "pass", p
        assert p["data"]["p_value"] >= 1e-4
    else:
        assert rc == 2 and p["verdict"] == "fail", p
        assert "frequencies" in p["detail"] and p["data"]["p_value"] < 1e-4


def test_chat_from_another_model_is_caught(llama, tmp_path):
    golden, oracle = tmp_path / "g.json", tmp_path / "o.json"
    rc = cli.main(
        ["record", "--url", llama.url, "--golden", str(golden), "--oracle-out", str(oracle)]
        + ["--quiet"]
    )
    assert rc == 0
    g = json.loads(golden.read_text())
    assert g["chat"] and all(len(c["top_logprobs"]) == c["max_tokens"] for c in g["chat"])
    assert any("messages" in x for x in json.loads(oracle.read_text()))
    check = ["check", "--golden", str(golden), "--oracle", str(oracle), "--only", "oracle,chat"]
    with FaultProxy(llama.url, "none") as proxy:
        rc, report = _gate(proxy.url, tmp_path, *check)
    assert rc == 0, report["probes"]
    kimi_args = ["--model", "tiny-kimi", "--context-length", "512"]
    with ServerProcess(kimi_args) as kimi, FaultProxy(llama.url, f"chat_from:{kimi.url}") as px:
        rc, report = _gate(px.url, tmp_path, *check)
    v = _verdicts(report)
    assert rc == 2, report["probes"]
    assert v["chat"]["verdict"] == "fail" and v["oracle"]["verdict"] == "fail"
    assert "chat" in v["oracle"]["detail"]
    assert any(d["gap"] is not None for d in v["chat"]["data"]["divergences"])


@pytest.mark.parametrize("fault", ["none", "long_garbage:1500"])
def test_long_context_garbage_is_caught_by_the_copy_probe(fault, tmp_path):
    with CopyModel() as model, FaultProxy(model.url, fault) as proxy:
        rc, report = _gate(proxy.url, tmp_path, "--only", "copy")
    p = _verdicts(report)["copy"]
    if fault == "none":
        assert rc == 0 and p["verdict"] == "pass", p
        assert max(r["prompt_tokens"] for r in p["data"]["rungs"]) > 3000
    else:
        assert rc == 2 and p["verdict"] == "fail", p
        assert "not copied" in p["detail"]
        short = [r for r in p["data"]["rungs"] if r["prompt_tokens"] <= 1500]
        assert short and all(r["copied_chars"] >= 8 for r in short)  # fine below the fault


def test_copy_probe_skips_a_model_that_cannot_copy(llama, tmp_path):
    rc, report = _gate(llama.url, tmp_path, "--only", "copy")
    p = _verdicts(report)["copy"]
    assert rc == 0 and p["verdict"] == "skip" and "does not copy" in p["detail"]


@pytest.mark.parametrize("fault", ["none", "no_spec", "no_pinned"])
def test_speculation_that_never_runs_is_caught(fault, tmp_path):
    """With a fault every "on" request decodes plainly, so on equals off and the comparisons
    pass vacuously; the probe pins its requests' budget and counts the server's rounds, so it
    fails. `no_pinned` leaves the other probes' traffic speculating (the determinism probe runs
    first and the adaptive controller starts with a round): the count must be the probe's own.
    Without a fault the same probe passes (the pinned rounds ran)."""
    args = ["--model", "tiny-llama", "--context-length", "512", "--speculative-algorithm",
            "DDTREE", "--speculative-ddtree-budget", "8",
            "--speculative-num-draft-tokens", "4"]  # fmt: skip
    with ServerProcess(args) as srv, FaultProxy(srv.url, fault) as proxy:
        rc, report = _gate(proxy.url, tmp_path, "--only", "determinism,speculation")
    p = _verdicts(report)["speculation"]
    if fault == "none":
        assert rc == 0 and p["verdict"] == "pass", p
        assert "pinned at budget 8" in p["detail"] and "speculative rounds ran" in p["detail"], p
    else:
        assert rc == 2 and p["verdict"] == "fail", p
        assert "no speculative round ran" in p["detail"], p
