"""The gate on a healthy server: no false alarm (three runs on tiny-llama, one on tiny-kimi, both
with DDTree speculation), reports written, ``gate record`` then ``gate check`` passes, an oracle
recorded from it passes, and a latency regression beyond the configured factor exits 1."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from treeverify.gate import cli
from treeverify.server.testing import ServerProcess

SERVE = [
    "--model",
    "tiny-llama",
    "--context-length",
    "512",
    "--speculative-algorithm",
    "DDTREE",
    "--speculative-ddtree-budget",
    "8",
    "--speculative-num-draft-tokens",
    "4",
]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(SERVE) as srv:
        yield srv


@pytest.fixture(scope="module")
def recorded(server, tmp_path_factory):
    d = tmp_path_factory.mktemp("golden")
    golden, oracle = d / "golden.json", d / "oracle.json"
    argv = ["record", "--url", server.url, "--golden", str(golden), "--oracle-out", str(oracle)]
    assert cli.main([*argv, "--quiet"]) == 0
    return golden, oracle


def test_three_healthy_runs_pass(server, tmp_path, capsys):
    for i in range(3):
        j, x = tmp_path / f"g{i}.json", tmp_path / f"g{i}.xml"
        rc = cli.main(["--url", server.url, "--json", str(j), "--junit", str(x)])
        out = capsys.readouterr().out
        assert rc == 0, out
        assert "GATE PASS" in out and "readiness" in out  # timeline + table
        report = json.loads(j.read_text())
        assert report["exit_code"] == 0 and report["verdict"] == "pass"
        names = {p["name"]: p["verdict"] for p in report["probes"]}
        for probe in ("readiness", "determinism", "ladder", "concurrency", "speculation"):
            assert names[probe] == "pass", report
        for probe in ("chat", "sampled"):
            assert names[probe] == "pass", report
        # the seeded-reproducibility requests pinned at the server's budget (gate/sampled.py)
        sampled = next(p for p in report["probes"] if p["name"] == "sampled")
        assert sampled["data"]["speculative_budget"] == 8, sampled
        assert "reproducible at budget 8" in sampled["detail"], sampled
        assert names["copy"] == "skip"  # random weights do not copy
        ready = report["probes"][0]["detail"]
        assert ready.startswith("ready: model 'tiny-llama' completed (HTTP 200")
        assert "after start" in ready
        conc = next(p for p in report["probes"] if p["name"] == "concurrency")
        assert max(conc["data"]["sizes"]) == 64  # the server's --max-running-requests
        suite = ET.parse(x).getroot().find("testsuite")
        assert suite.get("failures") == "0" and len(suite.findall("testcase")) == len(names)


def test_tiny_kimi_with_ddtree_passes(tmp_path):
    args = [a if a != "tiny-llama" else "tiny-kimi" for a in SERVE]
    with ServerProcess([*args, "--max-running-requests", "24"]) as kimi:
        j = tmp_path / "k.json"
        rc = cli.main(["--url", kimi.url, "--json", str(j), "--quiet"])
        report = json.loads(j.read_text())
    assert rc == 0, [p for p in report["probes"] if p["verdict"] == "fail"]
    conc = next(p for p in report["probes"] if p["name"] == "concurrency")
    assert max(conc["data"]["sizes"]) == 24


def test_record_then_check_passes(server, recorded, tmp_path):
    golden, oracle = recorded
    g = json.loads(golden.read_text())
    assert len(g["suite"]) == 6 and g["ladder"] and g["context_length"] == 512
    assert all(len(s["top_logprobs"]) == s["max_tokens"] for s in g["suite"])
    j = tmp_path / "check.json"
    rc = cli.main(
        ["check", "--url", server.url, "--golden", str(golden), "--oracle", str(oracle)]
        + ["--json", str(j), "--quiet"]
    )
    report = json.loads(j.read_text())
    assert rc == 0, [p for p in report["probes"] if p["verdict"] not in ("pass", "skip")]
    verdicts = {p["name"]: p["verdict"] for p in report["probes"]}
    assert verdicts["golden"] == verdicts["oracle"] == verdicts["ladder"] == "pass"
    assert verdicts["chat"] == "pass" and g["chat"]
    assert "golden" in report["probes"][-1]["data"]  # latency compared with the golden run's


def test_latency_regression_exits_1(server, recorded, tmp_path):
    golden, _ = recorded
    g = json.loads(golden.read_text())
    g["latency"] = {k: 1e-6 for k in g["latency"]}  # a golden run 'impossibly' fast
    fast = tmp_path / "fast.json"
    fast.write_text(json.dumps(g))
    j = tmp_path / "r.json"
    rc = cli.main(
        ["check", "--url", server.url, "--golden", str(fast), "--perf-factor", "2"]
        + ["--perf-slack", "0", "--json", str(j), "--quiet"]
    )
    report = json.loads(j.read_text())
    assert rc == 1, report["probes"]
    assert [p["name"] for p in report["probes"] if p["verdict"] == "fail"] == ["latency"]
    # generous defaults: the same golden with the default factor/slack passes
    j2 = tmp_path / "r2.json"
    rc = cli.main(["check", "--url", server.url, "--golden", str(golden), "--quiet",
                   "--json", str(j2)])  # fmt: skip
    bad = [p for p in json.loads(j2.read_text())["probes"] if p["verdict"] == "fail"]
    assert rc == 0, bad
