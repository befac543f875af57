"""Tokenizers: the built-in byte-level one (tiny models) and a Hugging Face `tokenizer.json` one.

Both expose encode / decode / apply_chat_template and the special ids the engine needs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

Message = dict[str, str]


class ByteTokenizer:
    """ids 0..255 are the UTF-8 bytes; BOS, EOS, PAD follow (256, 257, 258)."""

    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    vocab_size = 259
    _specials = {256: "<|bos|>", 257: "<|eos|>", 258: "<|pad|>"}

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
        parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
        if add_generation_prompt:
            parts.append("<|assistant|>\n")
        return "".join(parts)


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
        self._setup(
            Tokenizer.from_file(str(path)),
            chat_template=tcfg.get("chat_template"),
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
        self._setup(tok, chat_template=chat_template, bos_token=bos_token, eos_token=eos_token,
                    pad_token=pad_token, add_bos=add_bos, eos_token_ids=eos_token_ids)  # fmt: skip
        return self

    def _setup(self, tok, *, chat_template, bos_token, eos_token, pad_token, add_bos,
               eos_token_ids) -> None:  # fmt: skip
        self._tok = tok
        self.chat_template = chat_template
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

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True):
        if not self.chat_template:
            raise ValueError("tokenizer: tokenizer_config.json has no 'chat_template'")
        try:
            import jinja2
        except ImportError as exc:
            raise RuntimeError("tokenizer: rendering the chat template needs 'jinja2'") from exc
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(msg):
            raise ValueError(f"chat template: {msg}")

        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
