"""Greedy outputs compared with the top-k tolerance at the first divergence.

Exact token equality across batch sizes, graph replay or kernels is unsound without a
batch-invariant mode: two tokens whose logits are nearly tied may swap under a legitimate change
in reduction order. The rule (both sides are greedy, with top-k logprobs):

1. Walk both token lists to the first position ``i`` where they differ. Equal lists pass.
2. Every position up to and including ``i`` must agree in logprob: for the token each side chose,
   ``|ref_logprob - cur_logprob| <= logprob_atol`` wherever both sides report it (a numerical
   fault that shifts the distribution is caught even before it flips a token).
3. At ``i`` the swap is a near-tie, seen from both sides: the current token ``b`` is in the
   reference's top-k at ``i`` with ``ref[a] - ref[b] <= margin``, and the reference token ``a`` is
   in the current top-k with ``cur[b] - cur[a] <= margin``. A side without top-k logprobs cannot
   vouch for a swap (then the divergence fails).
4. After a tolerated swap the two continuations condition on different text, so nothing after
   ``i`` is compared. A length difference without a divergence fails.

Defaults: ``margin`` 0.1 nat, ``logprob_atol`` 0.25 nat (``--margin``/``--logprob-atol``; a
golden file stores the values it was recorded with, and ``check`` uses them unless overridden).
"""

from __future__ import annotations

import dataclasses
import re

DEFAULT_MARGIN = 0.1
DEFAULT_LOGPROB_ATOL = 0.25
_BYTES = re.compile(r"\\x([0-9a-fA-F]{2})")


@dataclasses.dataclass
class Outcome:
    ok: bool
    detail: str
    divergence: int | None = None
    # "swap": the outputs chose different tokens at ``divergence`` (a question the server's
    # teacher-forced logprobs can settle, see evidence.py); "" for every other outcome
    kind: str = ""
    other: str | None = None  # compare_text: the top-k token the response continued with


def _get(d, key, i):
    seq = d.get(key) if isinstance(d, dict) else getattr(d, key, None)
    if seq is None or i >= len(seq):
        return None
    return seq[i]


def compare(
    ref,
    cur,
    margin: float = DEFAULT_MARGIN,
    logprob_atol: float = DEFAULT_LOGPROB_ATOL,
) -> Outcome:
    """``ref``/``cur``: dicts or objects with ``tokens`` (or only ``text``), ``token_logprobs``,
    ``top_logprobs`` and, where the server gives them, ``token_ids`` (then token identity is the
    id: two tokens shown alike, e.g. partial characters, are still told apart)."""
    rt, ct = _tokens(ref), _tokens(cur)
    rid, cid = _ids(ref, rt), _ids(cur, ct)
    n = min(len(rt), len(ct))
    if rid is not None and cid is not None:
        i = next((j for j in range(n) if rid[j] != cid[j]), None)
    else:
        i = next((j for j in range(n) if rt[j] != ct[j]), None)
        rid = cid = None
    last = i if i is not None else n - 1
    for j in range(last + 1):
        pairs = {(rt[j], _at(rid, j)): None, (ct[j], _at(cid, j)): None}
        for tok, tid in pairs:
            rl, cl = _lp(ref, rt, j, tok, tid, rid), _lp(cur, ct, j, tok, tid, cid)
            if rl is not None and cl is not None and abs(rl - cl) > logprob_atol:
                return Outcome(
                    False,
                    f"logprob of {tok!r} at token {j} drifted {rl:.4f} -> {cl:.4f} "
                    f"(> {logprob_atol} nat)",
                    j,
                )
    if i is None:
        if len(rt) != len(ct):
            return Outcome(False, f"lengths differ ({len(rt)} vs {len(ct)} tokens)", n)
        return Outcome(True, f"identical ({len(rt)} tokens)")
    a, b = (rt[i], _at(rid, i)), (ct[i], _at(cid, i))
    ra, rb = _lp(ref, rt, i, *a, rid), _lp(ref, rt, i, *b, rid)
    ca, cb = _lp(cur, ct, i, *a, cid), _lp(cur, ct, i, *b, cid)
    where = f"token {i}: expected {_show(a)}, got {_show(b)}"
    if None in (ra, rb, ca, cb):
        side = "reference" if rb is None or ra is None else "current"
        return Outcome(False, f"diverged at {where}; not in the {side} top-k", i, "swap")
    if ra - rb > margin or cb - ca > margin:
        return Outcome(
            False,
            f"diverged at {where}; margins {ra - rb:.4f}/{cb - ca:.4f} nat > {margin}",
            i,
            "swap",
        )
    return Outcome(
        True,
        f"near-tie swap tolerated at {where} (margins {ra - rb:.4f}/{cb - ca:.4f} nat)",
        i,
    )


