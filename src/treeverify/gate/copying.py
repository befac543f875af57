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

PASSAGE = (
    "Marta packed seven blue notebooks, a brass compass and her grandfather's map into the "
    "canvas bag. The ferry to Oslo left at dawn, so she slept in the station with her boots on. "
    "At six the gulls woke her; the harbour smelled of tar, rain and frying onions. "
)
CALIBRATION_TOKENS = 200
MIN_CHARS = 8  # a continuation must reproduce at least this much of the passage
DECODE = 16
CUT = PASSAGE.index("The ferry to") + len("The ferry to")  # mid-sentence; expected text follows


def copy_prompt(chars: int) -> tuple[str, str]:
    """(prompt of about ``chars`` characters ending at the cut, the expected continuation)."""
    whole = max(1, (chars - CUT) // len(PASSAGE))
    return PASSAGE * whole + PASSAGE[:CUT], PASSAGE[CUT : CUT + 40]


def copied(text: str, expected: str) -> int:
    """Characters of ``expected`` that ``text`` reproduces (their common prefix)."""
    n = 0
    for a, b in zip(text, expected, strict=False):
        if a != b:
            break
        n += 1
    return n


def probe(ctx: Ctx) -> ProbeResult:
    if not ctx.context_length:
        return ProbeResult("copy", "skip", "context length unknown (give --context-length)")
    shortest, _ = copy_prompt(0)
    if len(shortest) + DECODE + 8 > ctx.context_length:  # tokens <= characters: then it fits
        return ProbeResult("copy", "skip", f"context {ctx.context_length} is too short")
    probe_prompt, _ = copy_prompt(min(CALIBRATION_TOKENS * 4, ctx.context_length - DECODE - 8))
    c = ctx.client.complete(probe_prompt, 1)
    cpt = len(probe_prompt) / max(1, c.prompt_tokens or len(probe_prompt) // 4)  # chars/token
    prompt, expected = copy_prompt(int(CALIBRATION_TOKENS * cpt))
    base = ctx.client.complete(prompt, DECODE, extra={"ignore_eos": True})
    got = copied(base.text, expected)
    if got < MIN_CHARS:
        return ProbeResult(
            "copy",
            "skip",
            f"the model does not copy a repeated passage at {base.prompt_tokens} tokens "
            f"({got} chars of {expected[:MIN_CHARS]!r}; got {base.text[:24]!r}): nothing to "
            "check at longer contexts",
            data={"calibration": base.text},
        )
    t, rows = Tally(ctx), []
    for n in G.ladder_lengths(ctx.context_length, DECODE):
        if n <= CALIBRATION_TOKENS:
            continue
        prompt, expected = copy_prompt(int(n * cpt * 0.97))
        cur = ctx.client.complete(prompt, DECODE, extra={"ignore_eos": True})
        k = copied(cur.text, expected)
        rows.append({"prompt_tokens": cur.prompt_tokens, "copied_chars": k})
        if k < MIN_CHARS:
            t.failures.append(
                f"at {cur.prompt_tokens} prompt tokens the passage is not copied: expected "
                f"{expected[:24]!r}..., got {cur.text[:24]!r} (copied at {base.prompt_tokens})"
            )
    longest = max((r["prompt_tokens"] or 0) for r in rows) if rows else base.prompt_tokens
    detail = f"copies the passage at {len(rows) + 1} lengths up to {longest} prompt tokens"
    return t.verdict("copy", detail, {"rungs": rows})
