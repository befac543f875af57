"""The gate's HTTP client: OpenAI-compatible completions (plain and streamed, timed), model list,
our ``/server_info`` when present. Transport errors propagate as ``httpx.TransportError`` (the
caller decides whether to retry); an HTTP error status raises :class:`HttpError`.

The run's budget is a hard cap: with ``deadline`` set (a ``time.monotonic()`` instant), every
request waits at most min(its own timeout, what is left), and a request started with nothing
left raises :class:`BudgetSpent`. Token identity: ``token_ids`` (our server's extension of the
completions logprobs) when the server gives it, else the token strings."""

from __future__ import annotations

import dataclasses
import json
import time

import httpx


class HttpError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status, self.body = status, body


class Stalled(Exception):
    """A streamed request produced no chunk within the inter-token deadline."""


class BudgetSpent(Exception):
    """The run's overall budget (``--timeout``) ran out before or during a request."""


@dataclasses.dataclass
class Completion:
    text: str
    tokens: list[str] | None = None
    token_logprobs: list[float] | None = None
    top_logprobs: list[dict[str, float]] | None = None
    token_ids: list[int] | None = None  # the server's extension, when it gives one
    finish_reason: str | None = None
    seconds: float = 0.0
    prompt_tokens: int | None = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Streamed:
    text: str
    ttft: float
    gaps: list[float]  # seconds between consecutive chunks
    finish_reason: str | None


# A pooled connection idle this long is dropped rather than reused. httpx's default (5 s) equals
# uvicorn's keep-alive timeout (ours, SGLang's): a request sent just as the server closes the
# idle connection dies unanswered ("Server disconnected"), a transport error the gate would
# report as INFRA on a healthy server. Reconnecting after a second's idle costs ~1 ms.
KEEPALIVE_S = 1.0


