"""The full gate's probes. Each takes a :class:`Ctx` and returns a :class:`ProbeResult`;
exceptions are classified by :func:`run_probe` (stall -> hung, dead target -> unit failed, ...).
Chat, sampled and long-context copy probes live in their own modules (chat.py, sampled.py,
copying.py); ``FULL`` is the order they all run in.
"""

from __future__ import annotations

import statistics
import threading
from concurrent.futures import ThreadPoolExecutor

from treeverify.gate import chat, copying, sampled
from treeverify.gate import golden as G
from treeverify.gate.codes import ExitCode
from treeverify.gate.probing import Ctx, Fail, Tally, greedy, pin_budget, plain, run_probe
from treeverify.gate.report import ProbeResult

__all__ = ["FULL", "Ctx", "Fail", "record", "run_probe"]


# ---- probes ------------------------------------------------------------------------------------
def oracle(ctx: Ctx) -> ProbeResult:
    """Exact expected continuations: completions ({prompt, expected}) and chat ({messages,
    expected})."""
    if not ctx.oracle:
        return ProbeResult("oracle", "skip", "no --oracle file")
    t = Tally(ctx)
    for item in ctx.oracle:
        n = int(item.get("max_tokens") or G.SUITE_MAX_TOKENS)
        if "messages" in item:
            got = ctx.client.chat(item["messages"], n, extra={"ignore_eos": True}).text
            what = f"chat {item['messages'][-1].get('content', '')[:32]!r}"
        else:
            got = ctx.client.complete(item["prompt"], n, extra={"ignore_eos": True}).text
            what = f"{item['prompt'][:40]!r}"
        if not got.startswith(item["expected"]):
            t.failures.append(f"{what}: expected {item['expected']!r}, got {got!r}")
    return t.verdict("oracle", f"{len(ctx.oracle)} prompt(s) as expected")


def golden_suite(ctx: Ctx) -> ProbeResult:
    if not ctx.golden:
        return ProbeResult("golden", "skip", "no --golden file (record one: gate record)")
    t = Tally(ctx)
    for i, ref in enumerate(ctx.golden.get("suite", [])):
        label = f"suite[{i}] {ref['prompt'][:24]!r}"
        p, n = ref["prompt"], ref["max_tokens"]
        t.agree(label, p, ref, greedy(ctx, p, n), trusted=True)
        t.agree_text(label, p, ref, plain(ctx, p, n).text, trusted=True)
    n = len(ctx.golden.get("suite", []))
    return t.verdict("golden", f"{n} prompt(s) within tolerance")


def determinism(ctx: Ctx) -> ProbeResult:
    prompt = G.SUITE_PROMPTS[0]
    first = greedy(ctx, prompt, G.SUITE_MAX_TOKENS)
    t = Tally(ctx)
    for k in range(2):
        t.agree(f"repeat {k + 1}", prompt, first, greedy(ctx, prompt, G.SUITE_MAX_TOKENS))
    streamed = ctx.client.stream(
        prompt, G.SUITE_MAX_TOKENS, ctx.itl_deadline, extra={"ignore_eos": True}
    )
    if streamed.text != first.text:  # streamed without logprobs: decided with evidence
        t.agree_text("streamed", prompt, first, streamed.text)
    return t.verdict("determinism", "3 repeats agree; streamed == non-streamed")


def ladder_prompts(ctx: Ctx) -> list[dict]:
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
        rungs = ladder_prompts(ctx)
    else:
        return ProbeResult("ladder", "skip", "context length unknown (give --context-length)")
    t, rows = Tally(ctx), []
    for i, rung in enumerate(rungs):
        p = rung["prompt"]
        s = ctx.client.stream(p, rung["max_tokens"], ctx.itl_deadline, extra={"ignore_eos": True})
        cur = greedy(ctx, p, rung["max_tokens"])
        rows.append({"prompt_tokens": cur.prompt_tokens, "max_tokens": rung["max_tokens"]})
        label = f"rung {i} ({cur.prompt_tokens}+{rung['max_tokens']} tok)"
        if s.text != cur.text:
            t.agree_text(f"{label} streamed", p, cur, s.text)
        if len(cur.tokens or []) != rung["max_tokens"]:
            n = len(cur.tokens or [])
            t.failures.append(f"{label}: {n} tokens, asked {rung['max_tokens']}")
        if ref_rungs:
            t.agree(label, p, rung, cur, trusted=True)
            t.agree_text(f"{label} streamed", p, rung, s.text, trusted=True)
    longest = max((r["prompt_tokens"] or 0) for r in rows) if rows else 0
    what = "vs golden" if ref_rungs else "no golden: completion/stall/stream checks only"
    detail = f"{len(rungs)} rungs up to {longest} prompt tokens ({what})"
    return t.verdict("ladder", detail, {"rungs": rows})


