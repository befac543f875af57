"""Model configs: the Llama family (Llama 3, Qwen2, Qwen3) and the DeepSeek-V3 family (Kimi K2).

`from_hf_dict` reads a Hugging Face `config.json` dict (both the classic `rope_theta` +
`rope_scaling` keys and transformers>=5's `rope_parameters`); a missing required key is a
ValueError that names it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
LLAMA_MODEL_TYPES = ("llama", "qwen2", "qwen3")
DEEPSEEK_MODEL_TYPES = ("deepseek_v3", "kimi_k2")


def _require(d: dict[str, Any], key: str, where: str) -> Any:
    if key not in d or d[key] is None:
        raise ValueError(f"{where}: config is missing the required key {key!r}")
    return d[key]


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1)."""
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass
class RopeConfig:
    """Rotary embedding: base frequency and the scaling scheme (`type`) with its parameters."""

    theta: float = 10000.0
    type: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn (DeepSeek)
    mscale_all_dim: float | None = None  # yarn (DeepSeek)
    attention_factor: float | None = None  # yarn: explicit cos/sin scale
    truncate: bool = True  # yarn: floor/ceil the correction range

    def __post_init__(self):
        if self.type not in ROPE_TYPES:
            raise ValueError(
                f"rope type: expected one of {', '.join(ROPE_TYPES)}, got {self.type!r}"
            )
        if self.theta <= 0:
            raise ValueError(f"rope theta: expected > 0, got {self.theta}")
        if self.type in ("llama3", "yarn") and self.original_max_position_embeddings is None:
            raise ValueError(f"rope type {self.type!r} needs 'original_max_position_embeddings'")

    def yarn_cos_sin_factor(self) -> float:
        """The factor YaRN multiplies cos/sin by (1.0 for other types)."""
        if self.type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_get_mscale(self.factor)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], where: str) -> RopeConfig:
        params = d.get("rope_parameters")
        if isinstance(params, dict) and "rope_theta" in params:
            theta = params["rope_theta"]
            scaling = params
        else:
            theta = d.get("rope_theta", 10000.0)
            scaling = d.get("rope_scaling") or {}
        rtype = scaling.get("rope_type") or scaling.get("type") or "default"
        if rtype not in ROPE_TYPES:
            raise ValueError(f"{where}: unsupported rope scaling type {rtype!r}")
        factor = scaling.get("factor")
        orig = scaling.get("original_max_position_embeddings")
        if rtype == "yarn" and factor is None:
            max_pos = _require(d, "max_position_embeddings", where)
            factor = max_pos / _require(scaling, "original_max_position_embeddings", where)
        if rtype in ("llama3", "yarn") and orig is None:
            raise ValueError(
                f"{where}: rope scaling {rtype!r} is missing 'original_max_position_embeddings'"
            )
        if rtype != "default" and factor is None:
            raise ValueError(f"{where}: rope scaling {rtype!r} is missing 'factor'")
        return cls(
            theta=float(theta),
            type=rtype,
            factor=float(factor if factor is not None else 1.0),
            original_max_position_embeddings=orig,
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            beta_fast=float(scaling.get("beta_fast") or 32.0),
            beta_slow=float(scaling.get("beta_slow") or 1.0),
            mscale=scaling.get("mscale"),
            mscale_all_dim=scaling.get("mscale_all_dim"),
            attention_factor=scaling.get("attention_factor"),
            truncate=bool(scaling.get("truncate", True)),
        )


def _eos_list(v: Any) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in v] if isinstance(v, (list, tuple)) else [int(v)]


def _check_act(d: dict[str, Any], where: str) -> None:
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}: hidden_act {act!r} is not supported (only 'silu')")