def _ids(d, toks: list[str]) -> list[int] | None:
    ids = d.get("token_ids") if isinstance(d, dict) else getattr(d, "token_ids", None)
    return list(ids) if ids and len(ids) == len(toks) else None


def _at(ids: list[int] | None, i: int) -> int | None:
    return ids[i] if ids is not None else None


def _show(tok: tuple) -> str:
    return repr(tok[0]) if tok[1] is None else f"{tok[0]!r} (id {tok[1]})"


def _tokens(d) -> list[str]:
    toks = d.get("tokens") if isinstance(d, dict) else getattr(d, "tokens", None)
    if toks is not None:
        return list(toks)
    text = d.get("text") if isinstance(d, dict) else getattr(d, "text", "")
    return list(text or "")  # no token boundaries: characters (exact comparison only)


def _lp(d, toks: list[str], i: int, tok: str, tid=None, ids=None) -> float | None:
    """The logprob side ``d`` gave a token at position ``i`` (its own choice or its top-k); the
    token is ``tok`` (text key) and, where ids are known, ``tid``."""
    own = tok == toks[i] if tid is None or ids is None else tid == ids[i]
    if own:
        v = _get(d, "token_logprobs", i)
        if v is not None:
            return v
    top = _get(d, "top_logprobs", i)
    if not isinstance(top, dict):
        return None
    if tid is not None:  # a disambiguated key "<text>#<id>" first, then the plain one
        for k, v in top.items():
            if k.endswith(f"#{tid}"):
                return v
    return top.get(tok)


def token_bytes(tok: str) -> bytes | None:
    """A token string's bytes: OpenAI's ``bytes:\\xNN`` form or UTF-8 text; None where the text
    lost bytes (U+FFFD stands for a partial character)."""
    if tok.startswith("bytes:"):
        return bytes(int(h, 16) for h in _BYTES.findall(tok))
    if "\ufffd" in tok:
        return None
    return tok.encode("utf-8")


def spelled(d) -> list[bytes | None]:
    """Each chosen token's bytes. A token shown as U+FFFD is looked up in its own top-k, where a
    server may key it in OpenAI's ``bytes:`` form: the entry with the chosen token's logprob."""
    toks = _tokens(d)
    out = []
    for i, tok in enumerate(toks):
        b = token_bytes(tok)
        if b is None:
            lp, top = _get(d, "token_logprobs", i), _get(d, "top_logprobs", i)
            if lp is not None and isinstance(top, dict):
                same = [k for k, v in top.items() if v == lp and token_bytes(k) is not None]
                b = token_bytes(same[0]) if len(same) == 1 else None
        out.append(b)
    return out


def compare_text(ref, text: str, margin: float = DEFAULT_MARGIN) -> Outcome:
    """A response without logprobs (the production path: servers may route logprob requests
    differently, e.g. without speculation) against a reference with top-k logprobs. One-sided
    rule 3, on bytes: at the first token ``i`` whose bytes the response does not continue with,
    the response must continue with another token of the reference's top-k at ``i`` within
    ``margin`` (``Outcome.other`` names the longest such token, tolerated or not). Where the
    reference tokens do not give their bytes (U+FFFD without OpenAI's ``bytes:`` form), only
    exact equality passes."""
    ref_text = ref.get("text") if isinstance(ref, dict) else getattr(ref, "text", "")
    if text == ref_text:
        return Outcome(True, "identical text")
    toks = _tokens(ref)
    raw = spelled(ref)
    if None in raw or _get(ref, "top_logprobs", 0) is None:
        return Outcome(False, f"text differs: expected {ref_text!r}, got {text!r}")
    have = text.encode("utf-8")
    pos = 0
    for i, (tok, b) in enumerate(zip(toks, raw, strict=True)):
        if not have.startswith(b, pos):
            lp = _lp(ref, toks, i, tok)
            swaps = []
            for t, v in (_get(ref, "top_logprobs", i) or {}).items():
                tb = token_bytes(t) if t != tok else None
                if tb and have.startswith(tb, pos) and lp is not None:
                    swaps.append((t, lp - v, len(tb)))
            ok = [s for s in swaps if s[1] <= margin]
            got = have[pos : pos + 8].decode("utf-8", "replace")
            where = f"token {i}: expected {tok!r}, got {got!r}..."
            other = max(swaps, key=lambda s: s[2])[0] if swaps else None
            if ok:
                return Outcome(
                    True, f"near-tie swap tolerated at {where} ({ok[0][1]:.4f})", i, other=other
                )
            detail = f"diverged at {where}; no near-tie in the reference top-k"
            return Outcome(False, detail, i, "swap", other)
        pos += len(b)
    tail = have[pos : pos + 20].decode("utf-8", "replace")
    return Outcome(False, f"text longer than the reference: {tail!r}...", None)
