"""The sampled probe: traffic samples (temperature > 0), so sampling is gated too.

1. Seeded reproducibility: the same seed gives the same text (twice, and streamed). On a
   speculating server the three requests are pinned at its largest budget (`pin_budget`) where
   it takes the field: an adaptive controller's budgets can move between requests, a different
   tree changes the bf16 verify forward's numerics, and a sampled token then flips where its
   perturbed scores nearly tie (the likely cause of a false alarm on the H200, 5 tokens in,
   seed 1597723316). Pinned, the
   requests run the same trees and must agree exactly; speculation on vs off is the
   speculation probe's comparison, which tolerates those flips.
2. First-token frequencies against the reported probabilities: ``samples`` first tokens are drawn
   at temperature 1 (seeds base, base+1, ...; ``n`` choices per request) with top-5 logprobs; the
   counts of the top-5 tokens and of "any other token" are tested against the server's own
   probabilities with a G-test whose p-value is computed by Monte Carlo (exact for small counts).
   It fails when p < ``false_alarm`` (default 1e-4: one healthy run in ten thousand fails). A
   sampler that ignores temperature, top-p or the distribution itself is caught; one that is
   greedy always puts every sample on one token.

The prompt is the most uncertain of a few (lowest top-1 probability at temperature 0); a model
that is near-certain on all of them (top-1 > 0.99) gets the frequency test skipped, noted.
"""

from __future__ import annotations

import math
import random
import re

import numpy as np

from treeverify.gate import evidence
from treeverify.gate.client import HttpError
from treeverify.gate.codes import ExitCode
from treeverify.gate.probing import Ctx, Fail, pin_budget
from treeverify.gate.report import ProbeResult

PROMPTS = (
    "Once upon a time, in a small village by the sea,",
    "My favourite word is",
    "Here is a random letter:",
)
TOP_K = 5
PER_REQUEST = 16  # n choices per request (OpenAI's n; at most 16 on our server)
SIMULATIONS = 100_000  # p-values resolved to 1e-5, well below the false-alarm rate
REPRO_TOKENS = 16


