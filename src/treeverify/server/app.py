"""The FastAPI app: OpenAI routes, health that means it, server info, metrics, error bodies.

Every error is an OpenAI error object ``{"error": {"message", "type", "param", "code"}}``;
request validation failures are 400 (not FastAPI's 422) and name the offending field.

/health is 200 only while the engine loop's heartbeat is fresh; /health_generate pushes a real
1-token request through the scheduler and answers 503 if it does not come back in time.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from treeverify import __version__
from treeverify.engine.sampling_params import SamplingParams
from treeverify.server import protocol as P
from treeverify.server.engine_loop import EngineLoop
from treeverify.server.guards import DEFAULT_MAX_REQUEST_BYTES, BearerAuth, BodyLimit
from treeverify.server.metrics import Metrics
from treeverify.server.serving import Choice, RequestError, Serving

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": P.ErrorResponse, "description": "invalid request"},
    401: {"model": P.ErrorResponse, "description": "missing or wrong API key"},
    413: {"model": P.ErrorResponse, "description": "request body too large"},
    404: {"model": P.ErrorResponse, "description": "unknown model"},
    503: {"model": P.ErrorResponse, "description": "engine unavailable"},
}


def create_app(
    engine: EngineLoop,
    served_model_name: str,
    context_length: int,
    *,
    info: dict[str, Any] | None = None,
    heartbeat_timeout_s: float = 10.0,
    health_generate_timeout_s: float = 10.0,
    default_max_tokens: int | None = None,
    enable_test_hooks: bool = False,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    """The app serving ``engine`` as ``served_model_name``; ``info`` is merged into /server_info.

    ``api_key``: required as a bearer token on every route but the health checks (None: open).
    ``max_request_bytes``: larger bodies are 413 before they are read. ``default_max_tokens``:
    the cap for a request without ``max_tokens`` (None: the rest of the context).

    ``enable_test_hooks`` adds POST /_test/stall and /_test/resume (hidden from the schema): TEST
    ONLY, they freeze the engine loop to prove the health endpoints notice.
    """
    app = FastAPI(title="treeverify", version=__version__)
    metrics = Metrics(served_model_name)
    serving = Serving(engine, served_model_name, context_length, metrics, default_max_tokens)
    started = time.time()
    app.state.engine, app.state.metrics = engine, metrics

    # ---- errors --------------------------------------------------------------------------------
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(*_describe_validation(exc.errors()), status=400)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        return _error(exc.message, exc.param, status=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(str(exc.detail), None, status=exc.status_code)

    # Starlette wraps in reverse order: counting sees every response, auth runs before the limit.
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    app.add_middleware(_CountRequests, metrics=metrics)

    # ---- OpenAI routes -------------------------------------------------------------------------
    @app.post("/v1/completions", response_model=P.CompletionResponse, responses=_ERRORS)
    async def completions(req: P.CompletionRequest, request: Request):
        serving.check_model(req.model)
        prompts = await asyncio.to_thread(serving.completion_prompts, req)  # off the loop
        items = serving.make_params(req, prompts, req.logprobs, req.max_tokens, "prompt")
        return await _run(
            req, request, prompts, items, "cmpl", chat=False, want_logprobs=req.logprobs is not None
        )

    @app.post("/v1/chat/completions", response_model=P.ChatCompletionResponse, responses=_ERRORS)
    async def chat_completions(req: P.ChatCompletionRequest, request: Request):
        serving.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise RequestError(400, "top_logprobs: requires logprobs: true", "top_logprobs")
        prompts = [await asyncio.to_thread(serving.chat_prompt, req)]  # tokenizing: off the loop
        lp = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens, limit_field = req.max_tokens, "max_tokens"
        if req.max_completion_tokens is not None:  # OpenAI's newer name for it
            if req.max_tokens is not None and req.max_tokens != req.max_completion_tokens:
                raise RequestError(
                    400,
                    f"max_completion_tokens: {req.max_completion_tokens} and max_tokens: "
                    f"{req.max_tokens} disagree (send one)",
                    "max_completion_tokens",
                )
            max_tokens, limit_field = req.max_completion_tokens, "max_completion_tokens"
        items = serving.make_params(req, prompts, lp, max_tokens, "messages", limit_field)
        return await _run(
            req, request, prompts, items, "chatcmpl", chat=True, want_logprobs=req.logprobs
        )

    async def _run(req, request, prompts, items, prefix, chat, want_logprobs):
        if req.stream_options is not None and not req.stream:  # would be ignored: refuse
            raise RequestError(
                400, "stream_options: only allowed with stream: true", "stream_options"
            )
        job = serving.submit(items, prefix)
        choices = serving.choices(req, items)
        if req.stream:
            gen = serving.stream(job, choices, prompts, req, chat, want_logprobs)
            return StreamingResponse(gen, media_type="text/event-stream")
        try:
            await serving.collect(job, choices, request)
        finally:
            if any(c.finish_reason is None for c in choices):
                engine.abort(job)
        build = serving.chat_response if chat else serving.completion_response
        return build(job, choices, prompts, want_logprobs)

    def model_card() -> P.ModelCard:
        return P.ModelCard(
            id=served_model_name,
            created=int(started),
            root=served_model_name,
            max_model_len=context_length,
        )

    @app.get("/v1/models", response_model=P.ModelList)
    async def models():
        return P.ModelList(data=[model_card()])

    @app.get("/v1/models/{model_id:path}", response_model=P.ModelCard)
    async def model(model_id: str):
        # the openai client's models.retrieve(id); ids may hold "/" (org/name checkpoints)
        serving.check_model(model_id)  # 404 naming the served model otherwise
        return model_card()

    # ---- health ----------------------------------------------------------------------------------
    @app.get("/health")
    @app.head("/health", include_in_schema=False)  # load balancers' checks
    async def health():
        age = engine.heartbeat_age()
        if not engine.accepting:
            return _error("the server is shutting down", None, status=503)
        if age > heartbeat_timeout_s:
            return _error(
                f"engine loop heartbeat is {age:.1f} s old (limit "
                f"{heartbeat_timeout_s} s): the engine loop is stuck",
                None,
                status=503,
            )
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        ids = serving.encode("health") or [0]
        sp = SamplingParams(temperature=0, max_tokens=1)
        try:
            job = serving.submit([(ids, sp)], "health")
        except RequestError as exc:
            return _error(exc.message, None, status=503)
        choices = [Choice(0, len(ids))]
        t0 = time.monotonic()
        try:
            while choices[0].finish_reason is None:
                left = health_generate_timeout_s - (time.monotonic() - t0)
                ev = await asyncio.wait_for(job.queue.get(), max(left, 0.0))
                serving.apply(job, choices, ev)
        except asyncio.TimeoutError:
            engine.abort(job)
            return _error(
                f"health_generate: no token within {health_generate_timeout_s} s", None, status=503
            )
        except RequestError as exc:
            return _error(f"health_generate: {exc.message}", None, status=503)
        if len(choices[0].token_ids) != 1:
            return _error("health_generate: the engine returned no token", None, status=503)
        return Response(status_code=200)

    # ---- introspection -------------------------------------------------------------------------
    @app.get("/server_info")
    async def server_info():
        s = engine.stats
        llm = engine.llm
        cfg = llm.config
        spec = llm.spec_stats
        out = {
            "version": __version__,
            "served_model_name": served_model_name,
            "context_length": context_length,
            "attention_backend": cfg.attention_backend,
            "kv_capacity_tokens": cfg.capacity_tokens,
            "num_pages": cfg.num_pages,
            "page_size": cfg.page_size,
            "engine_config": cfg.to_json(),  # every knob, resolved, and the derived sizes
            "cuda_graph": llm.cuda_graph_info,
            "speculative": {"enabled": False} if spec is None else {"enabled": True, **spec},
            "uptime_s": round(time.time() - started, 3),
            "stats": {
                "running": s.running,
                "waiting": s.waiting,
                "kv_used_pages": s.used_pages,
                "generated_tokens": s.generated_tokens,
                "prompt_tokens": s.prompt_tokens,
                "finished_requests": s.finished_requests,
                "aborted_requests": s.aborted_requests,
                "steps": s.steps,
                "step_errors": s.step_errors,
                "heartbeat_age_s": round(engine.heartbeat_age(), 3),
                "moe_expert_imbalance": s.moe_imbalance,
            },
        }
        out.update(info or {})
        return out

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(engine.stats), media_type=metrics.content_type)

    if enable_test_hooks:

        @app.post("/_test/stall", include_in_schema=False)
        async def _stall():
            engine.stall()
            return {"stalled": True}

        @app.post("/_test/resume", include_in_schema=False)
        async def _resume():
            engine.resume()
            return {"stalled": False}

    return app


class _CountRequests:
    """Pure ASGI middleware counting responses by route and status (streaming-safe)."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics
        self._paths: frozenset[str] | None = None  # the app's route paths, on first use

    def _endpoint(self, scope) -> str:
        """The matched route's path; for a request refused before routing (a 413, a 401) its
        path when that names a route (so it counts under its endpoint), else "other" (the
        label's values stay the routes')."""
        route = scope.get("route")
        if route is not None:
            return getattr(route, "path", "other")
        if self._paths is None and scope.get("app") is not None:
            self._paths = frozenset(getattr(r, "path", "") for r in scope["app"].routes)
        return scope.get("path", "") if scope.get("path") in (self._paths or ()) else "other"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def _send(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, _send)
        finally:
            self.metrics.requests.labels(self._endpoint(scope), str(status)).inc()


