"""Tokenizers: the built-in byte-level one (tiny models) and a Hugging Face `tokenizer.json` one.

Both expose encode / decode / apply_chat_template / token_bytes and the special ids the engine
needs. A chat template (Jinja) comes from, in order: ``chat_template`` set by the caller (serve's
--chat-template), ``chat_template.jinja`` beside the tokenizer (transformers >= 4.43 saves it
there), tokenizer_config.json's ``chat_template``; the byte tokenizer has a built-in format.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

Message = dict[str, str]
TEMPLATE_FILE = "chat_template.jinja"


def render_chat_template(
    template: str,
    messages: list[Message],
    add_generation_prompt: bool,
    bos_token: str = "",
    eos_token: str = "",
) -> str:
    """Render a Hugging Face style Jinja chat template (ValueError for raise_exception)."""
    try:
        import jinja2
    except ImportError as exc:
        raise RuntimeError("tokenizer: rendering the chat template needs 'jinja2'") from exc
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(msg):
        raise ValueError(f"chat template: {msg}")

    env.globals["raise_exception"] = raise_exception
    try:
        compiled = env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat template: syntax error line {exc.lineno}: {exc.message}") from exc
    return compiled.render(
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
    )


@functools.cache
def _gpt2_byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet: printable stand-in character -> the byte it encodes."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class ByteTokenizer:
    """ids 0..255 are the UTF-8 bytes; BOS, EOS, PAD follow (256, 257, 258)."""

    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    vocab_size = 259
    _specials = {256: "<|bos|>", 257: "<|eos|>", 258: "<|pad|>"}
    chat_template: str | None = None  # None: the built-in '<|role|>' format

    def token_bytes(self, tid: int) -> bytes:
        """The bytes token ``tid`` stands for (a special token: its name's UTF-8)."""
        return bytes([tid]) if tid < 256 else self._specials[tid].encode()

    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for (a bound: the server refuses
        text too long for the context before encoding it)."""
        return max(1, *(len(s) for s in self._specials.values()))

    @property
    def eos_token_ids(self) -> list[int]:
        return [self.eos_token_id]

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out, buf = [], bytearray()
        for i in ids:
            i = int(i)
            if i < 256:
                buf.append(i)
                continue
            if i not in self._specials:
                raise ValueError(f"ids: {i} is outside the byte tokenizer's vocab (0..258)")
            if not skip_special_tokens:
                out.append(buf.decode("utf-8", errors="replace"))
                out.append(self._specials[i])
                buf = bytearray()
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True):
        """'<|role|>\\ncontent\\n' per message, then '<|assistant|>\\n' to prompt a reply."""
        if self.chat_template:
            return render_chat_template(
                self.chat_template,
                messages,
                add_generation_prompt,
                self._specials[self.bos_token_id],
                self._specials[self.eos_token_id],
            )
        parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
        if add_generation_prompt:
            parts.append("<|assistant|>\n")
        return "".join(parts)


def _default_template(value: Any) -> str | None:
    """tokenizer_config's chat_template: a string, or named templates (the 'default' one)."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default")
    return value


def _token_content(v: Any) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v


class HFTokenizer:
    """tokenizer.json through `tokenizers`; specials, chat template: tokenizer_config.json
    (or `from_tokenizer`: a built `tokenizers.Tokenizer` and its specials)."""

    def __init__(self, directory: str | Path, eos_token_ids: list[int] | None = None):
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer: {path} not found (a tokenizer.json is required)")
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise RuntimeError("tokenizer: the 'tokenizers' package is required") from exc
        cfg_path = directory / "tokenizer_config.json"
        tcfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        jinja_file = directory / TEMPLATE_FILE  # transformers >= 4.43 keeps it beside the tokenizer
        if jinja_file.is_file():
            template: str | None = jinja_file.read_text(encoding="utf-8")
        else:
            template = _default_template(tcfg.get("chat_template"))
        self._setup(
            Tokenizer.from_file(str(path)),
            chat_template=template,
            bos_token=_token_content(tcfg.get("bos_token")),
            eos_token=_token_content(tcfg.get("eos_token")),
            pad_token=_token_content(tcfg.get("pad_token")),
            add_bos=bool(tcfg.get("add_bos_token", False)),
            eos_token_ids=eos_token_ids,
        )

    @classmethod
    def from_tokenizer(cls, tok, *, chat_template: str | None, bos_token: str | None,
                       eos_token: str | None, pad_token: str | None, add_bos: bool,
                       eos_token_ids: list[int] | None = None) -> HFTokenizer:  # fmt: skip
        """From a built `tokenizers.Tokenizer` and its specials (e.g. a GGUF file's metadata)."""
        self = cls.__new__(cls)
        self._setup(tok, chat_template=_default_template(chat_template), bos_token=bos_token,
                    eos_token=eos_token, pad_token=pad_token, add_bos=add_bos,
                    eos_token_ids=eos_token_ids)  # fmt: skip
        return self

    def _setup(self, tok, *, chat_template, bos_token, eos_token, pad_token, add_bos,
               eos_token_ids) -> None:  # fmt: skip
        self._tok = tok
        self._byte_level = _is_byte_level(tok)
        self.chat_template: str | None = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = self._id(self.bos_token)
        self.eos_token_id = self._id(self.eos_token)
        pad = self._id(pad_token)
        self.pad_token_id = pad if pad is not None else self.eos_token_id
        self.add_bos = add_bos
        ids = list(eos_token_ids or [])
        if self.eos_token_id is not None and self.eos_token_id not in ids:
            ids.append(self.eos_token_id)
        self.eos_token_ids = ids

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for, from its longest piece (a
        byte-level piece has one character per byte, a SentencePiece one per character, added
        tokens their text): a bound, so the server refuses text too long for the context
        before encoding it."""
        return max(1, *(len(p) for p in self._tok.get_vocab(with_added_tokens=True)))

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        # UnicodeEncodeError for a lone surrogate, as the byte tokenizer raises (`tokenizers`
        # raises TypeError for it: callers that map UnicodeError to a 400 answered a 500)
        text.encode("utf-8")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, tid: int) -> bytes:
        """The bytes token ``tid`` stands for: byte-level BPE's alphabet undone, SentencePiece's
        '<0xNN>' and '\u2581' read; otherwise its decoded text's UTF-8."""
        piece = self._tok.id_to_token(int(tid))
        if piece is None:
            return b""
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        if self._byte_level:
            table = _gpt2_byte_decoder()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
        if "\u2581" in piece:
            return piece.replace("\u2581", " ").encode()
        return self.decode([tid], skip_special_tokens=False).encode()

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True):
        if not self.chat_template:
            raise ValueError(
                "tokenizer: no chat template (no chat_template.jinja beside tokenizer.json, no "
                "'chat_template' in tokenizer_config.json); start the server with "
                "--chat-template FILE"
            )
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt,
            self.bos_token or "",
            self.eos_token or "",
        )


def _is_byte_level(tok: Any) -> bool:
    """Whether a `tokenizers` Tokenizer decodes with byte-level BPE (GPT-2, Llama 3, Qwen)."""
    return tok.decoder is not None and "ByteLevel" in repr(tok.decoder)