class Client:
    def __init__(
        self,
        url: str,
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
        model: str | None = None,
        api_key: str | None = None,
        deadline: float | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.read_timeout = read_timeout
        self.deadline = deadline  # time.monotonic() instant the whole run must end by
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(
            timeout=httpx.Timeout(read_timeout, connect=connect_timeout),
            limits=httpx.Limits(
                max_connections=64, max_keepalive_connections=64, keepalive_expiry=KEEPALIVE_S
            ),
            headers=headers,
        )

    def close(self) -> None:
        self.http.close()

    def left(self) -> float | None:
        """Seconds left of the run's budget (None: no budget)."""
        return None if self.deadline is None else self.deadline - time.monotonic()

    def _timeout(self, read: float | None) -> httpx.Timeout:
        t = self.http.timeout
        read = read or self.read_timeout
        connect, write, pool = t.connect, t.write, t.pool
        left = self.left()
        if left is not None:
            if left <= 0:
                raise BudgetSpent("the run's budget (--timeout) is spent")
            read, connect = min(read, left), min(connect or left, left)
            write, pool = min(write or left, left), min(pool or left, left)
        return httpx.Timeout(connect=connect, read=read, write=write, pool=pool)

    def get_json(self, path: str, read: float | None = None):
        r = self.http.get(self.url + path, timeout=self._timeout(read))
        if r.status_code != 200:
            raise HttpError(r.status_code, r.text)
        return r.json()

    def post_json(self, path: str, body: dict):
        """POST ``body`` to ``path`` within the budget; the JSON answer (HttpError unless 200)."""
        r = self.http.post(self.url + path, json=body, timeout=self._timeout(None))
        if r.status_code != 200:
            raise HttpError(r.status_code, r.text)
        try:
            return r.json()
        except ValueError as exc:
            raise HttpError(r.status_code, f"not JSON ({exc}): {r.text}") from exc

    def models(self) -> list[dict]:
        return list(self.get_json("/v1/models").get("data") or [])

    def server_info(self) -> dict | None:
        """Our server's /server_info; None where the server has none (SGLang/vLLM differ)."""
        try:
            info = self.get_json("/server_info")
        except (HttpError, ValueError):
            return None
        return info if isinstance(info, dict) else None

    def resolve_model(self) -> str:
        if self.model is None:
            data = self.models()
            if not data:
                raise HttpError(200, "/v1/models lists no model")
            self.model = data[0]["id"]
        return self.model

    def body(self, prompt, max_tokens: int, logprobs: int | None, extra: dict | None) -> dict:
        b = {
            "model": self.model,
            "prompt": prompt,
            "temperature": 0,
            "max_tokens": max_tokens,
        }
        if logprobs:
            b["logprobs"] = logprobs
        b.update(extra or {})
        return b

    def complete(
        self,
        prompt: str,
        max_tokens: int,
        logprobs: int | None = None,
        extra: dict | None = None,
        read: float | None = None,
    ) -> Completion:
        t0 = time.monotonic()
        r = self.http.post(
            self.url + "/v1/completions",
            json=self.body(prompt, max_tokens, logprobs, extra),
            timeout=self._timeout(read),
        )
        dt = time.monotonic() - t0
        if r.status_code != 200:
            raise HttpError(r.status_code, r.text)
        try:
            choice = r.json()["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise HttpError(r.status_code, f"no choices in the response ({exc}): {r.text}") from exc
        lp = choice.get("logprobs") or {}
        usage = r.json().get("usage") or {}
        ids = lp.get("token_ids")
        return Completion(
            text=choice.get("text") or "",
            tokens=lp.get("tokens"),
            token_logprobs=lp.get("token_logprobs"),
            top_logprobs=lp.get("top_logprobs"),
            token_ids=ids if isinstance(ids, list) else None,
            finish_reason=choice.get("finish_reason"),
            seconds=dt,
            prompt_tokens=usage.get("prompt_tokens"),
        )

    def chat(
        self,
        messages: list[dict],
        max_tokens: int,
        top_logprobs: int | None = None,
        extra: dict | None = None,
    ) -> Completion:
        """A chat completion (greedy unless ``extra`` says otherwise), its logprobs flattened
        into the completions shape (tokens, token_logprobs, top_logprobs) so one compare rule
        serves both."""
        body = {"model": self.model, "messages": messages, "temperature": 0}
        body["max_tokens"] = max_tokens
        if top_logprobs is not None:
            body.update(logprobs=True, top_logprobs=top_logprobs)
        body.update(extra or {})
        t0 = time.monotonic()
        url = self.url + "/v1/chat/completions"
        r = self.http.post(url, json=body, timeout=self._timeout(None))
        dt = time.monotonic() - t0
        if r.status_code != 200:
            raise HttpError(r.status_code, r.text)
        try:
            choice = r.json()["choices"][0]
            text = (choice.get("message") or {}).get("content") or ""
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            raise HttpError(r.status_code, f"no choices in the response ({exc}): {r.text}") from exc
        out = Completion(text=text, finish_reason=choice.get("finish_reason"), seconds=dt)
        content = (choice.get("logprobs") or {}).get("content")
        if isinstance(content, list):
            out.tokens = [_chat_key(e) for e in content]
            out.token_logprobs = [e.get("logprob") for e in content]
            out.top_logprobs = [
                {_chat_key(t): t.get("logprob") for t in e.get("top_logprobs") or []}
                for e in content
            ]
        return out

    def stream(
        self,
        prompt: str,
        max_tokens: int,
        deadline: float,
        extra: dict | None = None,
        messages: list[dict] | None = None,
    ) -> Streamed:
        """A streamed greedy completion (a chat one when ``messages`` is given); ``deadline``
        bounds the wait for the first chunk and every gap between chunks (raises
        :class:`Stalled`)."""
        if messages is None:
            path, body = "/v1/completions", self.body(prompt, max_tokens, None, extra)
        else:
            path = "/v1/chat/completions"
            body = {"model": self.model, "messages": messages, "temperature": 0}
            body.update(max_tokens=max_tokens, **(extra or {}))
        body["stream"] = True
        t0 = time.monotonic()
        last, ttft, gaps, parts, finish = t0, None, [], [], None
        try:
            with self.http.stream(
                "POST", self.url + path, json=body, timeout=self._timeout(deadline)
            ) as r:
                if r.status_code != 200:
                    raise HttpError(r.status_code, r.read().decode(errors="replace"))
                for line in r.iter_lines():
                    left = self.left()
                    if left is not None and left <= 0:
                        raise BudgetSpent("the run's budget (--timeout) ran out mid-stream")
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    now = time.monotonic()
                    try:
                        ev = json.loads(data)
                    except ValueError:
                        continue
                    for ch in ev.get("choices") or []:
                        piece = ch.get("text") or (ch.get("delta") or {}).get("content")
                        if piece:
                            if ttft is None:
                                ttft = now - t0
                            else:
                                gaps.append(now - last)
                            last = now
                            parts.append(piece)
                        finish = ch.get("finish_reason") or finish
        except httpx.ReadTimeout as exc:
            left = self.left()
            if left is not None and left <= 0:
                raise BudgetSpent("the run's budget (--timeout) ran out mid-stream") from exc
            waited = time.monotonic() - last
            raise Stalled(f"no streamed token for {waited:.1f} s (deadline {deadline} s)") from exc
        return Streamed("".join(parts), ttft if ttft is not None else 0.0, gaps, finish)


def _chat_key(entry: dict) -> str:
    """A chat logprob entry's token as a key: its text, or its bytes where the text is not
    the whole token (a partial UTF-8 character decodes to U+FFFD)."""
    tok = entry.get("token") or ""
    raw = entry.get("bytes")
    if "\ufffd" in tok and isinstance(raw, list):
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return tok