def _error(message: str, param: str | None, *, status: int) -> JSONResponse:
    return JSONResponse(P.error_body(message, status, param), status_code=status)


def _union_tag(part: str) -> bool:
    """Whether a pydantic error location part names a union branch, not a field."""
    return (
        part in ("str", "int", "float", "bool", "none")
        or "[" in part
        or part.startswith(("function-", "constrained-"))
    )


def _describe_validation(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """(message, param) for the first pydantic error: the field path and what was wrong.
    A union field (prompt: a string, strings, token ids or lists of them) fails once per
    branch; of the first field's errors the deepest is the telling one (`[-1]`: "prompt.0:
    Input should be greater than or equal to 0", not the string branch's "should be a valid
    string")."""
    if not errors:
        return "invalid request", None
    top = errors[0].get("loc", ())[:2]  # ("body", field)
    same = [x for x in errors if x.get("loc", ())[:2] == top]
    # the first of the deepest, a value's error (">= 0") before a type's ("a valid string")
    e = max(same, key=lambda x: (len(x.get("loc", ())), not x.get("type", "").endswith("_type")))
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    if not loc and e.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        return "request body must be a JSON object (Content-Type: application/json)", None
    if e.get("type") == "json_invalid":
        detail = (e.get("ctx") or {}).get("error", e.get("msg", ""))
        return f"malformed JSON body: {detail}", None
    # drop pydantic's union-branch tags ('str', 'list[str]', 'list[constrained-int]',
    # 'function-after[...]') from the path; a field name is never one ("stream",
    # "stream_options" and "int..." names were dropped by a prefix test: a new user's audit)
    fields = [x for x in loc if not _union_tag(x)]
    param = ".".join(fields) if fields else None
    if param is None and e.get("type") == "missing":
        return "request body is required", None
    if e.get("type") == "extra_forbidden":
        return f"{param}: unrecognized request field (this server does not implement it)", param
    msg = e.get("msg", "invalid value")
    if e.get("type") == "value_error":
        msg = msg.removeprefix("Value error, ")
    return (f"{param}: {msg}" if param else msg), param
