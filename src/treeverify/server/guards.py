"""What a request must pass before the app sees it: the bearer key, then the body size limit.

Both are pure ASGI middleware, so they decide before FastAPI reads or parses anything:

- ``BearerAuth``: with a key set, every route but the health checks needs
  ``Authorization: Bearer <key>`` (compared in constant time); otherwise 401, OpenAI-style body.
- ``BodyLimit``: a body over ``max_bytes`` is 413. A Content-Length over the limit is refused
  before one body byte is read; a chunked body is counted while it arrives and refused the moment
  it passes the limit (the app never receives it, the event loop never parses it).
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from treeverify.server import protocol as P

OPEN_PATHS = frozenset({"/health", "/health_generate"})  # liveness probes need no key
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024


async def send_error(
    send, status: int, message: str, *, param: str | None = None, code: Any = None, headers=()
) -> None:
    """A complete OpenAI-style JSON error response on a raw ASGI ``send``."""
    body = P.error_body(message, status, param)
    if code is not None:
        body["error"]["code"] = code
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


def _header(scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return v
    return None


class BearerAuth:
    """401 unless ``Authorization: Bearer <api_key>``; /health and /health_generate stay open."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self._expected = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"authorization") or b""
        scheme, _, token = given.strip().partition(b" ")
        # the scheme is case-insensitive (RFC 9110); the key is compared in constant time
        ok = hmac.compare_digest(token.strip(), self._expected)
        if scheme.lower() == b"bearer" and ok:
            await self.app(scope, receive, send)
            return
        why = "no Authorization header" if not given else "the API key is not valid"
        await send_error(
            send,
            401,
            f"authentication required: send 'Authorization: Bearer <key>' ({why})",
            code="invalid_api_key",
            headers=[(b"www-authenticate", b"Bearer")],
        )


class BodyLimit:
    """413 for a request body over ``max_bytes``, decided before the app reads it."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self, size: str) -> str:
        return (
            f"request body is {size}; this server accepts at most {self.max_bytes} bytes "
            f"(--max-request-bytes)"
        )

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                n = -1
            if n < 0:
                await send_error(send, 400, f"invalid Content-Length header {length[:40]!r}")
            elif n > self.max_bytes:
                await send_error(send, 413, self._too_large(f"{n} bytes"))
            else:  # the HTTP server reads exactly n bytes: nothing more can arrive
                await self.app(scope, receive, send)
            return
        # No length (chunked, or no body at all): count while reading, keep at most the limit.
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            part = message.get("body", b"")
            total += len(part)
            if total > self.max_bytes:
                await send_error(send, 413, self._too_large(f"over {self.max_bytes} bytes"))
                return
            chunks.append(part)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # afterwards: http.disconnect, as the app expects

        await self.app(scope, replay, send)
