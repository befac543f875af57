"""Readiness (sd_notify on a real unix socket), health meaning (a stalled engine loop), SIGTERM."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from treeverify.server.testing import ServerProcess  # noqa: E402

HEARTBEAT_TIMEOUT = 1.0
GENERATE_TIMEOUT = 1.5


class NotifySocket:
    """A real AF_UNIX datagram socket standing in for systemd's $NOTIFY_SOCKET."""

    def __init__(self, path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.messages: list[str] = []

    def wait_for(self, needle: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(needle in m for m in self.messages):
                return True
            with contextlib.suppress(TimeoutError):
                self.messages.append(self.sock.recv(4096).decode())
        return any(needle in m for m in self.messages)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def notified_server(tmp_path_factory):
    notify = NotifySocket(tmp_path_factory.mktemp("sd") / "notify.sock")
    srv = ServerProcess(
        [
            "--model",
            "tiny-llama",
            "--context-length",
            "256",
            "--health-heartbeat-timeout",
            str(HEARTBEAT_TIMEOUT),
            "--health-generate-timeout",
            str(GENERATE_TIMEOUT),
        ],
        env={"NOTIFY_SOCKET": notify.path, "TREEVERIFY_TEST_HOOKS": "1"},
    )
    with srv:
        yield srv, notify
    notify.close()


def test_ready_arrives_on_notify_socket(notified_server):
    srv, notify = notified_server
    assert notify.wait_for("READY=1", 10), notify.messages
    ready = next(m for m in notify.messages if "READY=1" in m)
    assert f"MAINPID={srv.proc.pid}" in ready
    log = srv.log()
    for phase in ("engine init", "KV cache:", "warmup forward", "graph capture", "ready"):
        assert phase in log, (phase, log)


def test_health_endpoints_when_engine_is_fine(notified_server):
    srv, _ = notified_server
    assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
    assert httpx.get(srv.url + "/health_generate", timeout=10).status_code == 200


def test_health_reports_a_stalled_engine_loop(notified_server):
    srv, _ = notified_server
    assert httpx.post(srv.url + "/_test/stall", timeout=5).status_code == 200
    try:
        t0 = time.monotonic()
        r = httpx.get(srv.url + "/health_generate", timeout=GENERATE_TIMEOUT + 5)
        elapsed = time.monotonic() - t0
        assert r.status_code == 503, r.text
        assert "health_generate" in r.json()["error"]["message"]
        assert GENERATE_TIMEOUT - 0.1 <= elapsed <= GENERATE_TIMEOUT + 2
        deadline = time.monotonic() + HEARTBEAT_TIMEOUT + 3
        while time.monotonic() < deadline:
            r = httpx.get(srv.url + "/health", timeout=5)
            if r.status_code == 503:
                break
            time.sleep(0.1)
        assert r.status_code == 503 and "heartbeat" in r.json()["error"]["message"]
    finally:
        httpx.post(srv.url + "/_test/resume", timeout=5)
    deadline = time.monotonic() + 5
    while httpx.get(srv.url + "/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "health did not recover after resume"
        time.sleep(0.05)
    assert httpx.get(srv.url + "/health_generate", timeout=10).status_code == 200
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200


def test_test_hooks_absent_from_schema(notified_server):
    srv, _ = notified_server
    paths = httpx.get(srv.url + "/openapi.json", timeout=5).json()["paths"]
    assert "/_test/stall" not in paths and "/v1/completions" in paths


def test_sigterm_cancels_in_flight_and_exits_zero(tmp_path):
    notify = NotifySocket(tmp_path / "notify.sock")
    srv = ServerProcess(
        ["--model", "tiny-llama", "--shutdown-grace", "0.5"], env={"NOTIFY_SOCKET": notify.path}
    ).start()
    try:
        assert notify.wait_for("READY=1", 10)
        finish: list[str | None] = []
        first_token = threading.Event()

        def stream() -> None:
            body = {"prompt": "x", "max_tokens": 3000, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if not line.startswith("data:") or line.endswith("[DONE]"):
                        continue
                    choice = json.loads(line[5:])["choices"][0]
                    first_token.set()
                    if choice["finish_reason"]:
                        finish.append(choice["finish_reason"])

        t = threading.Thread(target=stream)
        t.start()
        assert first_token.wait(20)
        assert srv.terminate(timeout=30) == 0, srv.log()
        t.join(10)
        assert finish == ["abort"], finish
        assert notify.wait_for("STOPPING=1", 5), notify.messages
        assert "shutdown: done" in srv.log()
    finally:
        srv.stop()
        notify.close()
