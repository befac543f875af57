"""Per-request sampling parameters, validated at construction (torch-free)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
# top_k at or above the vocabulary keeps every token; the cap keeps it a 32-bit int for the
# sampler's tensors (2**63 overflowed there: one request's step error failed every request in
# flight, a new user's audit)
MAX_TOP_K = 2**31 - 1
MAX_LOGIT_BIAS = 300  # entries per request (OpenAI's limit)
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's range)
MAX_BIAS = 100.0  # |logit_bias value| (OpenAI's range; -100 bans a token)


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    temperature: 0 means greedy; top_p in (0, 1]; top_k 0 means off; seed makes a request's
    sampling reproducible on its own; logprobs asks for that many top alternatives per token
    (None: no logprobs at all, 0: only the sampled token's); ignore_eos keeps generating past the
    model's EOS token (``stop_token_ids`` still apply); speculative=False opts this request out
    of speculative decoding when the engine runs it; speculative_budget pins the tree budget of
    the rounds that carry this request (one of the engine's budgets), bypassing the adaptive
    controller: for checks that must exercise speculation (the gate's speculation probe), since
    the controller may otherwise decode plainly. Output never depends on it (greedy equals plain
    decoding; sampling is lossless), only speed does.

    presence_penalty / frequency_penalty (OpenAI's meaning, -2..2) lower a token's logit by
    ``frequency * count + presence * (count > 0)``, count = its occurrences among the generated
    tokens; logit_bias maps token id (an int, or its decimal string as the OpenAI API sends it)
    to a bias in -100..100 added to its logit, at most 300 entries. Both act on the device before
    temperature / top-k / top-p, in plain and speculative decoding alike, and the reported
    logprobs are those of the processed logits. prompt_logprobs asks for every prompt token's
    logprob (the first is None) with that many alternatives; max_tokens 0 generates nothing
    (useful with prompt_logprobs).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    logprobs: int | None = None
    ignore_eos: bool = False
    speculative: bool = True
    speculative_budget: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check (and normalize: stop as a list, logit_bias keys as ints) every field; a
        ValueError names the field. Run at construction and again by the engine on every request
        it takes: the dataclass is mutable (a temperature set to -1 after construction ran
        silently greedy, a top_k of 2**63 failed the step)."""
        if not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be a bool, got {self.speculative!r}")
        if self.speculative_budget is not None:
            if not _is_int(self.speculative_budget) or self.speculative_budget < 1:
                raise ValueError(f"speculative_budget: expected an int >= 1, got "
                                 f"{self.speculative_budget!r}")  # fmt: skip
            if not self.speculative:
                raise ValueError("speculative_budget: set together with speculative=false")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # lists (or tuples): None, an int or a dict raised a bare TypeError or passed unchecked
        if not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of ints >= 0, got "
                             f"{self.stop_token_ids!r}")  # fmt: skip
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if not _is_real(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got "
                             f"{self.temperature!r}")  # fmt: skip
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be an int in 0..{MAX_TOP_K} (0 = off), got "
                             f"{self.top_k!r}")  # fmt: skip
        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be an int >= 0, got {self.max_tokens!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(
                    f"stop_token_ids must be a list of ints >= 0, got {self.stop_token_ids!r}"
                )
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be None or an int in 0..{MAX_LOGPROBS}, got {self.logprobs!r}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise ValueError(f"{name} must be a number in -2..2, got {v!r}")
            setattr(self, name, float(v))
        self.logit_bias = _token_biases(self.logit_bias)
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"prompt_logprobs must be None or an int in 0..{MAX_LOGPROBS}, "
                f"got {self.prompt_logprobs!r}"
            )

    @property
    def processes_logits(self) -> bool:
        """Whether penalties or logit_bias change this request's logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _token_biases(bias: object) -> dict[int, float]:
    """logit_bias as {token id: bias}; keys may be ints or decimal strings (JSON object keys)."""
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a mapping of token id to bias, got {bias!r}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        tid = key
        if isinstance(key, str) and key.isascii() and key.isdigit():
            tid = int(key)
        if not _is_int(tid) or tid < 0:
            raise ValueError(f"logit_bias: key {key!r} is not a token id (an int >= 0)")
        if tid in out:
            raise ValueError(f"logit_bias: token id {tid} appears twice")
        if not _is_real(value) or not -MAX_BIAS <= value <= MAX_BIAS:
            raise ValueError(f"logit_bias: the bias of token {tid} must be in -100..100, got "
                             f"{value!r}")  # fmt: skip
        out[tid] = float(value)
    return out


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # rejects NaN
