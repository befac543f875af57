"""Text that cannot fit the context is refused before it is encoded (server/serving.py's
TEXT_SLACK bound): encoding holds the GIL throughout, and a 7.7 MB prompt under the 8 MiB body
limit took 18.7 s on tiny-code's tokenizer with /health unanswered meanwhile (a new user's
audit, fifty-seventh session). The real tiny-code tokenizer; the engine is a stand-in (only its
tokenizer and vocabulary are read here)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")

import treeverify.models as models  # noqa: E402
from treeverify.models.tokenizer import HFTokenizer  # noqa: E402
from treeverify.server import protocol as P  # noqa: E402
from treeverify.server.metrics import Metrics  # noqa: E402
from treeverify.server.serving import TEXT_SLACK, RequestError, Serving  # noqa: E402

CTX = 1024
TINY_CODE = Path(models.__file__).parent / "data" / "tiny-code"


@pytest.fixture(scope="module")
def serving():
    tok = HFTokenizer(TINY_CODE)
    calls = []
    encode = tok.encode
    tok.encode = lambda text, add_bos=False: calls.append(len(text)) or encode(text, add_bos)
    llm = SimpleNamespace(tokenizer=tok, vocab_size=tok.vocab_size)
    s = Serving(SimpleNamespace(llm=llm), "tiny-code", CTX, Metrics("tiny-code"))
    s.calls = calls
    return s


def test_the_bound_is_what_a_token_can_hold(serving):
    """context x the longest piece's characters x TEXT_SLACK: no text past it fits."""
    longest = serving.tok.max_token_chars()
    assert longest >= 2  # BPE merges: some piece spans several characters
    assert serving.max_text_chars == CTX * longest * TEXT_SLACK


@pytest.mark.parametrize("field", ["prompt", "messages"])
def test_text_past_the_bound_is_refused_unencoded(serving, field):
    big = "def f(x):\n" * (serving.max_text_chars // 10 + 1)  # just past the bound
    serving.calls.clear()
    with pytest.raises(RequestError) as err:
        if field == "prompt":
            serving.completion_prompts(P.CompletionRequest(prompt=big))
        else:
            msgs = [{"role": "user", "content": big[: len(big) // 2]},
                    {"role": "user", "content": big[len(big) // 2 :]}]  # fmt: skip
            serving.chat_prompt(P.ChatCompletionRequest(messages=msgs))
    assert err.value.status == 400 and err.value.param == field
    assert "characters" in err.value.message and str(CTX) in err.value.message
    assert serving.calls == []  # never handed to the tokenizer


def test_text_under_the_bound_is_encoded_and_judged_by_its_tokens(serving):
    """Text under the bound is encoded as before: the context check then counts tokens (a
    prompt of many short lines, under the bound, still too long for the context: the token
    message, not the character one)."""
    text = "x = 1\n" * 2000  # ~12k characters: under the bound, over 1024 tokens
    assert len(text) <= serving.max_text_chars
    serving.calls.clear()
    prompts = serving.completion_prompts(P.CompletionRequest(prompt=text))
    assert serving.calls == [len(text)] and len(prompts[0]) > CTX
    with pytest.raises(RequestError, match="tokens"):
        serving.make_params(P.CompletionRequest(prompt=text), prompts, None, None, "prompt")


def test_a_participant_name_goes_where_the_template_has_a_place_for_it():
    """OpenAI's per-message `name`: rendered by a chat template that reads message['name'];
    refused with a 400 naming it where the template has no place for it (tiny-code's own)."""
    tok = HFTokenizer(TINY_CODE)
    llm = SimpleNamespace(tokenizer=tok, vocab_size=tok.vocab_size)
    msgs = [{"role": "user", "content": "hello", "name": "ann"}]
    plain = Serving(SimpleNamespace(llm=llm), "tiny-code", CTX, Metrics("tiny-code"))
    with pytest.raises(RequestError) as err:
        plain.chat_prompt(P.ChatCompletionRequest(messages=msgs))
    assert err.value.status == 400 and err.value.param == "messages.0.name"
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}{% if m['name'] %} ({{ m['name'] }}){% endif %}: "
        "{{ m['content'] }}\n{% endfor %}"
    )
    named = Serving(SimpleNamespace(llm=llm), "tiny-code", CTX, Metrics("tiny-code"))
    ids = named.chat_prompt(P.ChatCompletionRequest(messages=msgs))
    assert tok.decode(ids) == "user (ann): hello\n"
