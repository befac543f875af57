"""Test doubles for the gate's tests, all real HTTP on loopback: a server that accepts and never
answers, a fault proxy in front of a real server, and a copying "model" (a long-context copy
probe needs a model that copies; the random-weight tiny models do not).

FaultProxy faults (one at a time):
- ``hang_after:N``   /v1/completions requests after the N-th hang until the proxy stops;
- ``greedy``         temperature forced to 0 (a server that ignores temperature);
- ``chat_from:URL``  chat answered by another server (another model);
- ``long_garbage:N`` completions whose prompt is over N tokens answered with deterministic
                     garbage of the same length (non-streamed responses);
- ``no_spec``        every request sent with ``"speculative": false`` (and no
                     ``speculative_budget``): speculation silently off while /server_info says on;
- ``no_pinned``      only requests that pin ``speculative_budget`` sent with
                     ``"speculative": false``: other traffic still runs rounds.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx


class _Http:
    """A ThreadingHTTPServer on a free loopback port, run in a thread (context manager)."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.stopping = threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.server.owner = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()


class Silent:
    """Accepts TCP connections, reads nothing, answers nothing."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)

    def __enter__(self) -> Silent:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # quiet
        pass

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _json(self, status: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def garbage(seed: str, n: int) -> str:
    """Deterministic letters, ``n`` of them, from ``seed``."""
    out, h = [], hashlib.sha256(seed.encode()).digest()
    while len(out) < n:
        out += [chr(ord("a") + b % 26) for b in h]
        h = hashlib.sha256(h).digest()
    return "".join(out[:n])


class _ProxyHandler(_Handler):
    def do_GET(self) -> None:
        self._forward(b"")

    def do_POST(self) -> None:
        self._forward(self._body())

    def _forward(self, raw: bytes) -> None:
        proxy: FaultProxy = self.server.owner  # type: ignore[attr-defined]
        name, _, arg = proxy.fault.partition(":")
        upstream, path = proxy.upstream, self.path
        body = json.loads(raw) if raw else None
        if path == "/v1/completions":
            with proxy.lock:
                proxy.completions += 1
                count = proxy.completions
            if name == "hang_after" and count > int(arg):
                proxy.stopping.wait()
                return
        if name == "greedy" and isinstance(body, dict) and "temperature" in body:
            body["temperature"] = 0
        pinned = isinstance(body, dict) and "speculative_budget" in body
        if (name == "no_spec" and isinstance(body, dict)) or (name == "no_pinned" and pinned):
            body.pop("speculative_budget", None)
            body["speculative"] = False
        if name == "chat_from" and path == "/v1/chat/completions":
            upstream = arg
            body.pop("model", None)
        headers = {k: v for k, v in self.headers.items() if k.lower() == "authorization"}
        with httpx.Client(timeout=600) as http:
            method = "POST" if raw else "GET"
            with http.stream(method, upstream + path, json=body, headers=headers) as r:
                if "text/event-stream" in r.headers.get("content-type", ""):
                    self.send_response(r.status_code)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    for chunk in r.iter_raw():
                        self.wfile.write(chunk)
                        self.wfile.flush()
                    return
                data = r.read()
        if name == "long_garbage" and path == "/v1/completions" and r.status_code == 200:
            obj = json.loads(data)
            if (obj.get("usage") or {}).get("prompt_tokens", 0) > int(arg):
                for ch in obj["choices"]:
                    ch["text"] = garbage(json.dumps(body.get("prompt")), len(ch["text"]))
                data = json.dumps(obj).encode()
        self.send_response(r.status_code)
        self.send_header("Content-Type", r.headers.get("content-type", "application/json"))
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class FaultProxy(_Http):
    def __init__(self, upstream: str, fault: str) -> None:
        super().__init__(_ProxyHandler)
        self.upstream, self.fault = upstream.rstrip("/"), fault
        self.lock = threading.Lock()
        self.completions = 0


class _CopyHandler(_Handler):
    """One character = one token; greedy continuation = copy what followed the longest earlier
    occurrence of the prompt's tail (an induction head, idealised)."""

    CONTEXT = 4096

    def _authorized(self) -> bool:
        key = self.server.owner.api_key  # type: ignore[attr-defined]
        if key is None or self.headers.get("Authorization") == f"Bearer {key}":
            return True
        self._json(401, {"error": {"message": "bad key", "type": "authentication_error"}})
        return False

    def do_GET(self) -> None:
        if not self._authorized():
            return
        if self.path == "/v1/models":
            card = {"id": "copycat", "object": "model", "max_model_len": self.CONTEXT}
            self._json(200, {"object": "list", "data": [card]})
        else:
            self._json(404, {"error": {"message": "not found", "type": "not_found_error"}})

    def do_POST(self) -> None:
        req = json.loads(self._body() or b"{}")
        if not self._authorized():
            return
        if self.path != "/v1/completions" or not isinstance(req.get("prompt"), str):
            self._json(404, {"error": {"message": "completions only", "type": "not_found"}})
            return
        prompt, n = req["prompt"], int(req.get("max_tokens") or 16)
        if len(prompt) + n > self.CONTEXT:
            self._json(400, {"error": {"message": "max_tokens: too long", "type": "invalid"}})
            return
        text = copy_continuation(prompt, n)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n}
        choice = {"index": 0, "text": text, "finish_reason": "length", "logprobs": None}
        self._json(200, {"object": "text_completion", "choices": [choice], "usage": usage})


def copy_continuation(prompt: str, n: int, tail: int = 24) -> str:
    key = prompt[-tail:]
    at = prompt.rfind(key, 0, len(prompt) - 1)
    if len(prompt) <= tail or at < 0:
        return "?" * n
    src = prompt[at + len(key) :] + prompt
    return src[:n]


class CopyModel(_Http):
    def __init__(self, api_key: str | None = None) -> None:
        super().__init__(_CopyHandler)
        self.api_key = api_key  # when set, every route demands "Authorization: Bearer KEY"
