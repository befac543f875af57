"""DFlash drafter configuration: the published config.json, parsed and written back.

Keys may sit in `dflash_config` or at the top level (exports differ); a missing key is a
ValueError that names it; variants with different math (DFlash2, sliding or causal layers,
attention sinks, ...) are refused. See docs/dflash.md for the format facts and the choices made.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from treeverify.models.config import RopeConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
ARCHITECTURE = "DFlashDraftModel"
_WHERE = "dflash config"


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The published fallback when a config names no target layers: one per draft layer, spread
    evenly over target layers 1 .. num_target_layers - 3 (a single draft layer takes the middle)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    first, last = 1, num_target_layers - 3
    return [
        int(round(first + i * (last - first) / (num_draft_layers - 1)))
        for i in range(num_draft_layers)
    ]


def _lookup(d: dict[str, Any], key: str) -> Any:
    """A DFlash key: the nested "dflash_config" first, then the top level (both layouts exist)."""
    nested = d.get("dflash_config")
    if isinstance(nested, dict) and nested.get(key) is not None:
        return nested[key]
    return d.get(key)


def _require(d: dict[str, Any], key: str) -> Any:
    value = _lookup(d, key)
    if value is None:
        raise ValueError(f"{_WHERE}: config is missing the required key {key!r}")
    return value


def _reject_variants(d: dict[str, Any]) -> None:
    """DFlash relatives with other math (DFlash2, sliding windows, causal blocks...) are refused."""
    archs = d.get("architectures")
    if archs and not any(str(a).endswith(ARCHITECTURE) for a in archs):
        raise ValueError(
            f"{_WHERE}: 'architectures' {archs} names no {ARCHITECTURE} (only DFlash v1 drafters "
            "are supported)"
        )
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{_WHERE}: 'hidden_act' {act!r} is not supported (only 'silu')")
    layer_types = d.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ValueError(f"{_WHERE}: 'layer_types' {layer_types}: only full_attention is supported")
    for key in ("use_sliding_window", "is_causal", "use_swa", "attention_sink_bias"):
        if _lookup(d, key):
            raise ValueError(f"{_WHERE}: {key!r} is set; this drafter variant is not supported")
    for key in ("conv_kernel_size", "selector_rank", "markov_rank", "kv_lora_rank"):
        if _lookup(d, key):
            raise ValueError(f"{_WHERE}: {key!r} is set; this drafter variant is not supported")
    projector = _lookup(d, "projector_type")
    if projector not in (None, "dflash"):
        raise ValueError(f"{_WHERE}: 'projector_type' {projector!r} is not supported")
    partial = d.get("partial_rotary_factor")
    if partial not in (None, 1, 1.0):
        raise ValueError(f"{_WHERE}: 'partial_rotary_factor' {partial} is not supported (only 1)")


@dataclass
class DFlashConfig:
    """A DFlash drafter: Qwen3-style layers of width `hidden_size` (= the target's hidden size)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    vocab_size: int | None = None  # the target's; checked against its lm_head when given
    num_target_layers: int | None = None
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    attention_bias: bool = False
    input_embedding_scale: float = 1.0  # block embeddings are multiplied by this
    output_multiplier: float = 1.0  # logits are multiplied by this
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)

    def __post_init__(self):
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "intermediate_size"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads: {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim: expected even (rotary pairs), got {self.head_dim}")
        if self.block_size < 2:
            raise ValueError(f"block_size: expected >= 2, got {self.block_size}")
        if self.mask_token_id < 0:
            raise ValueError(f"mask_token_id: expected >= 0, got {self.mask_token_id}")
        ids = self.target_layer_ids
        if not ids or min(ids) < 0 or list(ids) != sorted(set(ids)):
            # increasing: the target hands its tapped layers over in layer order
            raise ValueError(
                f"target_layer_ids: expected a non-empty increasing list of layer indices >= 0, "
                f"got {ids}"
            )

    @property
    def context_features(self) -> int:
        """Width of one context row as the target hands it over: len(target_layer_ids) * H."""
        return len(self.target_layer_ids) * self.hidden_size

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> DFlashConfig:
        """Parse a published DFlash config.json dict; a missing key is a ValueError naming it."""
        _reject_variants(d)
        hidden = int(_require(d, "hidden_size"))
        layers = int(_require(d, "num_hidden_layers"))
        heads = int(_require(d, "num_attention_heads"))
        kv_heads = _lookup(d, "num_key_value_heads")
        head_dim = _lookup(d, "head_dim")
        num_target_layers = _lookup(d, "num_target_layers")
        ids = _lookup(d, "target_layer_ids")
        if ids is None:
            if num_target_layers is None:
                raise ValueError(
                    f"{_WHERE}: config is missing the required key 'target_layer_ids' (or "
                    "'num_target_layers' to derive it from)"
                )
            ids = default_target_layer_ids(int(num_target_layers), layers)
        softcap = _lookup(d, "final_logit_softcapping")
        vocab = d.get("vocab_size")
        return cls(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(kv_heads) if kv_heads is not None else heads,
            head_dim=int(head_dim) if head_dim is not None else hidden // heads,
            intermediate_size=int(_require(d, "intermediate_size")),
            block_size=int(_require(d, "block_size")),
            mask_token_id=int(_require(d, "mask_token_id")),
            target_layer_ids=[int(i) for i in ids],
            vocab_size=int(vocab) if vocab is not None else None,
            num_target_layers=int(num_target_layers) if num_target_layers is not None else None,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf_dict(d, _WHERE),
            attention_bias=bool(d.get("attention_bias", False)),
            input_embedding_scale=float(_lookup(d, "input_embedding_scale") or 1.0),
            output_multiplier=float(_lookup(d, "output_multiplier") or 1.0),
            final_logit_softcapping=float(softcap) if softcap else None,
        )

    def to_hf_dict(self, dtype: torch.dtype | None = None) -> dict[str, Any]:
        """The published config.json layout (DFlash keys under "dflash_config")."""
        dflash: dict[str, Any] = {
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
        }
        if self.input_embedding_scale != 1.0:
            dflash["input_embedding_scale"] = self.input_embedding_scale
        if self.output_multiplier != 1.0:
            dflash["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping:
            dflash["final_logit_softcapping"] = self.final_logit_softcapping
        out: dict[str, Any] = {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "attention_bias": self.attention_bias,
            "block_size": self.block_size,
            "dflash_config": dflash,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope.theta,
            "rope_scaling": _rope_scaling_dict(self.rope),
            "tie_word_embeddings": False,
            "use_sliding_window": False,
        }
        if self.num_target_layers is not None:
            out["num_target_layers"] = self.num_target_layers
        if self.vocab_size is not None:
            out["vocab_size"] = self.vocab_size
        if dtype is not None:
            out["dtype"] = str(dtype).removeprefix("torch.")
        return out


def _rope_scaling_dict(rope: RopeConfig) -> dict[str, Any] | None:
    """RopeConfig back to the Hugging Face "rope_scaling" dict (None for plain RoPE)."""
    if rope.type == "default":
        return None
    out: dict[str, Any] = {"rope_type": rope.type, "factor": rope.factor}
    if rope.original_max_position_embeddings is not None:
        out["original_max_position_embeddings"] = rope.original_max_position_embeddings
    if rope.type == "llama3":
        out["low_freq_factor"] = rope.low_freq_factor
        out["high_freq_factor"] = rope.high_freq_factor
    if rope.type == "yarn":
        out["beta_fast"] = rope.beta_fast
        out["beta_slow"] = rope.beta_slow
        out["truncate"] = rope.truncate
        for key in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(rope, key) is not None:
                out[key] = getattr(rope, key)
    return out
