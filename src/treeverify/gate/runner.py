"""One gate run: start/watch the target, wait for readiness, run the probes (or record a golden
file), stop what it launched, report.

``--timeout`` is a hard cap on the whole run: every request waits at most what is left of it, and
the run itself goes on in a worker thread that the main thread abandons at the deadline (plus
``GRACE``) with exit 5 naming the phase it was in, so no hang (a server that accepts and never
answers, a barrier that never fills) can hold the gate past its budget."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import httpx

from treeverify.gate import golden as G
from treeverify.gate import probes as P
from treeverify.gate import smoke
from treeverify.gate.client import Client, HttpError
from treeverify.gate.codes import ExitCode
from treeverify.gate.compare import DEFAULT_LOGPROB_ATOL, DEFAULT_MARGIN
from treeverify.gate.report import ProbeResult, Report

READY_PROMPT = "The capital of France is"
GRACE = 2.0  # seconds past --timeout for the worker to wind down before it is abandoned


@dataclasses.dataclass
class Options:
    action: str = "run"  # run | record | check
    probes: str = "full"  # full | smoke
    model: str | None = None
    timeout: float = 1800.0  # the whole run: a hard cap
    ready_timeout: float = 900.0  # to become ready (within timeout)
    only: list[str] | None = None  # run just these probes
    interval: float = 2.0
    tries: int = smoke.TRIES
    request_timeout: float = smoke.REQUEST_TIMEOUT
    connect_timeout: float = 5.0
    read_timeout: float = 60.0
    itl_deadline: float = 30.0
    golden: dict | None = None
    golden_path: str | None = None
    oracle: list | None = None
    oracle_out: str | None = None
    context_length: int | None = None
    concurrency: list[int] | None = None
    max_concurrency: int | None = None
    samples: int = 256
    false_alarm: float = 1e-4
    baseline_url: str | None = None
    margin: float | None = None
    logprob_atol: float | None = None
    perf_factor: float = 3.0
    perf_slack: float = 0.05
    api_key: str | None = None


def readiness(target, client: Client, report: Report, o: Options, deadline: float):
    """Poll until a real completion returns choices. Retries transport errors (and 503, the
    'loading' answer) only; any other HTTP error is a verdict at once."""
    t0 = time.monotonic()
    tries = 0
    while True:
        tries += 1
        down = target.check()
        if down is not None:
            return ProbeResult("readiness", "fail", down.detail, down.code), None
        left = deadline - time.monotonic()
        if left <= 0:
            tail = " | ".join(target.log_tail(3))
            detail = f"not ready after {time.monotonic() - t0:.1f} s ({tries - 1} tries)"
            return ProbeResult(
                "readiness", "fail", detail + (f"; log: {tail}" if tail else ""), ExitCode.HUNG
            ), None
        why = ""
        try:
            client.resolve_model()
            c = client.complete(
                READY_PROMPT, 4, extra={"ignore_eos": True}, read=min(o.read_timeout, left)
            )
            detail = (
                f"ready: model {client.model!r} completed (HTTP 200, {len(c.text)} chars, finish "
                f"{c.finish_reason}) in {c.seconds:.2f} s; {time.monotonic() - t0:.1f} s after "
                f"start, {tries} tr{'y' if tries == 1 else 'ies'}"
            )
            return ProbeResult("readiness", "pass", detail, data={"text": c.text}), c
        except httpx.TransportError as exc:
            why = type(exc).__name__
        except HttpError as exc:
            if exc.status != 503:
                code = ExitCode.CORRECTNESS if exc.status >= 500 else ExitCode.INFRA
                return ProbeResult("readiness", "fail", f"completion failed: {exc}", code), None
            why = "503 (loading)"
        report.event("readiness", "waiting", f"try {tries}: {target.state()}; {why}")
        time.sleep(max(0.0, min(o.interval, deadline - time.monotonic())))


def discover(client: Client, o: Options, report: Report) -> tuple[dict | None, int | None]:
    info = client.server_info()
    ctxlen = o.context_length
    if ctxlen is None:
        try:
            card = next((m for m in client.models() if m.get("id") == client.model), None)
            ctxlen = (card or {}).get("max_model_len")
        except (HttpError, httpx.TransportError, ValueError):
            pass
    if ctxlen is None and info:
        ctxlen = info.get("context_length")
    if ctxlen is None and o.golden:
        ctxlen = o.golden.get("context_length")
    buckets = ((info or {}).get("cuda_graph") or {}).get("buckets")
    report.event(
        "discover",
        "ok",
        f"model {client.model}, context {ctxlen}, server_info {'yes' if info else 'no'}"
        + (f", graph buckets {buckets}" if buckets else ""),
    )
    return info, ctxlen


def run(target, o: Options, report: Report) -> ExitCode:
    """The run within ``o.timeout``: the worker does the work; past the deadline (+ GRACE) the
    main thread records a hang (exit 5), stops the target and returns."""
    report.meta.update({"target": target.describe(), "action": o.action, "probes": o.probes})
    report.event("lifecycle", "start", target.describe())
    deadline = time.monotonic() + o.timeout
    client = Client(target.url, o.connect_timeout, o.read_timeout, o.model, o.api_key, deadline)
    phase = {"name": "lifecycle"}
    errors: list[BaseException] = []

    def work() -> None:
        try:
            _work(target, o, report, client, deadline, phase)
        except BaseException as exc:  # re-raised in the main thread (cli reports it)
            errors.append(exc)

    worker = threading.Thread(target=work, name="gate-run", daemon=True)
    try:
        worker.start()
        worker.join(max(0.0, deadline - time.monotonic()) + GRACE)
        if worker.is_alive():
            report.add(
                ProbeResult(
                    phase["name"],
                    "fail",
                    f"the run's budget (--timeout {o.timeout:g} s) is spent; still in "
                    f"{phase['name']!r} (a request or the server hung)",
                    ExitCode.HUNG,
                    seconds=report.elapsed(),
                )
            )
            report.freeze()
        elif errors:
            raise errors[0]
        return report.exit_code()
    finally:
        # past the budget a launched server gets a short grace before SIGKILL, not the usual 15 s
        target.stop(grace=GRACE if time.monotonic() > deadline else 15.0)
        if not worker.is_alive():
            client.close()


def _work(target, o: Options, report: Report, client: Client, end: float, phase: dict) -> None:
    deadline = min(end, time.monotonic() + o.ready_timeout)
    try:
        target.start()
    except (OSError, RuntimeError, ValueError) as exc:
        report.add(ProbeResult("lifecycle", "fail", f"cannot start: {exc}", ExitCode.INFRA))
        return
    phase["name"] = "readiness"
    if o.probes == "smoke":
        report.add(
            smoke.run(
                target,
                client.url,
                report,
                o.model,
                interval=o.interval,
                tries=o.tries,
                request_timeout=o.request_timeout,
                api_key=o.api_key,
            )
        )
        return
    res, _ = readiness(target, client, report, o, deadline)
    res.seconds = report.elapsed()
    report.add(res)
    if res.verdict != "pass":
        return
    phase["name"] = "discover"
    try:
        info, ctxlen = discover(client, o, report)
    except (httpx.TransportError, HttpError, ValueError) as exc:
        down = target.check()
        code, why = (down.code, down.detail) if down else (ExitCode.INFRA, repr(exc))
        report.add(ProbeResult("discover", "fail", why, code))
        return
    golden = o.golden or {}
    ctx = P.Ctx(
        client=client,
        target=target,
        margin=_first(o.margin, golden.get("margin"), DEFAULT_MARGIN),
        logprob_atol=_first(o.logprob_atol, golden.get("logprob_atol"), DEFAULT_LOGPROB_ATOL),
        itl_deadline=o.itl_deadline,
        golden=o.golden,
        oracle=o.oracle,
        context_length=ctxlen,
        server_info=info,
        baseline=Client(o.baseline_url, o.connect_timeout, o.read_timeout, o.model, o.api_key, end)
        if o.baseline_url
        else None,
        concurrency=o.concurrency,
        max_concurrency=o.max_concurrency,
        perf_factor=o.perf_factor,
        perf_slack=o.perf_slack,
        samples=o.samples,
        false_alarm=o.false_alarm,
    )
    if ctx.baseline is not None:
        ctx.baseline.model = client.model
    report.meta.update({"model": client.model, "context_length": ctxlen})
    if o.action == "record":
        phase["name"] = "record"
        _record(ctx, o, report)
        return
    for name, fn in P.FULL:
        if o.only is not None and name not in o.only:
            continue
        phase["name"] = name
        report.event(name, "running")
        report.add(P.run_probe(name, fn, ctx))
        down = target.check()
        if down is not None:
            report.add(ProbeResult("lifecycle", "fail", down.detail, down.code))
            break


def _record(ctx: P.Ctx, o: Options, report: Report) -> None:
    def rec(c):
        data = P.record(c)
        g = G.new(
            {
                "url": ctx.client.url,
                "model": ctx.client.model,
                "context_length": ctx.context_length,
                "top_k": G.TOP_K,
                "margin": ctx.margin,
                "logprob_atol": ctx.logprob_atol,
                **data,
            }
        )
        G.save(o.golden_path, g)
        if o.oracle_out:
            items = [
                {"prompt": s["prompt"], "expected": s["text"], "max_tokens": s["max_tokens"]}
                for s in data["suite"]
            ] + [
                {"messages": c["messages"], "expected": c["text"], "max_tokens": c["max_tokens"]}
                for c in data["chat"]
            ]
            with open(o.oracle_out, "w") as f:
                json.dump(items, f, indent=1)
        lat = ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in data["latency"].items())
        return ProbeResult(
            "record",
            "pass",
            f"{len(data['suite'])} suite prompts, {len(data['chat'])} chats, "
            f"{len(data['ladder'])} ladder rungs, {lat} "
            f"-> {o.golden_path}",
        )

    report.add(P.run_probe("record", rec, ctx))


def _first(*xs):
    return next(x for x in xs if x is not None)
