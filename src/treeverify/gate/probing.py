"""What every probe shares: the context, how a probe fails, how its outcome is classified, and
the agreement check (top-k tolerance, then the server's teacher-forced evidence at a swap)."""

from __future__ import annotations

import dataclasses
import time

import httpx

from treeverify.gate import evidence
from treeverify.gate import golden as G
from treeverify.gate.client import BudgetSpent, Client, Completion, HttpError, Stalled
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
    max_concurrency: int | None = None  # None: the server's own limit (/server_info), else 32
    perf_factor: float = 3.0
    perf_slack: float = 0.05
    samples: int = 256  # first tokens drawn by the sampled probe
    false_alarm: float = 1e-4  # the sampled probe's statistical false-alarm rate
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
    except BudgetSpent as exc:
        res = ProbeResult(name, "fail", str(exc), ExitCode.HUNG)
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


def greedy(ctx: Ctx, prompt, max_tokens: int, client: Client | None = None, **extra):
    """Greedy with top-k logprobs (token identity and the tolerance need them)."""
    c = client or ctx.client
    return c.complete(prompt, max_tokens, logprobs=G.TOP_K, extra={"ignore_eos": True, **extra})


def plain(ctx: Ctx, prompt, max_tokens: int, client: Client | None = None, **extra):
    """Greedy without logprobs: the path production traffic takes."""
    c = client or ctx.client
    return c.complete(prompt, max_tokens, extra={"ignore_eos": True, **extra})


def pin_budget(ctx: Ctx, prompt, notes: list[str]) -> dict:
    """{"speculative_budget": B} with the server's largest budget, when it speculates and takes
    the field: an adaptive controller may decode short probe requests plainly (budget 0), or
    at budgets that move between two requests as its measured costs do (different trees, so a
    bf16 verify forward's numerics differ). A server without the field answers 400: no pin,
    and a note says so."""
    spec = (ctx.server_info or {}).get("speculative") or {}
    budget = spec.get("budget")
    if not spec.get("enabled") or not isinstance(budget, int) or budget < 1:
        return {}
    pin = {"speculative_budget": budget}
    try:
        plain(ctx, prompt, 2, **pin)
    except HttpError as exc:
        if exc.status != 400:
            raise
        notes.append(f"the server refused speculative_budget ({str(exc)[:80]}): not pinned")
        return {}
    return pin


class Tally:
    """One probe's findings: failures, tolerated near-ties, and the evidence for each swap."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        self.failures: list[str] = []
        self.notes: list[str] = []
        self.divergences: list[dict] = []

    def agree(self, label: str, prompt, ref, cur: Completion, trusted: bool = False) -> None:
        """``cur`` (greedy with logprobs) must match ``ref`` within the tolerance. ``trusted``:
        ref comes from a known-good deployment (golden, baseline), so where its own top-k shows
        the two tokens more than the margin apart the swap is real whatever the server under test
        says (a faulty server must not vouch for its own fault)."""
        out = compare(ref, cur, self.ctx.margin, self.ctx.logprob_atol)
        if self._settled(label, out):
            return
        i = out.divergence
        ids = cur.token_ids
        b = (cur.tokens[i], ids[i] if ids and i < len(ids) else None)
        self._decide(label, prompt, ref, i, b, out.detail, trusted)

    def _settled(self, label: str, out) -> bool:
        """Record a pass (noting a tolerated divergence) or a failure that is not a token swap;
        False: a swap, which needs the server's evidence."""
        if out.ok:
            if out.divergence is not None:
                self.notes.append(f"{label}: {out.detail}")
            return True
        if out.kind != "swap":
            self.failures.append(f"{label}: {out.detail}")
            return True
        return False

    def agree_text(self, label: str, prompt, ref, text: str, trusted: bool = False) -> None:
        """A response without logprobs against a reference with them (one-sided rule)."""
        out = compare_text(ref, text, self.ctx.margin)
        label = f"{label} (no logprobs)"
        if self._settled(label, out):
            return
        # the other side's token: the top-k entry its text continues with (else unknown)
        b = (out.other, None)
        self._decide(label, prompt, ref, out.divergence, b, out.detail, trusted)

    def _decide(self, label, prompt, ref, i: int, b: tuple, detail: str, trusted: bool) -> None:
        ev = evidence.decide(self.ctx.client, prompt, ref, i, b, self.ctx.margin)
        said = ev.describe(self.ctx.margin)
        ref_gap = _reference_gap(ref, i, b) if trusted else None
        if ref_gap is not None and ref_gap > self.ctx.margin:
            said += f"; the known-good reference's gap {ref_gap:.4f} nat decides: real"
            ev.near_tie = False
        self.divergences.append(
            {"label": label, "token": i, "detail": detail, "reference_gap": ref_gap, **ev.to_json()}
        )
        if ev.near_tie:
            self.notes.append(f"{label}: {detail}; {said}")
        else:
            self.failures.append(f"{label}: {detail}; {said}")

    def verdict(self, name: str, ok_detail: str, data: dict | None = None) -> ProbeResult:
        data = {"notes": self.notes, "divergences": self.divergences, **(data or {})}
        if self.failures:
            more = f" (+{len(self.failures) - 1} more)" if len(self.failures) > 1 else ""
            raise Fail(
                ExitCode.CORRECTNESS, self.failures[0] + more, {"failures": self.failures, **data}
            )
        detail = ok_detail
        if self.notes:
            detail += f"; {len(self.notes)} tolerated near-tie swap(s)"
        return ProbeResult(name, "pass", detail, data=data)


def _reference_gap(ref, i: int, b: tuple) -> float | None:
    """logprob(a) - logprob(b) in the reference's own top-k at ``i`` (None where it lacks b)."""
    toks, tops = _get(ref, "tokens") or [], _get(ref, "top_logprobs") or []
    if i >= len(toks) or i >= len(tops):
        return None
    ids = _get(ref, "token_ids")
    la = evidence.lookup(tops[i], toks[i], ids[i] if ids and i < len(ids) else None)
    lb = evidence.lookup(tops[i], *b) if b[0] is not None or b[1] is not None else None
    return None if la is None or lb is None else la - lb


def _get(d, key):
    return d.get(key) if isinstance(d, dict) else getattr(d, key, None)
