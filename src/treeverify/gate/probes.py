"""The full gate's probes. Each takes a :class:`Ctx` and returns a :class:`ProbeResult`;
exceptions are classified by :func:`run_probe` (stall -> hung, dead target -> unit failed, ...).
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from treeverify.gate import golden as G
from treeverify.gate.client import Client, Completion, HttpError, Stalled
from treeverify.gate.codes import ExitCode
from treeverify.gate.compare import compare, compare_text
from treeverify.gate.report import ProbeResult


@dataclasses.dataclass
class Ctx:
    client: Client
    target: object
    margin: float
    logprob_atol: float
    itl_deadline: float
    golden: dict | None = None
    oracle: list[dict] | None = None
    context_length: int | None = None
    server_info: dict | None = None
    baseline: Client | None = None
    concurrency: list[int] | None = None
    max_concurrency: int = 32
    perf_factor: float = 3.0
    perf_slack: float = 0.05
    event: object = None  # report.event(phase, state, detail)


class Fail(Exception):
    def __init__(self, code: ExitCode, detail: str, data: dict | None = None) -> None:
        super().__init__(detail)
        self.code, self.detail, self.data = code, detail, data or {}


def run_probe(name: str, fn, ctx: Ctx) -> ProbeResult:
    t0 = time.monotonic()
    try:
        res = fn(ctx)
    except Fail as exc:
        res = ProbeResult(name, "fail", exc.detail, exc.code, data=exc.data)
    except Stalled as exc:
        res = ProbeResult(name, "fail", f"stalled: {exc}", ExitCode.HUNG)
    except httpx.TimeoutException as exc:
        res = ProbeResult(name, "fail", f"request timed out: {exc!r}", ExitCode.HUNG)
    except httpx.TransportError as exc:
        down = ctx.target.check()
        if down is not None:
            res = ProbeResult(name, "fail", down.detail, down.code)
        else:
            res = ProbeResult(name, "fail", f"transport error: {exc!r}", ExitCode.INFRA)
    except HttpError as exc:
        code = ExitCode.CORRECTNESS if exc.status >= 500 else ExitCode.INFRA
        res = ProbeResult(name, "fail", str(exc), code)
    except Exception as exc:  # a gate-side problem: inconclusive, never a crash of the gate
        res = ProbeResult(name, "fail", f"probe error: {exc!r}", ExitCode.INFRA)
    res.name = name
    res.seconds = time.monotonic() - t0
    return res


def _greedy(ctx: Ctx, prompt: str, max_tokens: int, client: Client | None = None, **extra):
    c = client or ctx.client
    return c.complete(prompt, max_tokens, logprobs=G.TOP_K, extra={"ignore_eos": True, **extra})


def _plain(ctx: Ctx, prompt: str, max_tokens: int, client: Client | None = None, **extra):
    """Greedy without logprobs: the path production traffic takes."""
    c = client or ctx.client
    return c.complete(prompt, max_tokens, extra={"ignore_eos": True, **extra})


def _check_text(ctx: Ctx, label: str, ref, text: str, failures: list, notes: list) -> None:
    out = compare_text(ref, text, ctx.margin)
    if not out.ok:
        failures.append(f"{label} (no logprobs): {out.detail}")
    elif out.divergence is not None:
        notes.append(f"{label} (no logprobs): {out.detail}")


def _as_ref(c: Completion) -> dict:
    return c.to_json()


def _check(ctx: Ctx, label: str, ref, cur, failures: list, notes: list) -> None:
    out = compare(ref, cur, ctx.margin, ctx.logprob_atol)
    if not out.ok:
        failures.append(f"{label}: {out.detail}")
    elif out.divergence is not None:
        notes.append(f"{label}: {out.detail}")


def _verdict(name: str, failures: list, notes: list, ok_detail: str, data=None) -> ProbeResult:
    if failures:
        more = f" (+{len(failures) - 1} more)" if len(failures) > 1 else ""
        raise Fail(ExitCode.CORRECTNESS, failures[0] + more, {"failures": failures, **(data or {})})
    detail = ok_detail + (f"; {len(notes)} tolerated near-tie swap(s)" if notes else "")
    return ProbeResult(name, "pass", detail, data={"notes": notes, **(data or {})})


# ---- probes ------------------------------------------------------------------------------------
def oracle(ctx: Ctx) -> ProbeResult:
    if not ctx.oracle:
        return ProbeResult("oracle", "skip", "no --oracle file")
    failures = []
    for item in ctx.oracle:
        n = int(item.get("max_tokens") or G.SUITE_MAX_TOKENS)
        got = ctx.client.complete(item["prompt"], n, extra={"ignore_eos": True}).text
        if not got.startswith(item["expected"]):
            failures.append(f"{item['prompt'][:40]!r}: expected {item['expected']!r}, got {got!r}")
    return _verdict("oracle", failures, [], f"{len(ctx.oracle)} prompt(s) as expected")


def golden_suite(ctx: Ctx) -> ProbeResult:
    if not ctx.golden:
        return ProbeResult("golden", "skip", "no --golden file (record one: gate record)")
    failures, notes = [], []
    for i, ref in enumerate(ctx.golden.get("suite", [])):
        label = f"suite[{i}] {ref['prompt'][:24]!r}"
        _check(ctx, label, ref, _greedy(ctx, ref["prompt"], ref["max_tokens"]), failures, notes)
        plain = _plain(ctx, ref["prompt"], ref["max_tokens"])
        _check_text(ctx, label, ref, plain.text, failures, notes)
    n = len(ctx.golden.get("suite", []))
    return _verdict("golden", failures, notes, f"{n} prompt(s) within tolerance")


def determinism(ctx: Ctx) -> ProbeResult:
    prompt = G.SUITE_PROMPTS[0]
    first = _greedy(ctx, prompt, G.SUITE_MAX_TOKENS)
    failures, notes = [], []
    for k in range(2):
        again = _greedy(ctx, prompt, G.SUITE_MAX_TOKENS)
        _check(ctx, f"repeat {k + 1}", first, again, failures, notes)
    streamed = ctx.client.stream(
        prompt, G.SUITE_MAX_TOKENS, ctx.itl_deadline, extra={"ignore_eos": True}
    )
    if streamed.text != first.text:
        failures.append(f"streamed {streamed.text!r} != non-streamed {first.text!r}")
    return _verdict("determinism", failures, notes, "3 repeats agree; streamed == non-streamed")


def _ladder_prompts(ctx: Ctx) -> list[dict]:
    """[{prompt, max_tokens}] up to the context: calibrated chars/token, verified by usage."""
    ctxlen = ctx.context_length
    probe = G.ladder_prompt(min(len(G.LADDER_TEXT), ctxlen // 2))  # tokens <= chars: fits
    c = ctx.client.complete(probe, 1)
    cpt = len(probe) / max(1, c.prompt_tokens or len(probe) // 4)
    rungs = []
    for n in G.ladder_lengths(ctxlen):
        chars = int(n * cpt * 0.97)  # stay under the context if the estimate is a bit off
        rungs.append({"prompt": G.ladder_prompt(chars), "max_tokens": G.LADDER_DECODE})
    rungs.append({"prompt": G.SUITE_PROMPTS[5], "max_tokens": G.long_decode_tokens(ctxlen)})
    return rungs


def ladder(ctx: Ctx) -> ProbeResult:
    ref_rungs = (ctx.golden or {}).get("ladder")
    if ref_rungs:
        rungs = ref_rungs
    elif ctx.context_length:
        rungs = _ladder_prompts(ctx)
    else:
        return ProbeResult("ladder", "skip", "context length unknown (give --context-length)")
    failures, notes, rows = [], [], []
    for i, rung in enumerate(rungs):
        label = f"rung {i} ({rung.get('prompt_tokens', '?')}+{rung['max_tokens']} tok)"
        s = ctx.client.stream(
            rung["prompt"], rung["max_tokens"], ctx.itl_deadline, extra={"ignore_eos": True}
        )
        cur = _greedy(ctx, rung["prompt"], rung["max_tokens"])
        rows.append({"prompt_tokens": cur.prompt_tokens, "max_tokens": rung["max_tokens"]})
        label = f"rung {i} ({cur.prompt_tokens}+{rung['max_tokens']} tok)"
        if s.text != cur.text:
            _check_text(ctx, f"{label} streamed", cur, s.text, failures, notes)
        if len(cur.tokens or []) != rung["max_tokens"]:
            failures.append(f"{label}: {len(cur.tokens or [])} tokens, asked {rung['max_tokens']}")
        if ref_rungs:
            _check(ctx, label, rung, cur, failures, notes)
            _check_text(ctx, f"{label} streamed", rung, s.text, failures, notes)
    longest = max((r["prompt_tokens"] or 0) for r in rows) if rows else 0
    what = "vs golden" if ref_rungs else "no golden: completion/stall/stream checks only"
    return _verdict(
        "ladder",
        failures,
        notes,
        f"{len(rungs)} rungs up to {longest} prompt tokens ({what})",
        {"rungs": rows},
    )


def concurrency_sizes(ctx: Ctx) -> list[int]:
    if ctx.concurrency:
        sizes = set(ctx.concurrency)
    else:
        sizes = {1, 3, 8, 13}
        buckets = ((ctx.server_info or {}).get("cuda_graph") or {}).get("buckets") or []
        for b in buckets:  # each captured size and the one just past it (padded / uncaptured)
            if isinstance(b, int) and b >= 1:
                sizes |= {b, b + 1}
    cap = ctx.max_concurrency
    info_cap = ((ctx.server_info or {}).get("server_args") or {}).get("max_running_requests")
    if isinstance(info_cap, int):
        cap = min(cap, info_cap)
    return sorted(s for s in sizes if 1 <= s <= cap)


def concurrency(ctx: Ctx) -> ProbeResult:
    sizes = concurrency_sizes(ctx)
    n = max(sizes)
    prompts = [f"Request {i}: count the apples. {G.SUITE_PROMPTS[i % 6]}" for i in range(n)]
    max_tokens = 16
    alone = [_greedy(ctx, p, max_tokens) for p in prompts]
    failures, notes = [], []
    for s in sizes:
        if s == 1:
            continue
        barrier = threading.Barrier(s)

        def one(i, barrier=barrier):
            barrier.wait(30)  # odd requests without logprobs: the production path
            if i % 2:
                return _plain(ctx, prompts[i], max_tokens)
            return _greedy(ctx, prompts[i], max_tokens)

        with ThreadPoolExecutor(s) as pool:
            got = list(pool.map(one, range(s)))
        for i, cur in enumerate(got):
            label = f"concurrency {s} request {i}"
            if i % 2:
                _check_text(ctx, label, alone[i], cur.text, failures, notes)
            else:
                _check(ctx, label, alone[i], cur, failures, notes)
    return _verdict(
        "concurrency",
        failures,
        notes,
        f"sizes {sizes}: every request equals its concurrency-1 output",
        {"sizes": sizes},
    )


def speculation(ctx: Ctx) -> ProbeResult:
    spec = (ctx.server_info or {}).get("speculative") or {}
    prompts = list(G.SUITE_PROMPTS[:4])
    if ctx.context_length:
        prompts.append(G.ladder_prompt(min(ctx.context_length // 2, 1000)))
    failures, notes = [], []
    if ctx.baseline is not None:
        how = f"vs baseline {ctx.baseline.url}"
        for p in prompts:
            ref = _greedy(ctx, p, 24, client=ctx.baseline)
            _check(ctx, f"{p[:24]!r}", ref, _greedy(ctx, p, 24), failures, notes)
            _check_text(ctx, f"{p[:24]!r}", ref, _plain(ctx, p, 24).text, failures, notes)
    elif spec.get("enabled"):
        how = "per-request speculative on vs off"
        for p in prompts:
            off = _greedy(ctx, p, 24, speculative=False)
            _check(ctx, f"{p[:24]!r}", off, _greedy(ctx, p, 24), failures, notes)
            _check_text(ctx, f"{p[:24]!r}", off, _plain(ctx, p, 24).text, failures, notes)
    else:
        return ProbeResult(
            "speculation", "skip", "speculation not enabled (/server_info) and no --baseline-url"
        )
    return _verdict("speculation", failures, notes, f"{len(prompts)} prompts greedy-equal ({how})")


def measure_latency(ctx: Ctx) -> dict:
    ttfts, gaps = [], []
    for p in G.SUITE_PROMPTS:
        s = ctx.client.stream(p, G.SUITE_MAX_TOKENS, ctx.itl_deadline, extra={"ignore_eos": True})
        ttfts.append(s.ttft)
        gaps += s.gaps
    return {
        "ttft_p50": _pct(ttfts, 50),
        "ttft_p99": _pct(ttfts, 99),
        "itl_p50": _pct(gaps, 50),
        "itl_p99": _pct(gaps, 99),
    }


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    if len(xs) == 1:
        return round(xs[0], 6)
    return round(statistics.quantiles(xs, n=100, method="inclusive")[q - 1], 6)


def latency(ctx: Ctx) -> ProbeResult:
    cur = measure_latency(ctx)
    ref = (ctx.golden or {}).get("latency")
    shown = ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in cur.items())
    if not ref:
        return ProbeResult("latency", "pass", f"{shown} (no golden latency to compare)", data=cur)
    slow = [
        f"{k} {cur[k] * 1000:.1f} ms > {ctx.perf_factor}x golden {ref[k] * 1000:.1f} ms "
        f"+ {ctx.perf_slack * 1000:.0f} ms"
        for k in ("ttft_p50", "itl_p50", "itl_p99")
        if k in ref and cur[k] > ctx.perf_factor * ref[k] + ctx.perf_slack
    ]
    if slow:
        raise Fail(ExitCode.PERF_REGRESSION, "; ".join(slow), {"current": cur, "golden": ref})
    return ProbeResult("latency", "pass", shown, data={"current": cur, "golden": ref})


FULL = (
    ("oracle", oracle),
    ("golden", golden_suite),
    ("determinism", determinism),
    ("ladder", ladder),
    ("concurrency", concurrency),
    ("speculation", speculation),
    ("latency", latency),
)


def record(ctx: Ctx) -> dict:
    """The golden suite, ladder and latency of this (known-good) deployment."""
    suite = []
    for p in G.SUITE_PROMPTS:
        c = _greedy(ctx, p, G.SUITE_MAX_TOKENS)
        suite.append({"prompt": p, "max_tokens": G.SUITE_MAX_TOKENS, **_as_ref(c)})
    rungs = []
    if ctx.context_length:
        for r in _ladder_prompts(ctx):
            c = _greedy(ctx, r["prompt"], r["max_tokens"])
            rungs.append({**r, **_as_ref(c)})
    return {"suite": suite, "ladder": rungs, "latency": measure_latency(ctx)}
