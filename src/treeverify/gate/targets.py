"""What the gate watches besides HTTP: nothing (a URL), a process it launched, or a systemd unit.

Each target answers ``check()`` with None while alive or a :class:`Down` saying why it is not
(exited, failed, crash-looping) with the log signatures that explain it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import threading

from treeverify.gate import signatures
from treeverify.gate.codes import ExitCode


@dataclasses.dataclass
class Down:
    code: ExitCode
    detail: str


class UrlTarget:
    """Just a URL: no lifecycle to watch."""

    kind = "url"

    def __init__(self, url: str) -> None:
        self.url = url

    def describe(self) -> str:
        return f"url {self.url}"

    def start(self) -> None:
        pass

    def check(self) -> Down | None:
        return None

    def state(self) -> str:
        return "-"

    def smoke_failed(self) -> bool:
        return False

    def log_tail(self, n: int = 40) -> list[str]:
        return []

    def stop(self, grace: float = 0.0) -> None:
        pass


class LaunchTarget:
    """A process the gate starts (its own session), watches, scans and stops."""

    kind = "launch"

    def __init__(self, argv: list[str], url: str, env: dict | None = None) -> None:
        self.argv, self.url, self.env = argv, url, env
        self.proc: subprocess.Popen | None = None
        self.lines: collections.deque[str] = collections.deque(maxlen=5000)
        self.found: list[dict] = []
        self._reader: threading.Thread | None = None

    def describe(self) -> str:
        return f"launched `{shlex.join(self.argv)}` at {self.url}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines.append(line)
            self.found.extend(signatures.scan([line]))

    def check(self) -> Down | None:
        if self.proc is None or self.proc.poll() is None:
            return None
        if self._reader is not None:
            self._reader.join(2.0)  # the last lines explain the exit
        rc = self.proc.returncode
        detail = f"launched process exited with {rc}"
        summary = signatures.summarize(self.found)
        if summary:
            detail += f"; {summary}"
        tail = [line for line in self.log_tail(40) if line.strip()][-3:]
        if tail:  # a one-line refusal (missing package, bad flag) matches no signature
            detail += "; last output: " + " | ".join(tail)
        return Down(ExitCode.UNIT_FAILED, detail)

    def state(self) -> str:
        if self.proc is None:
            return "not started"
        rc = self.proc.poll()
        return f"pid {self.proc.pid} running" if rc is None else f"exited {rc}"

    def smoke_failed(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def log_tail(self, n: int = 40) -> list[str]:
        return list(self.lines)[-n:]

    def stop(self, grace: float = 15.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


def serve_argv(port: int, extra: list[str]) -> list[str]:
    """The default target: our server on the tiny model, loopback, the given port."""
    return [
        sys.executable,
        "-m",
        "treeverify.server.cli",
        "serve",
        "--model",
        "tiny-code",
        *extra,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]


class UnitTarget:
    """A systemd unit: ``systemctl show -p ActiveState,SubState,NRestarts,Result`` and
    ``journalctl -u NAME -n 200 --no-pager``. Failed, inactive, ``activating (auto-restart)`` or
    NRestarts growing while the gate watches all mean the service is down (exit 4)."""

    kind = "unit"

    def __init__(self, name: str, url: str, timeout: float = 10.0) -> None:
        self.name, self.url, self.timeout = name, url, timeout
        self.restarts0: int | None = None
        self.last: dict[str, str] = {}

    def describe(self) -> str:
        return f"systemd unit {self.name} at {self.url}"

    def show(self) -> dict[str, str]:
        out = subprocess.run(
            ["systemctl", "show", self.name, "-p", "ActiveState,SubState,NRestarts,Result"],
            capture_output=True,
            text=True,
            timeout=self.timeout,
        )
        props = {}
        for line in out.stdout.splitlines():
            key, sep, value = line.partition("=")
            if sep:
                props[key.strip()] = value.strip()
        if out.returncode != 0 and not props:
            raise RuntimeError(f"systemctl show failed ({out.returncode}): {out.stderr.strip()}")
        self.last = props
        return props

    def journal(self) -> list[str]:
        try:
            out = subprocess.run(
                ["journalctl", "-u", self.name, "-n", "200", "--no-pager"],
                capture_output=True,
                text=True,
                timeout=self.timeout,
            )
        except (OSError, subprocess.TimeoutExpired):
            return []
        return out.stdout.splitlines()

    def start(self) -> None:
        props = self.show()
        self.restarts0 = _int(props.get("NRestarts"))

    def check(self) -> Down | None:
        try:
            p = self.show()
        except (OSError, subprocess.TimeoutExpired, RuntimeError) as exc:
            return Down(ExitCode.INFRA, f"cannot read the unit's state: {exc}")
        active, sub = p.get("ActiveState", "?"), p.get("SubState", "?")
        restarts = _int(p.get("NRestarts"))
        why = None
        if active == "failed":
            why = f"unit failed (Result={p.get('Result', '?')})"
        elif active == "activating" and sub == "auto-restart":
            why = f"unit crash-looping: activating (auto-restart), NRestarts={restarts}"
        elif self.restarts0 is not None and restarts is not None and restarts > self.restarts0:
            why = f"unit crash-looping: NRestarts grew {self.restarts0} -> {restarts}"
        elif active in ("inactive", "deactivating"):
            why = f"unit is {active} ({sub}), Result={p.get('Result', '?')}"
        if why is None:
            return None
        summary = signatures.summarize(signatures.scan(self.journal()))
        return Down(ExitCode.UNIT_FAILED, why + (f"; journal {summary}" if summary else ""))

    def state(self) -> str:
        p = self.last
        return f"{p.get('ActiveState', '?')} ({p.get('SubState', '?')})" if p else "?"

    def smoke_failed(self) -> bool:
        """The seed's check, verbatim: ``systemctl is-active NAME`` printing ``failed``."""
        try:
            out = subprocess.run(
                ["systemctl", "is-active", self.name],
                capture_output=True,
                text=True,
                timeout=self.timeout,
            )
        except (OSError, subprocess.TimeoutExpired):
            return False
        self.last = {"ActiveState": out.stdout.strip() or "?", "SubState": "is-active"}
        return out.stdout.strip() == "failed"

    def log_tail(self, n: int = 40) -> list[str]:
        return self.journal()[-n:]

    def stop(self, grace: float = 0.0) -> None:
        pass


def _int(v: str | None) -> int | None:
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None
