"""Divergences decided with evidence: where two outputs that should agree chose different tokens,
ask the server itself which is right.

At the first differing token ``i`` the server is asked for its top logprobs after the prompt and
the common prefix (temperature 0, max_tokens 1, top-5), and the swap is classified:

- **near-tie**: both tokens are in that top-k and ``|logprob(a) - logprob(b)| <= margin``; a
  legitimate change in reduction order (batch size, graph replay, kernel) can flip such a pair;
- **real**: otherwise (the gap is reported; a token outside the top-k makes it a lower bound).

How the prompt + common prefix is sent, best first:

1. token ids, when the server gives ``token_ids`` for completions and echoes the prompt's ids;
2. text, when the reference tokens spell its text (checked with the prompt token count);
3. the prefix regenerated: the same prompt with ``max_tokens = i + 1``; used only when the server
   reproduces the common prefix token for token, so the position is the same one (chat uses this).

When none of them applies the divergence stays a failure (the evidence is "unavailable").
Against a known-good reference (golden, baseline) the reference's own top-k has the last word
where it shows the pair more than the margin apart (probing.Tally, ``trusted``).
"""

from __future__ import annotations

import dataclasses

from treeverify.gate.client import Client, Completion, HttpError
from treeverify.gate.compare import spelled

TOP_K = 5


@dataclasses.dataclass
class Evidence:
    near_tie: bool | None  # None: no evidence could be had
    gap: float | None  # nat between the two tokens at the teacher-forced position
    lower_bound: bool  # the gap is at least this (a token outside the top-k)
    how: str  # "token ids" | "text" | "regenerated prefix" | "unavailable"
    top: dict | None = None

    def describe(self, margin: float) -> str:
        if self.near_tie is None or self.gap is None:
            return f"teacher-forced logprobs {self.how}"
        rel = ">=" if self.lower_bound else "="
        word = "near-tie" if self.near_tie else "real"
        return f"{word}: teacher-forced gap {rel} {self.gap:.4f} nat (margin {margin}; {self.how})"

    def to_json(self) -> dict:
        return {
            "near_tie": self.near_tie,
            "gap": None if self.gap is None else round(self.gap, 6),
            "gap_is_lower_bound": self.lower_bound,
            "how": self.how,
            "teacher_forced_top": self.top,
        }


def _field(d, key):
    return d.get(key) if isinstance(d, dict) else getattr(d, key, None)


def lookup(top: dict | None, key: str | None, tid: int | None) -> float | None:
    """The logprob of a token in a top-k dict: by its key, or by a ``<text>#<id>`` key."""
    if not isinstance(top, dict):
        return None
    if key is not None and key in top:
        return top[key]
    if tid is not None:
        for k, v in top.items():
            if k.endswith(f"#{tid}"):
                return v
    return None


def _prompt_ids(client: Client, prompt: str) -> list[int] | None:
    """The prompt's token ids where the server echoes them with ``token_ids`` (else None)."""
    try:
        c = client.complete(prompt, 1, logprobs=0, extra={"echo": True})
    except HttpError:  # an optional capability: a refusal just means "not available"
        return None
    n, ids = c.prompt_tokens, c.token_ids
    if n and ids and len(ids) == n + 1:
        return ids[:n]
    return None


def teacher_forced_top(client: Client, prompt, ref, i: int) -> tuple[dict | None, str]:
    """(top-k logprobs after prompt + ref's first ``i`` tokens, how they were obtained)."""
    ids = _field(ref, "token_ids")
    chat = not isinstance(prompt, str)
    if not chat and ids and len(ids) >= i:
        pids = _prompt_ids(client, prompt)
        if pids is not None:
            c = client.complete(pids + list(ids[:i]), 1, logprobs=TOP_K)
            return (c.top_logprobs or [None])[0], "token ids"
    prefix = spelled(ref)[:i]
    text = _field(ref, "text") or ""
    if not chat and None not in prefix:
        try:
            said = b"".join(prefix).decode("utf-8")
        except UnicodeDecodeError:  # the prefix ends inside a character: text cannot say it
            said = None
        if said is not None and text.startswith(said):
            c = client.complete(prompt + said, 1, logprobs=TOP_K)
            n0 = _field(ref, "prompt_tokens")
            if n0 is None or c.prompt_tokens is None or c.prompt_tokens == n0 + i:
                return (c.top_logprobs or [None])[0], "text"
    if chat:
        c = client.chat(prompt, i + 1, top_logprobs=TOP_K, extra={"ignore_eos": True})
    else:
        c = client.complete(prompt, i + 1, logprobs=TOP_K, extra={"ignore_eos": True})
    if _same_prefix(c, ref, i) and c.top_logprobs and len(c.top_logprobs) > i:
        return c.top_logprobs[i], "regenerated prefix"
    return None, "unavailable (no token ids, unspellable prefix, prefix not reproduced)"


def _same_prefix(c: Completion, ref, i: int) -> bool:
    rt, ct = list(_field(ref, "tokens") or []), list(c.tokens or [])
    if len(rt) < i or len(ct) < i or rt[:i] != ct[:i]:
        return False
    ri, ci = _field(ref, "token_ids"), c.token_ids
    return not (ri and ci) or list(ri[:i]) == list(ci[:i])


def classify(top: dict | None, a: tuple, b: tuple, margin: float, how: str) -> Evidence:
    """``a``/``b``: (key, token id or None) of the two tokens; ``b`` key None: unknown token."""
    if not top:
        return Evidence(None, None, False, how)
    la, lb = lookup(top, *a), (lookup(top, *b) if b[0] is not None or b[1] is not None else None)
    floor = min(top.values())
    if la is not None and lb is not None:
        gap = abs(la - lb)
        return Evidence(gap <= margin, gap, False, how, top)
    known = la if la is not None else lb
    if known is None:  # neither token is in the top-k: both are below its last entry
        gap = max(top.values()) - floor
        return Evidence(False, gap, True, how, top)
    gap = max(known - floor, 0.0)
    # a token outside the top-k can still be a near-tie when the top-k's tail is within margin;
    # without its logprob it cannot vouch for the swap
    return Evidence(False, gap, True, how, top)


def decide(client: Client, prompt, ref, i: int, b: tuple, margin: float) -> Evidence:
    """Evidence for a swap at token ``i``: ref chose its ``tokens[i]``, the other side ``b``."""
    toks, ids = list(_field(ref, "tokens") or []), _field(ref, "token_ids")
    a = (toks[i] if i < len(toks) else None, ids[i] if ids and i < len(ids) else None)
    top, how = teacher_forced_top(client, prompt, ref, i)
    return classify(top, a, b, margin, how)
