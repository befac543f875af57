"""``gate --unit`` against FAKE ``systemctl``/``journalctl`` scripts on PATH: systemd cannot run in
this sandbox, so these scripts replay the real output formats (``systemctl show -p ...`` prints
``Key=Value`` lines; ``systemctl is-active`` prints the state; ``journalctl -u NAME -n 200
--no-pager`` prints syslog-style lines) from a state file the test edits."""

from __future__ import annotations

import json
import os
import stat
import textwrap

import pytest

from treeverify.gate import cli

SYSTEMCTL = textwrap.dedent(
    """\
    #!/bin/sh
    # fake systemctl: state from $FAKE_UNIT_DIR/state ("ActiveState SubState NRestarts Result")
    read active sub restarts result < "$FAKE_UNIT_DIR/state"
    echo "$@" >> "$FAKE_UNIT_DIR/calls"
    if [ -f "$FAKE_UNIT_DIR/restarts_grow" ]; then
        n=$(cat "$FAKE_UNIT_DIR/restarts_grow"); echo $((n + 1)) > "$FAKE_UNIT_DIR/restarts_grow"
        restarts=$n
    fi
    case "$1" in
      show)
        printf 'NRestarts=%s\\nResult=%s\\nActiveState=%s\\nSubState=%s\\n' \\
            "$restarts" "$result" "$active" "$sub" ;;
      is-active)
        echo "$active"; [ "$active" = active ] && exit 0; exit 3 ;;
      *) exit 1 ;;
    esac
    """
)
JOURNALCTL = textwrap.dedent(
    """\
    #!/bin/sh
    cat "$FAKE_UNIT_DIR/journal" 2>/dev/null
    """
)
UNIT = "sglang-k26-ddtree.service"
JOURNAL = "\n".join(
    [
        f"Nov 29 10:01:02 ct200 systemd[1]: Started {UNIT} - SGLang server.",
        "Nov 29 10:03:40 ct200 python[4242]: Capturing cuda graphs: 40%",
        "Nov 29 10:03:41 ct200 python[4242]: Traceback (most recent call last):",
        "Nov 29 10:03:41 ct200 python[4242]: RuntimeError: CUDA error: an illegal memory access"
        " was encountered",
        f"Nov 29 10:03:42 ct200 systemd[1]: {UNIT}: Main process exited, code=exited,"
        " status=1/FAILURE",
        f"Nov 29 10:03:42 ct200 systemd[1]: {UNIT}: Failed with result 'exit-code'.",
    ]
)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, body in (("systemctl", SYSTEMCTL), ("journalctl", JOURNALCTL)):
        p = bin_ / name
        p.write_text(body)
        p.chmod(p.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_UNIT_DIR", str(tmp_path))
    (tmp_path / "journal").write_text(JOURNAL)

    def set_state(line: str) -> None:
        (tmp_path / "state").write_text(line + "\n")

    return tmp_path, set_state


def _gate(tmp_path, *extra) -> tuple[int, dict]:
    j = tmp_path / "r.json"
    argv = ["--unit", "sglang-k26-ddtree", "--interval", "0.2", "--timeout", "5", "--quiet"]
    rc = cli.main([*argv, "--json", str(j), *extra])
    return rc, json.loads(j.read_text())


def test_unit_failed_exits_4_with_journal_signature(fake):
    tmp, set_state = fake
    set_state("failed failed 0 exit-code")
    rc, report = _gate(tmp, "--url", "http://127.0.0.1:9")
    assert rc == 4
    detail = report["probes"][0]["detail"]
    assert "unit failed (Result=exit-code)" in detail
    assert "illegal memory access" in detail and "traceback" in detail  # surfaced from journal


def test_auto_restart_crash_loop_exits_4(fake):
    tmp, set_state = fake
    set_state("activating auto-restart 7 exit-code")
    rc, report = _gate(tmp, "--url", "http://127.0.0.1:9")
    assert rc == 4
    assert "crash-looping: activating (auto-restart)" in report["probes"][0]["detail"]


def test_nrestarts_growing_exits_4(fake):
    tmp, set_state = fake
    set_state("active running 0 success")
    (tmp / "restarts_grow").write_text("3")  # each systemctl call sees one more restart
    rc, report = _gate(tmp, "--url", "http://127.0.0.1:9")
    assert rc == 4
    assert "NRestarts grew" in report["probes"][0]["detail"]


def test_active_unit_proceeds_to_probes(fake):
    """active (running) but the API never answers: the gate keeps polling until its budget,
    i.e. it proceeded past the unit check (hung -> 5), and asked systemctl show each poll."""
    tmp, set_state = fake
    set_state("active running 0 success")
    rc, report = _gate(tmp, "--url", "http://127.0.0.1:9", "--timeout", "1.5")
    assert rc == 5
    calls = (tmp / "calls").read_text().splitlines()
    assert sum(c.startswith("show sglang-k26-ddtree") for c in calls) >= 3
    assert any(
        e["phase"] == "readiness" and "active (running)" in e["detail"] for e in report["timeline"]
    )


def test_active_unit_with_live_server_passes(fake):
    from treeverify.server.testing import ServerProcess

    tmp, set_state = fake
    set_state("active running 0 success")
    with ServerProcess(["--model", "tiny-llama", "--context-length", "256"]) as srv:
        rc, report = _gate(tmp, "--url", srv.url, "--timeout", "60", "--concurrency", "1,3")
    assert rc == 0, [p for p in report["probes"] if p["verdict"] == "fail"]


def test_smoke_mode_uses_is_active_like_the_seed(fake):
    tmp, set_state = fake
    set_state("failed failed 0 exit-code")
    j = tmp / "s.json"
    rc = cli.main(
        ["--unit", "x", "--url", "http://127.0.0.1:9", "--probes", "smoke", "--interval", "0.1"]
        + ["--tries", "3", "--quiet", "--json", str(j)]
    )
    assert rc == 4
    assert "is-active x" in (tmp / "calls").read_text()