def graph_batch_sizes(info: dict) -> list[int]:
    """Batch sizes of our server's captured graphs: buckets are ints or (batch, tokens) pairs."""
    out = set()
    for b in (info.get("cuda_graph") or {}).get("buckets") or []:
        b = b[0] if isinstance(b, (list, tuple)) and b else b
        if isinstance(b, int) and b >= 1:
            out.add(b)
    return sorted(out)


def concurrency_top(ctx: Ctx) -> tuple[int, str]:
    """The largest concurrency to try and where it comes from: --max-concurrency, else our
    server's largest captured graph bucket or max running requests (/server_info), else 32."""
    if ctx.max_concurrency is not None:
        return ctx.max_concurrency, "--max-concurrency"
    info = ctx.server_info or {}
    buckets = graph_batch_sizes(info)
    running = (info.get("server_args") or {}).get("max_running_requests")
    if buckets:
        top = max(buckets) + 1  # one past the largest captured size: the padded / eager edge
        if isinstance(running, int):
            top = min(top, running)
        return top, "largest graph bucket + 1 (/server_info)"
    if isinstance(running, int) and running >= 1:
        return running, "max running requests (/server_info)"
    return 32, "default (no /server_info: give --max-concurrency)"


def concurrency_sizes(ctx: Ctx) -> list[int]:
    top, _ = concurrency_top(ctx)
    if ctx.concurrency:
        sizes = set(ctx.concurrency)
    else:
        sizes = {1, 3, 8, 13, 17, top}  # 17: just past 16, a common graph-bucket size
        for b in graph_batch_sizes(ctx.server_info or {}):  # each captured size and the next
            sizes |= {b, b + 1}
    return sorted(s for s in sizes if 1 <= s <= top)


def concurrency(ctx: Ctx) -> ProbeResult:
    sizes = concurrency_sizes(ctx)
    top, why = concurrency_top(ctx)
    n = max(sizes)
    prompts = [f"Request {i}: count the apples. {G.SUITE_PROMPTS[i % 6]}" for i in range(n)]
    max_tokens = 16
    alone = [greedy(ctx, p, max_tokens) for p in prompts]
    t = Tally(ctx)
    for s in sizes:
        if s == 1:
            continue
        barrier = threading.Barrier(s)

        def one(i, barrier=barrier):
            barrier.wait(30)  # odd requests without logprobs: the production path
            if i % 2:
                return plain(ctx, prompts[i], max_tokens)
            return greedy(ctx, prompts[i], max_tokens)

        with ThreadPoolExecutor(s) as pool:
            got = list(pool.map(one, range(s)))
        for i, cur in enumerate(got):
            label = f"concurrency {s} request {i}"
            if i % 2:
                t.agree_text(label, prompts[i], alone[i], cur.text)
            else:
                t.agree(label, prompts[i], alone[i], cur)
    detail = f"sizes {sizes} (top {top}: {why}): every request equals its concurrency-1 output"
    return t.verdict("concurrency", detail, {"sizes": sizes})


