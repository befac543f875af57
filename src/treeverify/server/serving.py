"""Completions and chat: OpenAI request -> engine requests -> OpenAI response or SSE stream.

``n`` > 1 and a list of prompts both become several engine requests of one job; choice index is
``prompt_index * n + j`` and, with a seed, choice j samples with ``seed + j``. Streaming text is
detokenized incrementally; text that could still turn out to be (part of) a stop string or an
incomplete UTF-8 character is held back, so the concatenated stream equals the non-streamed text.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from treeverify.engine.sampling_params import SamplingParams
from treeverify.server import protocol as P
from treeverify.server.engine_loop import EngineLoop, Event, Job
from treeverify.server.logprob_keys import distinct_keys, token_bytes
from treeverify.server.metrics import Metrics

MAX_CHOICES = 64  # prompts x n per HTTP request
DISCONNECT_POLL_S = 0.25
# Text longer than context x (the most characters one token stands for) x TEXT_SLACK is refused
# before it is encoded: it cannot fit the context (the slack covers normalizers that shorten
# text), and encoding it holds the GIL throughout (a 7.7 MB prompt under the 8 MiB body limit
# took 18.7 s on tiny-code's tokenizer, /health unanswered meanwhile: a new user's audit).
TEXT_SLACK = 2
NAME_IN_TEMPLATE = re.compile(r"""\[\s*['"]name['"]\s*\]|\.name\b""")  # message['name'], .name


class RequestError(Exception):
    """A request the server refuses: an HTTP status, a message, the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


@dataclass
class Choice:
    index: int
    prompt_len: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    text: str | None = None
    sent_text: str = ""
    last_event: float | None = None
    echo: str | None = None  # completions with echo: the prompt's text, sent before the reply
    prompt_logprobs: list[Any] | None = None  # echo with logprobs: the prompt tokens'
    echo_sent: bool = False


class Serving:
    """The completions and chat endpoints over one engine loop."""

    def __init__(
        self,
        engine: EngineLoop,
        model_name: str,
        context_length: int,
        metrics: Metrics,
        default_max_tokens: int | None = None,
    ) -> None:
        self.engine = engine
        self.tok = engine.llm.tokenizer
        self.vocab_size: int = engine.llm.vocab_size
        self.model_name = model_name
        self.context_length = context_length
        self.metrics = metrics
        self.default_max_tokens = default_max_tokens
        # whether the chat template reads a message's `name` (message['name'] / message.name)
        template = getattr(self.tok, "chat_template", None) or ""
        self.template_takes_names = bool(NAME_IN_TEMPLATE.search(template))
        per_token = getattr(self.tok, "max_token_chars", None)
        self.max_text_chars: int | None = (
            context_length * per_token() * TEXT_SLACK if per_token is not None else None
        )

    # ---- preparation ---------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise RequestError(
                404,
                f"model: {model!r} is not served here; this server serves "
                f"{self.model_name!r} (see GET /v1/models)",
                "model",
            )

    def check_text_length(self, chars: int, param: str) -> None:
        """Refuse text that cannot fit the context whatever it encodes to (TEXT_SLACK)."""
        limit = self.max_text_chars
        if limit is not None and chars > limit:
            raise RequestError(
                400,
                f"{param}: {chars} characters of text cannot fit the context length "
                f"{self.context_length} tokens (at most {limit} characters are read)",
                param,
            )

    def encode(self, text: str, param: str = "prompt") -> list[int]:
        self.check_text_length(len(text), param)
        try:  # every tokenizer raises UnicodeError for text UTF-8 cannot encode
            return self.tok.encode(text, add_bos=bool(getattr(self.tok, "add_bos", False)))
        except UnicodeError as exc:  # e.g. a lone surrogate from a "\udxxx" JSON escape
            raise RequestError(400, f"{param}: not encodable text ({exc})", param) from exc

    def completion_prompts(self, req: P.CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if isinstance(p, str):
            prompts = [self.encode(p)]
        elif not p:
            raise RequestError(400, "prompt: must not be an empty list", "prompt")
        elif isinstance(p[0], str):
            prompts = [self.encode(s) for s in p]
        elif isinstance(p[0], int):
            prompts = [list(p)]
        else:
            prompts = [list(x) for x in p]
        for ids in prompts:
            if not ids:
                raise RequestError(400, "prompt: must not be empty", "prompt")
            if self.vocab_size is not None and max(ids) >= self.vocab_size:
                raise RequestError(
                    400,
                    f"prompt: token id {max(ids)} is outside the vocabulary "
                    f"(0..{self.vocab_size - 1})",
                    "prompt",
                )
        return prompts

    def chat_prompt(self, req: P.ChatCompletionRequest) -> list[int]:
        for i, m in enumerate(req.messages):
            if m.name is not None and not self.template_takes_names:
                raise RequestError(
                    400,
                    f"messages.{i}.name: this model's chat template has no place for a "
                    "participant name (it would be dropped)",
                    f"messages.{i}.name",
                )
        messages = [{"role": m.role, "content": m.text()} | ({"name": m.name} if m.name else {})
                    for m in req.messages]  # fmt: skip
        self.check_text_length(sum(len(m["content"]) for m in messages), "messages")
        try:
            text = self.tok.apply_chat_template(messages, add_generation_prompt=True)
        except ValueError as exc:
            raise RequestError(400, f"messages: {exc}", "messages") from exc
        ids = self.encode(text, "messages")
        if not ids:
            raise RequestError(400, "messages: the rendered prompt is empty", "messages")
        return ids

    def make_params(
        self,
        req: Any,
        prompts: list[list[int]],
        logprobs: int | None,
        max_tokens: int | None,
        prompt_field: str,
        limit_field: str = "max_tokens",
    ) -> list[tuple[list[int], SamplingParams]]:
        """One (ids, SamplingParams) per choice, after the context-length checks;
        `limit_field`: the name the request gave max_tokens (chat: max_completion_tokens)."""
        if len(prompts) * req.n > MAX_CHOICES:
            raise RequestError(
                400,
                f"n: {len(prompts)} prompts x n={req.n} = {len(prompts) * req.n} choices; "
                f"at most {MAX_CHOICES} per request",
                "n",
            )
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        ctx = self.context_length
        echo = bool(getattr(req, "echo", False))
        bias = req.logit_bias or {}
        for key in bias:
            # isascii: "²".isdigit() is True but int("²") raises (a 500 before); such keys
            # are left to SamplingParams, which rejects them with a 400 naming logit_bias
            if (
                self.vocab_size is not None
                and key.isascii()
                and key.isdigit()
                and int(key) >= self.vocab_size
            ):
                raise RequestError(
                    400,
                    f"logit_bias: token id {key} is outside the vocabulary "
                    f"(0..{self.vocab_size - 1})",
                    "logit_bias",
                )
        items = []
        for ids in prompts:
            if len(ids) >= ctx:
                raise RequestError(
                    400,
                    f"{prompt_field}: the prompt has {len(ids)} tokens; the context length "
                    f"is {ctx}, leaving no room to generate",
                    prompt_field,
                )
            room = ctx - len(ids)  # without max_tokens: the rest of the context, as OpenAI
            cap = min(self.default_max_tokens or room, room)
            mt = max_tokens if max_tokens is not None else cap
            if mt == 0 and not echo:
                raise RequestError(
                    400, "max_tokens: 0 is allowed only with echo (the prompt's logprobs)",
                    "max_tokens",
                )  # fmt: skip
            if len(ids) + mt > ctx:
                raise RequestError(
                    400,
                    f"{limit_field}: {mt} + the prompt's {len(ids)} tokens = {len(ids) + mt} "
                    f"exceeds the context length {ctx}",
                    limit_field,
                )
            for j in range(req.n):
                try:
                    sp = SamplingParams(
                        temperature=float(req.temperature),
                        top_p=float(req.top_p),
                        top_k=max(req.top_k, 0),
                        max_tokens=mt,
                        stop=stop,
                        seed=None if req.seed is None else req.seed + j,
                        logprobs=logprobs,
                        ignore_eos=req.ignore_eos,
                        speculative=bool(req.speculative),
                        speculative_budget=req.speculative_budget,
                        presence_penalty=req.presence_penalty,
                        frequency_penalty=req.frequency_penalty,
                        logit_bias=bias,
                        prompt_logprobs=logprobs if echo else None,
                    )
                    self.engine.llm.check_params(sp)
                except ValueError as exc:
                    msg = str(exc)
                    raise RequestError(400, msg, msg.split(" ", 1)[0].rstrip(":")) from exc
                items.append((ids, sp))
        return items

    def choices(self, req: Any, items: list[tuple[list[int], SamplingParams]]) -> list[Choice]:
        """The response's choices; with ``echo`` each starts with its prompt's text."""
        echo = bool(getattr(req, "echo", False))
        return [Choice(i, len(ids), echo=self.tok.decode(ids) if echo else None)
                for i, (ids, _) in enumerate(items)]  # fmt: skip

    def submit(self, items: list[tuple[list[int], SamplingParams]], prefix: str) -> Job:
        try:
            job = self.engine.submit(items, prefix)
        except RuntimeError as exc:
            raise RequestError(503, str(exc)) from exc
        self.metrics.prompt_tokens.labels(self.model_name).inc(sum(len(ids) for ids, _ in items))
        return job

    # ---- events --------------------------------------------------------------------------------
    def apply(self, job: Job, choices: list[Choice], ev: Event) -> None:
        """Fold one engine event into its choice; raise RequestError for a failed request."""
        if ev.error is not None:
            raise RequestError(ev.error_status, ev.error)
        c = choices[ev.index]
        now = time.monotonic()
        if ev.token_ids:
            first = c.last_event is None
            dt = now - (job.created if first else c.last_event)
            self.metrics.observe_tokens(len(ev.token_ids), dt, first)
            c.last_event = now
            c.token_ids += ev.token_ids
            c.logprobs += ev.logprobs
        if ev.prompt_logprobs is not None:
            c.prompt_logprobs = ev.prompt_logprobs
        if ev.finish_reason is not None:
            c.finish_reason, c.text = ev.finish_reason, ev.text or ""

    async def collect(self, job: Job, choices: list[Choice], request: Request) -> None:
        """Wait for every choice to finish; abort the job if the client goes away.

        The client is checked every DISCONNECT_POLL_S whether or not tokens keep arriving (a
        steady token stream must not hide a disconnect until the request is done)."""
        next_check = time.monotonic() + DISCONNECT_POLL_S
        while any(c.finish_reason is None for c in choices):
            try:
                left = max(0.0, next_check - time.monotonic())
                ev = await asyncio.wait_for(job.queue.get(), left)
            except asyncio.TimeoutError:
                ev = None
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    raise RequestError(499, "client disconnected") from None
            if ev is not None:
                self.apply(job, choices, ev)

    def usage(self, prompts: list[list[int]], choices: list[Choice]) -> P.Usage:
        pt = sum(len(p) for p in prompts)
        ct = sum(len(c.token_ids) for c in choices)
        return P.Usage(prompt_tokens=pt, completion_tokens=ct, total_tokens=pt + ct)

    # ---- text and logprobs ---------------------------------------------------------------------
    def token_str(self, tid: int) -> str:
        return self.tok.decode([tid], skip_special_tokens=False)

    def token_bytes(self, tid: int) -> list[int]:
        return list(token_bytes(self.tok, tid))

    def text_delta(self, c: Choice, stop: list[str]) -> str:
        """New text safe to stream for ``c`` (all of it once the choice has finished)."""
        if c.finish_reason is not None:
            full = c.text or ""
        else:
            full = self.tok.decode(c.token_ids)
            full = full.rstrip("\ufffd")
            hold = max((len(s) for s in stop), default=1) - 1
            if hold:
                full = full[: max(len(c.sent_text), len(full) - hold)]
        delta = full[len(c.sent_text) :] if full.startswith(c.sent_text) else ""
        c.sent_text += delta
        return delta

    def completion_logprobs(self, lps: list[Any], offset: int = 0) -> P.CompletionLogprobs:
        out = P.CompletionLogprobs()
        pos = offset
        for lp in lps:
            if lp is None:
                continue
            s = self.token_str(lp.token_id)
            out.tokens.append(s)
            out.token_ids.append(lp.token_id)
            out.token_logprobs.append(lp.logprob)
            keys = distinct_keys(self.tok, [t for t, _ in lp.top])
            out.top_logprobs.append(  # None for echo's first prompt token, as OpenAI
                None if lp.logprob is None else {keys[t]: v for t, v in lp.top}
            )
            out.text_offset.append(pos)
            pos += len(s)
        return out

    def chat_logprobs(self, lps: list[Any]) -> P.ChatLogprobs:
        content = []
        for lp in lps:
            if lp is None:
                continue
            tops = [
                P.TopLogprob(token=self.token_str(t), logprob=v, bytes=self.token_bytes(t))
                for t, v in lp.top
            ]
            content.append(
                P.ChatTokenLogprob(
                    token=self.token_str(lp.token_id),
                    logprob=lp.logprob,
                    bytes=self.token_bytes(lp.token_id),
                    top_logprobs=tops,
                )
            )
        return P.ChatLogprobs(content=content)

    # ---- streaming -----------------------------------------------------------------------------
    async def stream(
        self,
        job: Job,
        choices: list[Choice],
        prompts: list[list[int]],
        req: Any,
        chat: bool,
        want_logprobs: bool,
    ) -> AsyncIterator[str]:
        """SSE events for ``job``; aborts it when the client disconnects (generator closed)."""
        rid, created = job.request_ids[0].rsplit("-", 1)[0], int(time.time())
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        done = False
        try:
            if chat:
                yield P.chunk_json(
                    self._chat_chunk(
                        rid,
                        created,
                        [
                            P.ChatChunkChoice(
                                index=c.index, delta=P.DeltaMessage(role="assistant", content="")
                            )
                            for c in choices
                        ],
                    )
                )
            while any(c.finish_reason is None for c in choices):
                ev = await job.queue.get()
                try:
                    self.apply(job, choices, ev)
                except RequestError as exc:
                    done = True
                    self.engine.abort(job)
                    yield P.sse(P.error_body(exc.message, exc.status, exc.param))
                    yield "data: [DONE]\n\n"
                    return
                c = choices[ev.index]
                if c.echo is not None and not c.echo_sent:  # the prompt first, as OpenAI
                    c.echo_sent = True
                    yield self._echo_chunk(rid, created, c, want_logprobs)
                delta = self.text_delta(c, stop)
                lps = [x for x in ev.logprobs if x is not None] if want_logprobs else []
                if not delta and not lps and ev.finish_reason is None:
                    continue
                yield self._chunk(rid, created, chat, c, delta, lps, ev.finish_reason)
            done = True
            if include_usage:
                usage = self.usage(prompts, choices)
                chunk = (
                    self._chat_chunk(rid, created, [])
                    if chat
                    else P.CompletionChunk(
                        id=rid, created=created, model=self.model_name, choices=[]
                    )
                )
                chunk.usage = usage
                yield P.chunk_json(chunk)
            yield "data: [DONE]\n\n"
        finally:
            if not done:
                self.engine.abort(job)

    def _echo_chunk(self, rid: str, created: int, c: Choice, want_logprobs: bool) -> str:
        lps = self.completion_logprobs(c.prompt_logprobs or []) if want_logprobs else None
        ch = P.CompletionChoice(index=c.index, text=c.echo or "", logprobs=lps)
        return P.chunk_json(
            P.CompletionChunk(id=rid, created=created, model=self.model_name, choices=[ch])
        )

    def _chat_chunk(self, rid: str, created: int, choices: list) -> P.ChatCompletionChunk:
        return P.ChatCompletionChunk(
            id=rid, created=created, model=self.model_name, choices=choices
        )

    def _chunk(
        self,
        rid: str,
        created: int,
        chat: bool,
        c: Choice,
        delta: str,
        lps: list,
        finish: str | None,
    ) -> str:
        if chat:
            ch = P.ChatChunkChoice(
                index=c.index,
                delta=P.DeltaMessage(content=delta or None),
                logprobs=self.chat_logprobs(lps) if lps else None,
                finish_reason=finish,
            )
            return P.chunk_json(self._chat_chunk(rid, created, [ch]))
        offset = len(c.echo or "") + len(c.sent_text) - len(delta)
        ch = P.CompletionChoice(
            index=c.index,
            text=delta,
            finish_reason=finish,
            logprobs=self.completion_logprobs(lps, offset) if lps else None,
        )
        return P.chunk_json(
            P.CompletionChunk(id=rid, created=created, model=self.model_name, choices=[ch])
        )

    # ---- full responses ------------------------------------------------------------------------
    def completion_response(
        self, job: Job, choices: list[Choice], prompts: list[list[int]], want_logprobs: bool
    ) -> P.CompletionResponse:
        return P.CompletionResponse(
            id=job.request_ids[0].rsplit("-", 1)[0],
            created=int(time.time()),
            model=self.model_name,
            usage=self.usage(prompts, choices),
            choices=[
                P.CompletionChoice(
                    index=c.index,
                    text=(c.echo or "") + (c.text or ""),
                    finish_reason=c.finish_reason,
                    logprobs=self.completion_logprobs((c.prompt_logprobs or []) + c.logprobs)
                    if want_logprobs
                    else None,
                )
                for c in choices
            ],
        )

    def chat_response(
        self, job: Job, choices: list[Choice], prompts: list[list[int]], want_logprobs: bool
    ) -> P.ChatCompletionResponse:
        return P.ChatCompletionResponse(
            id=job.request_ids[0].rsplit("-", 1)[0],
            created=int(time.time()),
            model=self.model_name,
            usage=self.usage(prompts, choices),
            choices=[
                P.ChatChoice(
                    index=c.index,
                    message=P.ChatResponseMessage(content=c.text or ""),
                    finish_reason=c.finish_reason,
                    logprobs=self.chat_logprobs(c.logprobs) if want_logprobs else None,
                )
                for c in choices
            ],
        )
