"""The long-context copy probe: a check of long prompts that needs no golden file.

A passage repeated, cut mid-sentence: a model that attends correctly continues it with the
passage's next words. Calibrated at ~200 prompt tokens: a model that copies there (at least
``MIN_CHARS`` characters of the expected continuation) must copy at every rung up to the context
limit; one that cannot copy at all (random weights: tiny-llama, tiny-kimi) gets the probe skipped,
noted. What it catches: attention or KV bugs that turn long prompts into nonsense while short
ones (and the smoke test) look fine.
"""

from __future__ import annotations

from treeverify.gate import golden as G
from treeverify.gate.probing import Ctx, Tally
from treeverify.gate.report import ProbeResult

# (passage, where it is cut: mid-sentence / mid-line); prose first, then code for code models
PASSAGES = (
    (
        "Marta packed seven blue notebooks, a brass compass and her grandfather's map into the "
        "canvas bag. The ferry to Oslo left at dawn, so she slept in the station with her boots "
        "on. At six the gulls woke her; the harbour smelled of tar, rain and frying onions. ",
        "The ferry to",
    ),
    (
        "def moving_average(values, window):\n"
        "    if window <= 0:\n"
        "        raise ValueError('window must be positive')\n"
        "    total, out = 0.0, []\n"
        "    for i, v in enumerate(values):\n"
        "        total += v\n"
        "        if i >= window:\n"
        "            total -= values[i - window]\n"
        "        out.append(total / min(i + 1, window))\n"
        "    return out\n\n\n",
        "total -= values",
    ),
)
CALIBRATION_TOKENS = 200
MIN_CHARS = 8  # a continuation must reproduce at least this much of the passage
DECODE = 16


def copy_prompt(chars: int, which: int = 0) -> tuple[str, str]:
    """(prompt of about ``chars`` characters: passage ``which`` repeated, ending at its cut; the
    expected continuation)."""
    passage, mark = PASSAGES[which]
    cut = passage.index(mark) + len(mark)
    whole = max(1, (chars - cut) // len(passage))
    return passage * whole + passage[:cut], passage[cut : cut + 40]


def copied(text: str, expected: str) -> int:
    """Characters of ``expected`` that ``text`` reproduces (their common prefix)."""
    n = 0
    for a, b in zip(text, expected, strict=False):
        if a != b:
            break
        n += 1
    return n


def _calibrate(ctx: Ctx, which: int):
    """(chars per token, the ~200-token completion, characters it copied) for one passage."""
    probe_prompt, _ = copy_prompt(
        min(CALIBRATION_TOKENS * 4, ctx.context_length - DECODE - 8), which
    )
    c = ctx.client.complete(probe_prompt, 1)
    cpt = len(probe_prompt) / max(1, c.prompt_tokens or len(probe_prompt) // 4)
    prompt, expected = copy_prompt(int(CALIBRATION_TOKENS * cpt), which)
    base = ctx.client.complete(prompt, DECODE, extra={"ignore_eos": True})
    return cpt, base, copied(base.text, expected)


def probe(ctx: Ctx) -> ProbeResult:
    if not ctx.context_length:
        return ProbeResult("copy", "skip", "context length unknown (give --context-length)")
    fits = [  # passages whose shortest prompt fits (ASCII: tokens <= characters + BOS)
        k
        for k in range(len(PASSAGES))
        if len(copy_prompt(0, k)[0]) + DECODE + 8 <= ctx.context_length
    ]
    if not fits:
        return ProbeResult("copy", "skip", f"context {ctx.context_length} is too short")
    tried = []
    for which in fits:
        cpt, base, got = _calibrate(ctx, which)
        if got >= MIN_CHARS:
            break
        tried.append(
            f"{('prose', 'code')[which]}: {got} chars at {base.prompt_tokens} tokens, got "
            f"{base.text[:16]!r}"
        )
    else:
        return ProbeResult(
            "copy",
            "skip",
            f"the model does not copy a repeated passage ({'; '.join(tried)}): nothing to check "
            "at longer contexts",
        )
    t, rows = Tally(ctx), []
    for n in G.ladder_lengths(ctx.context_length, DECODE):
        if n <= CALIBRATION_TOKENS:
            continue
        prompt, expected = copy_prompt(int(n * cpt * 0.97), which)
        cur = ctx.client.complete(prompt, DECODE, extra={"ignore_eos": True})
        k = copied(cur.text, expected)
        rows.append({"prompt_tokens": cur.prompt_tokens, "copied_chars": k})
        if k < MIN_CHARS:
            t.failures.append(
                f"at {cur.prompt_tokens} prompt tokens the passage is not copied: expected "
                f"{expected[:24]!r}..., got {cur.text[:24]!r} (copied at {base.prompt_tokens})"
            )
    longest = max((r["prompt_tokens"] or 0) for r in rows) if rows else base.prompt_tokens
    what = ("prose", "code")[which]
    detail = f"copies the {what} passage at {len(rows) + 1} lengths up to {longest} prompt tokens"
    return t.verdict("copy", detail, {"rungs": rows, "passage": what})
