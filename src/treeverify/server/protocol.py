"""OpenAI wire format: request and response models for /v1/completions and /v1/chat/completions.

Field names follow the OpenAI API; ``top_k``, ``speculative`` and ``speculative_budget`` are
extensions (the first two as in SGLang and vLLM). Requests are validated strictly (a string is not
an int) so a bad field is a 400 naming it, never a surprise deep in the engine. Unknown fields are
a 400 naming them, as OpenAI answers; known OpenAI fields the server does not implement are
declared in unsupported.py and refused there.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from treeverify.engine.sampling_params import MAX_TOP_K
from treeverify.server.unsupported import ChatUnsupported, CompletionUnsupported, StopBounds

MAX_LOGPROBS = 20  # as engine.sampling_params.MAX_LOGPROBS
MAX_N = 16
MAX_SEED = 2**40  # the sampler folds the seed into a 64-bit generator seed

TokenId = Annotated[int, Field(ge=0)]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request, StopBounds):
    """Fields shared by completions and chat requests."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(default=None, ge=0, description="0: only with echo")
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1, le=MAX_TOP_K, description="extension; 0 or -1: off")
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, ignored
    speculative: bool = Field(
        default=True,
        description="extension: false opts this request out of speculative decoding when the "
        "server runs it (--speculative-algorithm)",
    )
    speculative_budget: int | None = Field(
        default=None,
        description="extension: pin the tree budget of this request's rounds to one of the "
        "server's budgets (/server_info speculative.adaptive.buckets, or its budget), bypassing "
        "the adaptive controller; output does not depend on it, only speed",
    )
    ignore_eos: bool = Field(default=False, description="extension (SGLang/vLLM)")
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(
        default=None, description="token id (as a string) -> bias in -100..100, at most 300"
    )


class CompletionRequest(_SamplingFields, CompletionUnsupported):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False


class ContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # None: an assistant turn only (OpenAI's rule); checked when absent too (validate_default)
    content: str | list[ContentPart] | None = Field(default=None, validate_default=True)
    # a participant's name: handed to the chat template where it has a place for one (else a
    # 400 naming it: serving.chat_prompt; nothing is dropped unsaid)
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content_unless_assistant(cls, v: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if v is None and role is not None and role != "assistant":
            raise ValueError(f"required for a {role!r} message")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields, ChatUnsupported):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


# ---- responses ---------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_ids: list[int] = Field(
        default_factory=list, description="extension: the chosen token id of each position"
    )
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: echo's first
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(BaseModel):
    """A streamed completions event (same object name as the full response, as OpenAI does)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "treeverify"
    root: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(message: str, status: int, param: str | None = None, kind: str | None = None):
    """The OpenAI error object as a dict."""
    if kind is None:
        kind = {
            400: "invalid_request_error",
            404: "not_found_error",
            503: "service_unavailable",
        }.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def chunk_json(obj: BaseModel) -> str:
    """One SSE event for a chunk model."""
    return f"data: {obj.model_dump_json()}\n\n"


def sse(data: dict[str, Any] | str) -> str:
    import json

    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
