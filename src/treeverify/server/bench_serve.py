"""``treeverify bench serve --url URL``: load an OpenAI-compatible server, report latency.

For each concurrency level of the sweep, ``--num-requests`` streamed /v1/completions requests
run with at most that many in flight; each records time to first token (TTFT), the gaps between
streamed chunks (inter-token latency, ITL, per token when a chunk carries several) and its
end-to-end time. Per level: p50/p90/p99 of each, output tokens/s, requests/s, failures. Works
against treeverify, SGLang or vLLM (it only speaks the OpenAI API). A server with an API key:
set TREEVERIFY_API_KEY, sent as the bearer token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from typing import Any

from treeverify import env
from treeverify.strict_args import output_file


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="load-test an OpenAI-compatible server (TTFT/ITL)")
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:30000")
    p.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    p.add_argument("--concurrency", default="1,2,4,8", help="comma list of in-flight limits")
    p.add_argument("--num-requests", type=int, default=16, help="requests per concurrency level")
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (SGLang/vLLM)")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout (s)")
    p.add_argument("--json", metavar="FILE", type=output_file, help="write the results as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    return p


def percentile(xs: list[float], q: float) -> float | None:
    """Linear-interpolated q-th percentile (0..100); None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(values: list[float]) -> dict[str, float | None]:
    return {
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "mean": sum(values) / len(values) if values else None,
    }


async def one_request(client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """Stream one completion; its TTFT, ITLs, e2e, tokens, or the error."""
    t0 = time.perf_counter()
    ttft, last, itl, tokens, usage_tokens = None, None, [], 0, None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                return {"ok": False, "error": f"HTTP {resp.status_code}: {text[:200]}"}
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return {"ok": False, "error": str(chunk["error"])[:200]}
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                choices = chunk.get("choices") or []
                n = sum(
                    len((c.get("logprobs") or {}).get("tokens") or []) or 1
                    for c in choices
                    if c.get("text")
                )
                if not n:
                    continue
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - t0
                else:
                    itl += [(now - last) / n] * n
                last = now
                tokens += n
    except Exception as exc:  # a load generator reports failures, it does not stop on them
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return {
        "ok": True,
        "ttft": ttft,
        "itl": itl,
        "e2e": time.perf_counter() - t0,
        "tokens": usage_tokens if usage_tokens is not None else tokens,
    }


async def run_level(
    url: str,
    body: dict[str, Any],
    concurrency: int,
    num: int,
    timeout: float,
    progress,
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    done = 0
    limits = httpx.Limits(max_connections=concurrency + 2)

    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:

        async def guarded() -> dict[str, Any]:
            nonlocal done
            async with sem:
                r = await one_request(client, url, body)
            done += 1
            progress(concurrency, done, num)
            return r

        t0 = time.perf_counter()
        results = await asyncio.gather(*(guarded() for _ in range(num)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    tokens = sum(r["tokens"] for r in ok)
    return {
        "concurrency": concurrency,
        "requests": num,
        "completed": len(ok),
        "failures": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if not r["ok"]})[:5],
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall if wall > 0 else None,
        "requests_per_s": len(ok) / wall if wall > 0 else None,
        "ttft_s": summarize([r["ttft"] for r in ok if r["ttft"] is not None]),
        "itl_s": summarize([x for r in ok for x in r["itl"]]),
        "e2e_s": summarize([r["e2e"] for r in ok]),
    }


def _fmt(x: float | None, scale: float = 1000.0) -> str:
    return "-" if x is None else f"{x * scale:.1f}"


def run(args: argparse.Namespace) -> int:
    import httpx

    try:
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        print(
            f"--concurrency: expected a comma list of ints, got {args.concurrency!r}",
            file=sys.stderr,
        )
        return 64
    bad = [  # each flag named with its value (one message for three hid which)
        (flag, value, want)
        for flag, value, ok, want in (
            ("--concurrency", args.concurrency, levels and min(levels) >= 1, "ints >= 1"),
            ("--num-requests", args.num_requests, args.num_requests >= 1, ">= 1"),
            ("--max-tokens", args.max_tokens, args.max_tokens >= 1, ">= 1"),
            ("--temperature", args.temperature, 0 <= args.temperature <= 2, "in 0..2"),
            ("--timeout", args.timeout, args.timeout > 0 and math.isfinite(args.timeout), "> 0"),
        )
        if not ok
    ]
    if bad:
        flag, value, want = bad[0]
        print(f"{flag}: expected {want}, got {value!r}", file=sys.stderr)
        return 64
    url = args.url.rstrip("/")
    try:
        key = env.api_key()  # a server started with a key wants it on every request
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 64
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    model = args.model
    if model is None:
        try:
            r = httpx.get(url + "/v1/models", headers=headers, timeout=30)
            model = r.json()["data"][0]["id"]
        except Exception as exc:
            print(f"treeverify bench serve: cannot list models at {url}: {exc}", file=sys.stderr)
            return 3
    body = {
        "model": model,
        "prompt": args.prompt,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True

    def progress(c: int, done: int, num: int) -> None:
        if not args.quiet:
            print(f"\rconcurrency {c}: {done}/{num} requests", end="", file=sys.stderr, flush=True)

    rows = []
    for c in levels:
        level = run_level(url, body, c, args.num_requests, args.timeout, progress, headers)
        rows.append(asyncio.run(level))
        if not args.quiet:
            print(file=sys.stderr)
    print(
        f"{'conc':>4} {'ok':>4} {'fail':>4} {'tok/s':>8} {'req/s':>6} {'ttft p50':>9} "
        f"{'p99':>7} {'itl p50':>8} {'p99':>7}  (ms)"
    )
    for r in rows:
        tps = r["output_tokens_per_s"] or 0.0
        rps = r["requests_per_s"] or 0.0
        print(
            f"{r['concurrency']:>4} {r['completed']:>4} {r['failures']:>4} {tps:>8.1f} "
            f"{rps:>6.2f} {_fmt(r['ttft_s']['p50']):>9} {_fmt(r['ttft_s']['p99']):>7} "
            f"{_fmt(r['itl_s']['p50']):>8} {_fmt(r['itl_s']['p99']):>7}"
        )
    result = {
        "url": url,
        "model": model,
        "prompt": args.prompt,
        "max_tokens": args.max_tokens,
        "levels": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    for r in rows:  # why they failed (the table said only how many)
        for error in r["errors"]:
            print(f"concurrency {r['concurrency']}: failed: {error}", file=sys.stderr)
    return 1 if any(r["failures"] for r in rows) else 0
