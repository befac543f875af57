"""The chat probe: ``/v1/chat/completions`` is what most traffic uses, so it is gated too.

With a golden file: each recorded conversation's greedy reply (with top-k logprobs) must match
within the tolerance, with and without logprobs, streamed and not; a reply from another model or
another template is a divergence at its first token. Without one: chat answers, repeats agree and
the streamed reply equals the non-streamed one. A server without chat (no chat template: a 4xx on
the route) is a skip, noted.
"""

from __future__ import annotations

from treeverify.gate import golden as G
from treeverify.gate.client import HttpError
from treeverify.gate.probing import Ctx, Tally
from treeverify.gate.report import ProbeResult

CONVERSATIONS = (
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Write a Python function that adds two numbers."},
    ],
    [
        {"role": "user", "content": "Count to five."},
        {"role": "assistant", "content": "1, 2, 3, 4, 5."},
        {"role": "user", "content": "Now backwards."},
    ],
)
MAX_TOKENS = 16


def _reply(ctx: Ctx, messages: list[dict], logprobs: bool):
    top = G.TOP_K if logprobs else None
    return ctx.client.chat(messages, MAX_TOKENS, top_logprobs=top, extra={"ignore_eos": True})


def record(ctx: Ctx) -> list[dict]:
    """The conversations' greedy replies with top-k logprobs ([] where the server has no chat)."""
    out = []
    for messages in CONVERSATIONS:
        try:
            c = _reply(ctx, messages, logprobs=True)
        except HttpError as exc:
            if 400 <= exc.status < 500:
                return []
            raise
        out.append({"messages": messages, "max_tokens": MAX_TOKENS, **c.to_json()})
    return out


def probe(ctx: Ctx) -> ProbeResult:
    refs = (ctx.golden or {}).get("chat")
    t = Tally(ctx)
    try:
        if refs:
            for i, ref in enumerate(refs):
                msgs = ref["messages"]
                label = f"chat[{i}] {msgs[-1].get('content', '')[:24]!r}"
                t.agree(label, msgs, ref, _reply(ctx, msgs, logprobs=True), trusted=True)
                plain = _reply(ctx, msgs, logprobs=False).text
                t.agree_text(label, msgs, ref, plain, trusted=True)
                s = ctx.client.stream("", MAX_TOKENS, ctx.itl_deadline, {"ignore_eos": True}, msgs)
                t.agree_text(f"{label} streamed", msgs, ref, s.text, trusted=True)
            return t.verdict("chat", f"{len(refs)} conversation(s) within tolerance (vs golden)")
        msgs = CONVERSATIONS[0]
        first = _reply(ctx, msgs, logprobs=True)
    except HttpError as exc:
        if 400 <= exc.status < 500 and not refs:
            return ProbeResult("chat", "skip", f"the server has no chat: {exc}"[:300])
        raise
    t.agree("repeat", msgs, first, _reply(ctx, msgs, logprobs=True))
    s = ctx.client.stream("", MAX_TOKENS, ctx.itl_deadline, {"ignore_eos": True}, msgs)
    if s.text != first.text:
        t.agree_text("streamed", msgs, first, s.text)
    detail = "replies; repeat and stream agree (no golden: record one to check the replies)"
    return t.verdict("chat", detail)