@dataclass
class LlamaConfig:
    """Llama 3 / Qwen2 / Qwen3: GQA attention, RoPE, SwiGLU MLP, RMSNorm."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    qkv_bias: bool = False  # Qwen2 (always), Llama/Qwen3 attention_bias
    o_bias: bool = False  # Llama/Qwen3 attention_bias
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    model_type: str = "llama"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "intermediate_size"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim: expected even (RoPE), got {self.head_dim}")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        mt = d.get("model_type", "llama")
        where = f"LlamaConfig ({mt})"
        if mt not in LLAMA_MODEL_TYPES:
            raise ValueError(f"{where}: model_type {mt!r} is not one of {LLAMA_MODEL_TYPES}")
        _check_act(d, where)
        if d.get("use_sliding_window"):
            raise ValueError(f"{where}: use_sliding_window=true is not supported")
        hidden = int(_require(d, "hidden_size", where))
        heads = int(_require(d, "num_attention_heads", where))
        bias = bool(d.get("attention_bias", False))
        return cls(
            vocab_size=int(_require(d, "vocab_size", where)),
            hidden_size=hidden,
            num_hidden_layers=int(_require(d, "num_hidden_layers", where)),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            intermediate_size=int(_require(d, "intermediate_size", where)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf_dict(d, where),
            qk_norm=mt == "qwen3",
            qkv_bias=True if mt == "qwen2" else bias,
            o_bias=False if mt == "qwen2" else bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_eos_list(d.get("eos_token_id")),
            model_type=mt,
        )


@dataclass
class DeepseekV3Config:
    """DeepSeek-V3 / Kimi K2: MLA attention, MoE (shared + routed experts), first-k dense layers."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int  # dense layers' MLP
    q_lora_rank: int | None  # None: q_proj directly (DeepSeek-V2-Lite style)
    kv_lora_rank: int  # 512 in V3/K2
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # 64 in V3/K2
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int = 1
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    routed_scaling_factor: float = 1.0
    scoring_func: str = "sigmoid"  # sigmoid | softmax
    topk_method: str = "noaux_tc"  # noaux_tc | greedy | group_limited_greedy
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    rope_interleave: bool = True  # DeepSeek checkpoints pair rope dims (2i, 2i+1)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    model_type: str = "deepseek_v3"

    def __post_init__(self):
        if self.scoring_func not in ("sigmoid", "softmax"):
            raise ValueError(
                f"scoring_func: expected sigmoid or softmax, got {self.scoring_func!r}"
            )
        if self.topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
            raise ValueError(f"topk_method: unsupported {self.topk_method!r}")
        if self.n_routed_experts % self.n_group:
            raise ValueError(
                f"n_routed_experts ({self.n_routed_experts}) must be a multiple of n_group "
                f"({self.n_group})"
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(
                f"topk_group: expected 1..n_group={self.n_group}, got {self.topk_group}"
            )
        per_group = self.n_routed_experts // self.n_group
        if self.num_experts_per_tok > self.topk_group * per_group:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts in "
                f"topk_group={self.topk_group} groups ({self.topk_group * per_group})"
            )
        if self.topk_method == "noaux_tc" and per_group < 2 and self.n_group > 1:
            raise ValueError("noaux_tc group scores take the top-2 experts per group: need >= 2")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim: expected even, got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def sm_scale(self) -> float:
        """Softmax scale: 1/sqrt(qk_nope + qk_rope), times mscale(factor, mscale_all_dim)^2 under
        YaRN (DeepSeek's definition; equal in the naive and the absorbed form)."""
        scale = self.qk_head_dim**-0.5
        if self.rope.type == "yarn" and self.rope.mscale_all_dim:
            m = yarn_get_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> DeepseekV3Config:
        mt = d.get("model_type", "deepseek_v3")
        where = f"DeepseekV3Config ({mt})"
        if mt not in DEEPSEEK_MODEL_TYPES:
            raise ValueError(f"{where}: model_type {mt!r} is not one of {DEEPSEEK_MODEL_TYPES}")
        _check_act(d, where)
        if d.get("attention_bias"):
            raise ValueError(f"{where}: attention_bias=true is not supported")

        def req(k):
            return _require(d, k, where)

        return cls(
            vocab_size=int(req("vocab_size")),
            hidden_size=int(req("hidden_size")),
            num_hidden_layers=int(req("num_hidden_layers")),
            num_attention_heads=int(req("num_attention_heads")),
            intermediate_size=int(req("intermediate_size")),
            q_lora_rank=d.get("q_lora_rank"),
            kv_lora_rank=int(req("kv_lora_rank")),
            qk_nope_head_dim=int(req("qk_nope_head_dim")),
            qk_rope_head_dim=int(req("qk_rope_head_dim")),
            v_head_dim=int(req("v_head_dim")),
            n_routed_experts=int(req("n_routed_experts")),
            num_experts_per_tok=int(req("num_experts_per_tok")),
            moe_intermediate_size=int(req("moe_intermediate_size")),
            n_shared_experts=int(d.get("n_shared_experts") or 0),
            first_k_dense_replace=int(d.get("first_k_dense_replace", 0)),
            moe_layer_freq=int(d.get("moe_layer_freq", 1)),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            scoring_func=d.get("scoring_func", "sigmoid"),
            topk_method=d.get("topk_method", "noaux_tc"),
            n_group=int(d.get("n_group") or 1),
            topk_group=int(d.get("topk_group") or 1),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf_dict(d, where),
            rope_interleave=bool(d.get("rope_interleave", True)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_eos_list(d.get("eos_token_id")),
            model_type=mt,
        )


ModelConfig = LlamaConfig | DeepseekV3Config


def config_from_hf_dict(d: dict[str, Any]) -> ModelConfig:
    """The config class for `d["model_type"]` (Kimi K2's "kimi_k2" is DeepSeek-V3)."""
    mt = d.get("model_type")
    if mt is None:
        raise ValueError("config: missing the required key 'model_type'")
    if mt in LLAMA_MODEL_TYPES:
        return LlamaConfig.from_hf_dict(d)
    if mt in DEEPSEEK_MODEL_TYPES:
        return DeepseekV3Config.from_hf_dict(d)
    raise ValueError(
        f"config: model_type {mt!r} is not supported "
        f"(expected one of {LLAMA_MODEL_TYPES + DEEPSEEK_MODEL_TYPES})"
    )
