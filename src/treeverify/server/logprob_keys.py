"""Keys of a completions ``top_logprobs`` dict: one distinct key per token.

OpenAI's completions format maps token text -> logprob, so two tokens that decode to the same text
(byte pieces shown as U+FFFD, a special token and its spelled-out text, ...) would collapse into
one entry. Each token gets, in order of preference:

1. its text, when its bytes are valid UTF-8 and no other token at the position has that text;
2. OpenAI's byte form ``bytes:\\xNN...`` (lower-case hex of its bytes), when that is unique;
3. ``<text>#<token id>``, which always is.

``token_ids`` in the logprobs object (an extension) gives token identity for exact comparisons.
"""

from __future__ import annotations

from collections import Counter
from typing import Any


def token_bytes(tok: Any, tid: int) -> bytes:
    """The bytes token ``tid`` stands for (tokenizers without ``token_bytes``: its text)."""
    fn = getattr(tok, "token_bytes", None)
    if fn is not None:
        return fn(tid)
    return tok.decode([tid], skip_special_tokens=False).encode("utf-8")


def byte_form(data: bytes) -> str:
    return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def distinct_keys(tok: Any, ids: list[int]) -> dict[int, str]:
    """token id -> a key unique among ``ids`` (see the module doc for the rule)."""
    ids = list(dict.fromkeys(ids))
    text = {t: tok.decode([t], skip_special_tokens=False) for t in ids}
    raw = {t: token_bytes(tok, t) for t in ids}
    text_count = Counter(text.values())
    keys: dict[int, str] = {}
    for t in ids:
        try:
            raw[t].decode("utf-8")
            valid = "\ufffd" not in text[t]
        except UnicodeDecodeError:
            valid = False
        keys[t] = text[t] if valid and text_count[text[t]] == 1 else byte_form(raw[t])
    key_count = Counter(keys.values())
    for t in ids:
        if key_count[keys[t]] > 1:
            keys[t] = f"{text[t]}#{t}"
    return keys
