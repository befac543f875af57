"""Tokenizer pieces the server relies on: where the chat template comes from, token bytes, and
distinct top-logprob keys for tokens that share a text."""

from __future__ import annotations

import json

import pytest

from treeverify.models.tokenizer import ByteTokenizer
from treeverify.server.logprob_keys import byte_form, distinct_keys

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from treeverify.models.tokenizer import HFTokenizer  # noqa: E402

MSGS = [{"role": "user", "content": "hi"}]


def _word_dir(tmp_path, tcfg: dict):
    words = tokenizers.models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>")
    tok = tokenizers.Tokenizer(words)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tcfg))
    return tmp_path


def test_template_precedence(tmp_path):
    d = _word_dir(tmp_path, {"chat_template": "cfg:{{ messages[0].content }}"})
    assert HFTokenizer(d).apply_chat_template(MSGS) == "cfg:hi"
    (d / "chat_template.jinja").write_text("file:{{ messages[0].content }}")
    tok = HFTokenizer(d)
    assert tok.apply_chat_template(MSGS) == "file:hi"
    tok.chat_template = "flag:{{ messages[0].content }}"  # what --chat-template sets
    assert tok.apply_chat_template(MSGS) == "flag:hi"


def test_named_templates_and_errors(tmp_path):
    named = [{"name": "tool_use", "template": "t"}, {"name": "default", "template": "d"}]
    assert HFTokenizer(_word_dir(tmp_path, {"chat_template": named})).chat_template == "d"
    tok = HFTokenizer(_word_dir(tmp_path, {}))
    with pytest.raises(ValueError, match="--chat-template"):
        tok.apply_chat_template(MSGS)
    tok.chat_template = "{% for m in messages %}"  # unclosed block
    with pytest.raises(ValueError, match="syntax error"):
        tok.apply_chat_template(MSGS)


def test_byte_tokenizer_template_override():
    tok = ByteTokenizer()
    assert tok.apply_chat_template(MSGS) == "<|user|>\nhi\n<|assistant|>\n"
    tok.chat_template = "[{{ messages[0].role }}]{{ messages[0].content }}{{ eos_token }}"
    assert tok.apply_chat_template(MSGS) == "[user]hi<|eos|>"
    assert ByteTokenizer().chat_template is None  # per instance, not shared


def test_byte_level_bpe_token_bytes():
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(["caf\u00e9 \u20ac " * 50], vocab_size=300, min_frequency=1)
    tok = HFTokenizer.__new__(HFTokenizer)
    tok._tok, tok._byte_level = bpe._tokenizer, True
    text = "caf\u00e9 \u20ac"
    ids = bpe.encode(text).ids
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()


class _SameText:
    """A tokenizer where ids 1 and 2 both read "a", and 3, 4 are halves of one character."""

    def decode(self, ids, skip_special_tokens=True):
        return {1: "a", 2: "a", 3: "\ufffd", 4: "\ufffd", 5: "b"}[ids[0]]

    def token_bytes(self, tid):
        return {1: b"a", 2: b"a", 3: b"\xc3", 4: b"\xa9", 5: b"b"}[tid]


def test_distinct_keys():
    keys = distinct_keys(_SameText(), [1, 2, 3, 4, 5])
    assert keys[5] == "b"  # valid and unique: its text
    assert keys[3] == byte_form(b"\xc3") == "bytes:\\xc3" and keys[4] == "bytes:\\xa9"
    assert {keys[1], keys[2]} == {"a#1", "a#2"}  # same text, same bytes: text#id
    assert len(set(keys.values())) == 5


@pytest.mark.parametrize("text", ["\ud800abc", "ok \udfff"])
def test_a_lone_surrogate_is_a_unicode_error_from_every_tokenizer(tmp_path, text):
    # The server maps UnicodeError to a 400 naming the field; `tokenizers` itself raises
    # TypeError for a lone surrogate (a "\udxxx" JSON escape), which ended in a 500.
    hf = HFTokenizer(_word_dir(tmp_path, {}))
    assert hf.encode("hi") == [1]
    for tok in (hf, ByteTokenizer()):
        with pytest.raises(UnicodeError):
            tok.encode(text)
