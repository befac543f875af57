"""The gate's HTTP client: OpenAI-compatible completions (plain and streamed, timed), model list,
our ``/server_info`` when present. Transport errors propagate as ``httpx.TransportError`` (the
caller decides whether to retry); an HTTP error status raises :class:`HttpError`."""

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


@dataclasses.dataclass
class Completion:
    text: str
    tokens: list[str] | None = None
    token_logprobs: list[float] | None = None
    top_logprobs: list[dict[str, float]] | None = None
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


class Client:
    def __init__(
        self,
        url: str,
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
        model: str | None = None,
        api_key: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.read_timeout = read_timeout
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(
            timeout=httpx.Timeout(read_timeout, connect=connect_timeout),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=64),
            headers=headers,
        )

    def close(self) -> None:
        self.http.close()

    def _timeout(self, read: float | None) -> httpx.Timeout:
        t = self.http.timeout
        return httpx.Timeout(
            connect=t.connect, read=read or self.read_timeout, write=t.write, pool=t.pool
        )

    def get_json(self, path: str, read: float | None = None):
        r = self.http.get(self.url + path, timeout=self._timeout(read))
        if r.status_code != 200:
            raise HttpError(r.status_code, r.text)
        return r.json()

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
        return Completion(
            text=choice.get("text") or "",
            tokens=lp.get("tokens"),
            token_logprobs=lp.get("token_logprobs"),
            top_logprobs=lp.get("top_logprobs"),
            finish_reason=choice.get("finish_reason"),
            seconds=dt,
            prompt_tokens=usage.get("prompt_tokens"),
        )

    def stream(
        self, prompt: str, max_tokens: int, deadline: float, extra: dict | None = None
    ) -> Streamed:
        """A streamed greedy completion; ``deadline`` bounds the wait for the first chunk and
        every gap between chunks (raises :class:`Stalled`)."""
        body = self.body(prompt, max_tokens, None, extra)
        body["stream"] = True
        t0 = time.monotonic()
        last, ttft, gaps, parts, finish = t0, None, [], [], None
        try:
            with self.http.stream(
                "POST", self.url + "/v1/completions", json=body, timeout=self._timeout(deadline)
            ) as r:
                if r.status_code != 200:
                    raise HttpError(r.status_code, r.read().decode(errors="replace"))
                for line in r.iter_lines():
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
                        if ch.get("text"):
                            if ttft is None:
                                ttft = now - t0
                            else:
                                gaps.append(now - last)
                            last = now
                            parts.append(ch["text"])
                        finish = ch.get("finish_reason") or finish
        except httpx.ReadTimeout as exc:
            waited = time.monotonic() - last
            raise Stalled(f"no streamed token for {waited:.1f} s (deadline {deadline} s)") from exc
        return Streamed("".join(parts), ttft if ttft is not None else 0.0, gaps, finish)
