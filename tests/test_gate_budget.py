"""Budgets are hard caps: a server that accepts and never answers, or one whose completions hang
after the third, ends the run within ``--timeout`` (+ the runner's grace) with exit 5; every
request waits at most what is left of the budget."""

from __future__ import annotations

import json
import os
import random
import sys
import time

import httpx
import pytest

from gate_doubles import FaultProxy, Silent
from treeverify.gate import cli, runner
from treeverify.gate.client import BudgetSpent, Client
from treeverify.server.testing import ServerProcess

SLACK = 3.0  # seconds beyond --timeout + GRACE allowed for start-up and teardown of the gate


def test_request_waits_at_most_what_is_left():
    left = random.uniform(0.6, 1.2)
    with Silent() as silent:
        c = Client(silent.url, read_timeout=60, deadline=time.monotonic() + left)
        t0 = time.monotonic()
        with pytest.raises(httpx.TimeoutException):
            c.complete("hello", 4)
        assert time.monotonic() - t0 < left + 1.0
        with pytest.raises(BudgetSpent):
            c.complete("hello", 4)  # nothing left: refused before it is sent
        c.close()


def test_silent_server_ends_within_timeout(tmp_path):
    budget = random.uniform(2.0, 4.0)
    j = tmp_path / "r.json"
    with Silent() as silent:
        t0 = time.monotonic()
        rc = cli.main(
            ["--url", silent.url, "--timeout", f"{budget:.2f}", "--read-timeout", "60"]
            + ["--interval", "0.2", "--quiet", "--json", str(j)]
        )
        took = time.monotonic() - t0
    assert rc == 5
    assert took < budget + runner.GRACE + SLACK, took
    report = json.loads(j.read_text())
    assert report["probes"][0]["name"] == "readiness" and report["exit_code"] == 5


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["--model", "tiny-llama", "--context-length", "512"]) as srv:
        yield srv


def test_hang_after_third_completion_ends_within_timeout(server, tmp_path):
    budget = random.uniform(8.0, 10.0)
    j = tmp_path / "r.json"
    with FaultProxy(server.url, "hang_after:3") as proxy:
        t0 = time.monotonic()
        rc = cli.main(
            ["--url", proxy.url, "--timeout", f"{budget:.2f}", "--read-timeout", "120"]
            + ["--itl-deadline", "120", "--quiet", "--json", str(j)]
        )
        took = time.monotonic() - t0
    report = json.loads(j.read_text())
    assert rc == 5, report["probes"]
    assert took < budget + runner.GRACE + SLACK, took
    failed = [p for p in report["probes"] if p["verdict"] == "fail"]
    assert failed and failed[-1]["code"] == 5
    assert "--timeout" in failed[-1]["detail"] or "budget" in failed[-1]["detail"]
    assert proxy.completions > 3  # it really got past readiness and then hung


def test_launched_server_ignoring_sigterm_is_killed_within_the_budget(tmp_path):
    script = tmp_path / "stubborn.py"
    pidfile = tmp_path / "pid"
    script.write_text(
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"open({str(pidfile)!r}, 'w').write(str(os.getpid()))\n"
        "print('loading', flush=True)\ntime.sleep(600)\n"
    )
    budget = random.uniform(2.0, 3.0)
    t0 = time.monotonic()
    rc = cli.main(
        ["--launch", f"{sys.executable} {script} --port 9", "--timeout", f"{budget:.2f}"]
        + ["--ready-timeout", "600", "--interval", "0.2", "--quiet"]
    )
    took = time.monotonic() - t0
    assert rc == 5
    assert took < budget + 2 * runner.GRACE + SLACK, took
    pid = int(pidfile.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # SIGKILLed and reaped, not left behind
