"""Exposing the server: bearer auth, body-size limit, stop bounds, aborts on disconnect, 503s
while draining. Real `treeverify serve` subprocesses on loopback, the real openai client."""

from __future__ import annotations

import json
import secrets
import select
import socket
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from treeverify.server.guards import DEFAULT_MAX_REQUEST_BYTES  # noqa: E402
from treeverify.server.testing import ServerProcess  # noqa: E402

CTX = 4096
KEY = "tv-" + secrets.token_hex(16)  # fresh per run


@pytest.fixture(scope="module")
def server():
    args = ["--model", "tiny-llama", "--context-length", str(CTX), "--num-pages", "600"]
    with ServerProcess(args, api_key=KEY) as srv:
        yield srv


def _is_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def _stats(server) -> dict:
    return httpx.get(server.url + "/server_info", headers=server.headers, timeout=10).json()[
        "stats"
    ]


# ---- auth ----------------------------------------------------------------------------------------
def test_every_route_but_health_needs_the_key(server):
    schema = httpx.get(server.url + "/openapi.json", headers=server.headers, timeout=10).json()
    routes = [(m.upper(), p) for p, ops in schema["paths"].items() for m in ops]
    routes += [("GET", "/docs"), ("GET", "/redoc"), ("GET", "/openapi.json")]
    assert ("GET", "/metrics") in routes and ("GET", "/server_info") in routes
    wrong = [
        {},
        {"Authorization": "Bearer " + KEY[:-1]},
        {"Authorization": "Bearer " + KEY + "x"},
        {"Authorization": KEY},
        {"Authorization": "Basic " + KEY},
    ]
    for method, path in routes:
        for headers in wrong:
            r = httpx.request(method, server.url + path, headers=headers, json={}, timeout=10)
            if path in ("/health", "/health_generate"):
                assert r.status_code == 200, (path, r.text)
            else:
                err = _is_openai_error(r, 401)
                assert "Bearer" in err["message"], err
    for path in ("/v1/models", "/metrics", "/server_info", "/docs", "/openapi.json"):
        assert httpx.get(server.url + path, headers=server.headers, timeout=10).status_code == 200
    lower = {"Authorization": "bearer " + KEY}  # the scheme is case-insensitive
    assert httpx.get(server.url + "/v1/models", headers=lower, timeout=10).status_code == 200


def test_openai_client_with_and_without_the_key(server):
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    r = good.completions.create(model="tiny-llama", prompt="hi", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_bench_serve_sends_the_key(server, monkeypatch, capsys):
    import argparse

    from treeverify.server import bench_serve

    p = argparse.ArgumentParser()
    bench_serve.add_parser(p.add_subparsers())
    argv = ["serve", "--url", server.url, "--concurrency", "1", "--num-requests", "2"]
    args = p.parse_args([*argv, "--max-tokens", "2", "--quiet"])
    monkeypatch.delenv("TREEVERIFY_API_KEY", raising=False)
    assert bench_serve.run(args) == 3  # no key: the server's models list is refused
    monkeypatch.setenv("TREEVERIFY_API_KEY", KEY)
    assert bench_serve.run(args) == 0, capsys.readouterr().err


def test_the_key_is_never_shown(server):
    info = httpx.get(server.url + "/server_info", headers=server.headers, timeout=10)
    assert KEY not in info.text and info.json()["server_args"]["api_key"] == "<redacted>"
    assert KEY not in server.log() and "bearer key required" in server.log()


# ---- body limit ----------------------------------------------------------------------------------
def _raw_request(server, head: str) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    s.sendall(head.encode())
    return s


def _read_status(s: socket.socket, timeout: float = 10.0) -> int:
    s.settimeout(timeout)
    data = b""
    while b"\r\n" not in data:
        part = s.recv(4096)
        if not part:
            break
        data += part
    return int(data.split(b" ", 2)[1])


def test_declared_oversized_body_is_413_before_any_byte_is_read(server):
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Length: 20000000\r\n\r\n"
    )
    with _raw_request(server, head) as s:  # not one body byte is sent
        assert _read_status(s) == 413
    r = httpx.post(
        server.url + "/v1/completions",
        content=b"x" * (DEFAULT_MAX_REQUEST_BYTES + 1),
        headers={**server.headers, "Content-Type": "application/json"},
        timeout=30,
    )
    err = _is_openai_error(r, 413)
    assert "--max-request-bytes" in err["message"]
    # refused before routing, still counted under its endpoint (was endpoint="other")
    text = httpx.get(server.url + "/metrics", headers=server.headers, timeout=10).text
    assert 'endpoint="/v1/completions",status="413"' in text


