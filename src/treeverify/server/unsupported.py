"""Request fields the server refuses rather than ignores, and the bounds on ``stop``.

OpenAI fields this server does not implement are declared here so that a request using them gets
a 400 naming the field (the request models forbid unknown fields too). A field is accepted only at
the value that asks for nothing (``best_of`` 1, no ``suffix``, no tools, ``response_format`` text).
Mixed into the request models of protocol.py.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, field_validator

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # per stop string; the stop window is this plus the new text per step


def _refuse(field: str, why: str) -> ValueError:
    return ValueError(f"{field} {why} is not supported by this server")


class StopBounds(BaseModel):
    """``stop``: at most MAX_STOP_STRINGS non-empty strings of at most MAX_STOP_CHARS each."""

    @field_validator("stop", check_fields=False)
    @classmethod
    def _bounded_stop(cls, v: str | list[str] | None):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        for s in stops:
            if not s:
                raise ValueError("stop strings must not be empty")
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"each stop string has at most {MAX_STOP_CHARS} characters, "
                                 f"got one of {len(s)}")  # fmt: skip
            try:  # as prompts are: a lone surrogate ("\ud800") is no text and never matches
                s.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"stop strings must be encodable text ({exc})") from exc
        return v


class CompletionUnsupported(BaseModel):
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None):
        if v is not None and v != 1:
            raise _refuse("best_of", f"= {v} (server-side best-of-n)")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v: str | None):
        if v:
            raise _refuse("suffix", "(insertion / fill-in-the-middle)")
        return v


class ChatUnsupported(BaseModel):
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, v: list[Any] | None, info):
        if v:
            raise _refuse(info.field_name, "(tool / function calling)")
        return v

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_choice(cls, v: Any, info):
        if v is not None and v != "none":
            raise ValueError(  # (the error names the field already)
                "only 'none' is accepted: tool / function calling is not supported by this server"
            )
        return v

    @field_validator("parallel_tool_calls")
    @classmethod
    def _no_parallel(cls, v: bool | None):
        if v is not None:
            raise _refuse("parallel_tool_calls", "(tool calling)")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: dict[str, Any] | None):
        if v is not None and v != {"type": "text"}:
            raise _refuse("response_format", f"{v.get('type')!r} (only {{'type': 'text'}})")
        return v