def speculation(ctx: Ctx) -> ProbeResult:
    spec = (ctx.server_info or {}).get("speculative") or {}
    prompts = list(G.SUITE_PROMPTS[:4])
    if ctx.context_length:
        prompts.append(G.ladder_prompt(min(ctx.context_length // 2, 1000)))
    t = Tally(ctx)
    if ctx.baseline is not None:
        how = f"vs baseline {ctx.baseline.url}"
        for p in prompts:
            ref = greedy(ctx, p, 24, client=ctx.baseline)
            t.agree(f"{p[:24]!r}", p, ref, greedy(ctx, p, 24), trusted=True)
            t.agree_text(f"{p[:24]!r}", p, ref, plain(ctx, p, 24).text, trusted=True)
    elif spec.get("enabled"):
        pin = pin_budget(ctx, prompts[0], t.notes)
        how = "per-request speculative on vs off" + (
            f", on pinned at budget {pin['speculative_budget']}" if pin else "")  # fmt: skip
        rounds = _rounds(ctx)  # now: earlier probes' requests (and the pin check) ran rounds too
        for p in prompts:
            off = greedy(ctx, p, 24, speculative=False)
            t.agree(f"{p[:24]!r}", p, off, greedy(ctx, p, 24, **pin))
            t.agree_text(f"{p[:24]!r}", p, off, plain(ctx, p, 24, **pin).text)
        _sampled_on_vs_off(ctx, t, pin)
        how += f"; seeded sampling on vs off, {len(SAMPLED_PROMPTS)} prompts"
        after = _rounds(ctx)
        if isinstance(rounds, int) and isinstance(after, int):
            how += f"; {after - rounds} speculative rounds ran"
            if after == rounds:  # every "on" request decoded plainly: nothing was compared
                t.failures.append(
                    "no speculative round ran during the probe (/server_info speculative.rounds "
                    f"stayed {rounds}"
                    + (f" with the budget pinned at {pin['speculative_budget']}" if pin else "")
                    + "): speculation is enabled but never ran, so nothing was verified"
                )
    else:
        return ProbeResult(
            "speculation", "skip", "speculation not enabled (/server_info) and no --baseline-url"
        )
    return t.verdict("speculation", f"{len(prompts)} prompts greedy-equal ({how})")


SAMPLED_PROMPTS = G.SUITE_PROMPTS[:6]
SAMPLED_TOKENS = 24
EARLY = 4  # a divergence within a request's first EARLY tokens counts as early


def _rounds(ctx: Ctx) -> int | None:
    """The server's speculative rounds so far (/server_info), None if it does not say."""
    return ((ctx.client.server_info() or {}).get("speculative") or {}).get("rounds")


def _sampled_on_vs_off(ctx: Ctx, t: Tally, pin: dict | None = None) -> None:
    """Seeded sampled requests commit the same tokens with speculation on and off (each tree
    node uses plain decoding's draw for its position: docs/sampling.md). In fp32 they agree
    exactly; a bf16 verify forward can flip a near-tie of the perturbed scores (the gate cannot
    see those scores), rarely and late. A broken sampled acceptance (greedy acceptance at
    temperature > 0, drafts committed unchecked, a wrong distribution) diverges within the first
    rounds of most requests: that is the failure, when half or more of the prompts diverge early."""
    early, notes = [], []
    for i, p in enumerate(SAMPLED_PROMPTS):
        extra = {"temperature": 0.8, "top_p": 0.95, "seed": 7919 + i, "ignore_eos": True}
        off = ctx.client.complete(p, SAMPLED_TOKENS, logprobs=1,
                                  extra={**extra, "speculative": False})  # fmt: skip
        on = ctx.client.complete(p, SAMPLED_TOKENS, logprobs=1, extra={**extra, **(pin or {})})
        a, b = off.token_ids or off.tokens or [], on.token_ids or on.tokens or []
        at = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if at is None and len(a) != len(b):
            at = min(len(a), len(b))
        if at is None:
            continue
        said = (f"{p[:24]!r}: sampled seed {extra['seed']} diverges at token {at}: "
                f"off {a[at : at + 3]} vs on {b[at : at + 3]}")  # fmt: skip
        (early if at < EARLY else notes).append(said)
    t.notes += notes
    if 2 * len(early) >= len(SAMPLED_PROMPTS):
        head = f"seeded sampling with speculation on differs from off early in {len(early)} of "
        t.failures.append(f"{head}{len(SAMPLED_PROMPTS)} prompts: " + "; ".join(early))
    else:
        t.notes += early


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
    ("chat", chat.probe),
    ("determinism", determinism),
    ("sampled", sampled.probe),
    ("ladder", ladder),
    ("copy", copying.probe),
    ("concurrency", concurrency),
    ("speculation", speculation),
    ("latency", latency),
)


def record(ctx: Ctx) -> dict:
    """The golden suite, ladder and latency of this (known-good) deployment."""
    suite = []
    for p in G.SUITE_PROMPTS:
        c = greedy(ctx, p, G.SUITE_MAX_TOKENS)
        suite.append({"prompt": p, "max_tokens": G.SUITE_MAX_TOKENS, **c.to_json()})
    rungs = []
    if ctx.context_length:
        for r in ladder_prompts(ctx):
            c = greedy(ctx, r["prompt"], r["max_tokens"])
            rungs.append({**r, **c.to_json()})
    return {
        "suite": suite,
        "chat": chat.record(ctx),
        "ladder": rungs,
        "latency": measure_latency(ctx),
    }