def _send_chunked(server, total: int, chunk: int = 256 * 1024) -> tuple[int, int]:
    """(status, bytes sent) for a chunked body of ``total`` bytes, stopping once answered."""
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    sent = 0
    with _raw_request(server, head) as s:
        piece = f"{chunk:x}\r\n".encode() + b"7" * chunk + b"\r\n"
        while sent < total:
            if select.select([s], [], [], 0)[0]:
                break  # the server answered early
            try:
                s.sendall(piece)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += chunk
        return _read_status(s), sent


def test_chunked_oversized_body_is_counted_and_refused(server):
    status, sent = _send_chunked(server, 3 * DEFAULT_MAX_REQUEST_BYTES)
    assert status == 413
    assert sent < 3 * DEFAULT_MAX_REQUEST_BYTES  # refused while it was still arriving


def test_health_stays_fast_while_oversized_bodies_are_refused(server):
    statuses: list[int] = []
    stop = threading.Event()

    def flood() -> None:
        while not stop.is_set():
            statuses.append(_send_chunked(server, 3 * DEFAULT_MAX_REQUEST_BYTES)[0])

    t = threading.Thread(target=flood)
    t.start()
    try:
        worst = 0.0
        for _ in range(20):
            t0 = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=10).status_code == 200
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.05)
    finally:
        stop.set()
        t.join(30)
    assert statuses and set(statuses) == {413}
    assert worst < 2.0, f"/health took {worst:.2f} s while bodies were refused"


# ---- stop bounds ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "stop", [[f"s{i}" for i in range(17)], ["x" * 257], ["ok", ""]], ids=["17", "long", "empty"]
)
def test_stop_list_is_bounded(server, stop):
    body = {"prompt": "hi", "max_tokens": 2, "stop": stop}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=30)
    assert _is_openai_error(r, 400)["param"] == "stop"


def test_sixteen_stop_strings_are_fine(server):
    body = {"prompt": "hi", "max_tokens": 4, "stop": [f"zz{i}" for i in range(16)]}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=30)
    assert r.status_code == 200, r.text


# ---- disconnect ----------------------------------------------------------------------------------
def test_non_streamed_request_is_aborted_when_its_client_leaves(server):
    before = _stats(server)
    body = {"prompt": "abc", "max_tokens": CTX - 10, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after 1 s and hangs up
        httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=1)
    gone = time.monotonic()
    while time.monotonic() - gone < 10:
        s = _stats(server)
        if s["aborted_requests"] > before["aborted_requests"] and s["running"] == 0:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"not aborted after the client left: {s}")
    took = time.monotonic() - gone
    assert took < 3.0, f"aborted {took:.2f} s after the disconnect"
    generated = s["generated_tokens"] - before["generated_tokens"]
    assert generated < CTX - 10, "the request ran to its end for nobody"
    assert s["kv_used_pages"] == 0


# ---- drain ---------------------------------------------------------------------------------------
def _prompt_tokens_submitted(srv) -> float:
    for line in httpx.get(srv.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("treeverify_prompt_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_drain_answers_503_while_in_flight_requests_finish():
    srv = ServerProcess(
        ["--model", "tiny-llama", "--shutdown-grace", "30"], env={"TREEVERIFY_TEST_HOOKS": "1"}
    ).start()
    try:
        finish: list[str] = []

        def stream() -> None:
            body = {"prompt": "x", "max_tokens": 40, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if not line.startswith("data:") or line.endswith("[DONE]"):
                        continue
                    choice = json.loads(line[5:])["choices"][0]
                    if choice["finish_reason"]:
                        finish.append(choice["finish_reason"])

        # Freeze the engine loop first: the request is then surely in flight, not yet done.
        assert httpx.post(srv.url + "/_test/stall", timeout=10).status_code == 200
        t = threading.Thread(target=stream)
        t.start()
        deadline = time.monotonic() + 20
        while _prompt_tokens_submitted(srv) == 0:  # the handler has handed it to the engine
            assert time.monotonic() < deadline, "the request was never submitted"
            time.sleep(0.05)
        srv.proc.send_signal(15)  # SIGTERM while the request is in flight
        deadline = time.monotonic() + 10
        while httpx.get(srv.url + "/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "health never turned 503 after SIGTERM"
            time.sleep(0.05)
        err = _is_openai_error(httpx.get(srv.url + "/health", timeout=5), 503)
        assert "shutting down" in err["message"]
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "y", "max_tokens": 2})
        assert "shutting down" in _is_openai_error(r, 503)["message"]
        assert srv.proc.poll() is None and not finish  # still draining, the request waits
        assert httpx.post(srv.url + "/_test/resume", timeout=10).status_code == 200
        t.join(30)
        assert finish == ["length"], finish  # the in-flight request ran to its end
        assert srv.proc.wait(30) == 0, srv.log()
    finally:
        srv.stop()