def g_test_pvalue(observed: list[int], probs: list[float], sims: int = SIMULATIONS) -> float:
    """P(G >= G_observed) for multinomial counts under ``probs``, by Monte Carlo (fixed seed)."""
    obs = np.asarray(observed, dtype=np.float64)
    p = np.asarray(probs, dtype=np.float64)
    p = p / p.sum()
    n = int(obs.sum())
    exp = n * p

    def g(counts: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            terms = np.where(counts > 0, counts * np.log(counts / exp), 0.0)
        return 2.0 * terms.sum(axis=-1)

    g_obs = float(g(obs))
    rng = np.random.default_rng(0)
    sim = g(rng.multinomial(n, p, size=sims).astype(np.float64))
    return float((1 + np.count_nonzero(sim >= g_obs - 1e-9)) / (sims + 1))


def _sample(ctx: Ctx, prompt: str, seed: int, n: int, max_tokens: int, logprobs: int | None,
            pin: dict | None = None):  # fmt: skip
    """``n`` completions at temperature 1; choices from one request where the server takes n."""
    body = {"model": ctx.client.model, "prompt": prompt, "max_tokens": max_tokens}
    body.update(temperature=1.0, top_p=1.0, seed=seed, n=n, **(pin or {}))
    if logprobs is not None:
        body["logprobs"] = logprobs
    choices = ctx.client.post_json("/v1/completions", body).get("choices")
    if not isinstance(choices, list) or len(choices) != n:
        raise HttpError(200, f"asked n={n} choices, got {choices!r}"[:300])
    return sorted(choices, key=lambda c: c.get("index", 0))


def _reproducible(ctx: Ctx, seed: int, pin: dict) -> list[str]:
    """Failures of 'same seed -> same text' (non-streamed twice, and streamed), every request
    with `pin` (the speculative budget, where the server speculates: see the module doc)."""
    prompt = PROMPTS[0]
    a = _sample(ctx, prompt, seed, 1, REPRO_TOKENS, None, pin)[0].get("text")
    b = _sample(ctx, prompt, seed, 1, REPRO_TOKENS, None, pin)[0].get("text")
    extra = {"temperature": 1.0, "top_p": 1.0, "seed": seed, **pin}
    s = ctx.client.stream(prompt, REPRO_TOKENS, ctx.itl_deadline, extra=extra).text
    bad = []
    if a != b:
        bad.append(f"seed {seed}: two requests sampled {a!r} and {b!r}")
    if s != a:
        bad.append(f"seed {seed}: streamed {s!r} != non-streamed {a!r}")
    return bad


def _ambiguous(key: str) -> bool:
    return "\ufffd" in key and re.search(r"#\d+$", key) is None


def _pick_prompt(ctx: Ctx) -> tuple[str, float]:
    best = None
    for p in PROMPTS:
        c = ctx.client.complete(p, 1, logprobs=TOP_K)
        top = (c.top_logprobs or [{}])[0] or {}
        p1 = math.exp(max(top.values())) if top else 1.0
        if best is None or p1 < best[1]:
            best = (p, p1)
    return best


def probe(ctx: Ctx) -> ProbeResult:
    seed = random.randrange(1, 2**31)  # fresh each run; reported
    notes: list[str] = []
    pin = pin_budget(ctx, PROMPTS[0], notes)
    failures = _reproducible(ctx, seed, pin)
    data: dict = {"seed": seed, **pin, **({"notes": notes} if notes else {})}
    prompt, p1 = _pick_prompt(ctx)
    if failures:
        raise Fail(ExitCode.CORRECTNESS, failures[0], {"failures": failures, **data})
    pinned = f" at budget {pin['speculative_budget']}" if pin else ""
    if p1 > 0.99:
        detail = (f"seeded sampling reproducible{pinned}; frequency test skipped "
                  f"(top-1 {p1:.3f} > 0.99)")  # fmt: skip
        return ProbeResult("sampled", "pass", detail, data=data)
    counts: dict = {}
    top: dict | None = None
    drawn = 0
    while drawn < ctx.samples:
        k = min(PER_REQUEST, ctx.samples - drawn)
        for ch in _sample(ctx, prompt, seed + 7919 + drawn, k, 1, TOP_K):
            lp = ch.get("logprobs") or {}
            tok = (lp.get("tokens") or [None])[0]
            tid = (lp.get("token_ids") or [None])[0]
            if top is None:
                top = (lp.get("top_logprobs") or [None])[0]
            counts[(tok, tid)] = counts.get((tok, tid), 0) + 1
        drawn += k
    if not top:
        raise Fail(ExitCode.INFRA, "the server returned no top_logprobs for sampled requests")
    # keys that may stand for several tokens (U+FFFD without an id) join "any other token"
    keys = [k for k in top if not _ambiguous(k)]
    observed = [0] * (len(keys) + 1)  # the top-k tokens, then "any other token"
    for (tok, tid), c in counts.items():
        hit = [i for i, k in enumerate(keys) if evidence.lookup({k: 0.0}, tok, tid) is not None]
        if tok is not None and _ambiguous(tok) and tid is None:
            hit = []
        observed[hit[0] if hit else -1] += c
    probs = [math.exp(top[k]) for k in keys]
    probs.append(max(1.0 - sum(probs), 1e-6))
    pval = g_test_pvalue(observed, probs)
    expected = [round(drawn * p / sum(probs), 2) for p in probs]
    data.update(prompt=prompt, samples=drawn, observed=observed, expected=expected, p_value=pval)
    shown = f"observed {observed} vs expected {expected} (top-{len(keys)} + other)"
    if pval < ctx.false_alarm:
        detail = (
            f"first-token frequencies disagree with the reported probabilities at temperature 1: "
            f"{shown}, G-test p = {pval:.2g} < {ctx.false_alarm:g}"
        )
        raise Fail(ExitCode.CORRECTNESS, detail, data)
    detail = (
        f"seeded sampling reproducible{pinned}; {drawn} first tokens match the probabilities "
        f"(p = {pval:.2g})"
    )
    return ProbeResult("sampled", "pass", detail, data=data)
