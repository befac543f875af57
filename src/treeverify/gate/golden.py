"""The golden suite: fixed greedy prompts, chat conversations (chat.py) and a length ladder,
recorded with top-k logprobs (and latency) on a known-good deployment by ``gate record``;
``gate check`` compares against it. An oracle file holds exact expected continuations:
``{prompt, expected}`` for completions, ``{messages, expected}`` for chat."""

from __future__ import annotations

import datetime
import json

SUITE_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "1, 2, 3, 5, 8, 13,",
    "Translate to German: The weather is nice today. ->",
    "Q: What is 17 times 23?\nA:",
    "Once upon a time, in a small village by the sea,",
)
SUITE_MAX_TOKENS = 16
TOP_K = 5

# Varied text (not one repeated word) so long prompts exercise real attention patterns.
LADDER_TEXT = (
    "In 1869 the first transcontinental railroad joined the Union Pacific and the Central Pacific "
    "at Promontory Summit, Utah. Engineers had laid 1,912 miles of track across deserts and "
    "mountains; crews of Chinese and Irish workers blasted tunnels through the Sierra Nevada. "
    "A journey from New York to San Francisco fell from months to about a week. Freight rates "
    "dropped, towns grew along the line, and the telegraph followed the rails west. "
)
LADDER_DECODE = 16
FORMAT_VERSION = 1


def ladder_lengths(context: int, decode: int = LADDER_DECODE) -> list[int]:
    """Prompt lengths in tokens: a geometric climb, 3/4 of the context, and the longest prompt
    that still leaves room to decode (capped at 64 Ki tokens)."""
    top = min(context - decode - 8, 65536)
    out, n = [], 32
    while n < top:
        out.append(n)
        n *= 2
    out += [int(context * 0.75), top]
    return sorted({x for x in out if 8 <= x <= top})


def ladder_prompt(chars: int) -> str:
    reps = chars // len(LADDER_TEXT) + 1
    return (LADDER_TEXT * reps)[:chars]


def long_decode_tokens(context: int) -> int:
    """A decode that walks a short prompt deep into the context (the other half of 'long')."""
    return max(8, min(context - 64, 512))


def new(meta: dict) -> dict:
    return {
        "format": "treeverify-gate-golden",
        "version": FORMAT_VERSION,
        "recorded_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        **meta,
    }


def save(path: str, golden: dict) -> None:
    with open(path, "w") as f:
        json.dump(golden, f, indent=1)
        f.write("\n")


def load(path: str) -> dict:
    with open(path) as f:
        g = json.load(f)
    if not isinstance(g, dict) or g.get("format") != "treeverify-gate-golden":
        raise ValueError(f"{path}: not a treeverify gate golden file")
    return g


def load_oracle(path: str) -> list[dict]:
    with open(path) as f:
        items = json.load(f)
    if not isinstance(items, list) or not all(
        isinstance(x, dict)
        and (isinstance(x.get("prompt"), str) or _is_messages(x.get("messages")))
        and isinstance(x.get("expected"), str)
        for x in items
    ):
        raise ValueError(
            f"{path}: expected a JSON list of {{prompt, expected}} or {{messages, expected}} "
            "objects"
        )
    return items


def _is_messages(m) -> bool:
    return (
        isinstance(m, list)
        and bool(m)
        and all(isinstance(x, dict) and isinstance(x.get("role"), str) for x in m)
    )
