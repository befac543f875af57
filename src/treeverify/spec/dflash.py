"""DFlash: a block-diffusion drafter conditioned on the target's hidden states.

One call drafts a whole block in a single forward pass:

1. Context. For the committed tokens the target has already run, the hidden states at the
   configured target layers (`target_layer_ids`; the output of each of those decoder layers) are
   concatenated along features, (C, n_layers * H_target), and projected by `fc` then RMSNorm
   `hidden_norm` to the drafter's width: one context row per committed token.
2. Block. `[last committed token, MASK x (block_size - 1)]` embedded with the TARGET's embedding
   table (the drafter has none of its own). The last committed token is the bonus token of the
   previous round: the target has sampled it but not run it, so it has no hidden state yet.
3. Layers. Qwen3-style decoder layers (RMSNorm, GQA attention with per-head q/k RMSNorm and
   rotary embeddings, SwiGLU MLP). Queries come from the block only; keys and values from
   [context rows; block rows], both through the same k_proj / v_proj of the layer. The context rows
   are the projected features of step 1 at every layer (they are not updated layer to layer) and
   do not pass through the layer's input norm. Attention is NOT causal: every block position sees
   the whole context and the whole block. Positions: context rows at p0 .. p0+c-1, the block at
   p0+c .. p0+c+block_size-1 (RoPE depends on position differences only, so p0 = 0 gives the
   same result as the absolute positions the reference uses, up to float rounding).
4. Output. Final RMSNorm, then the TARGET's lm_head on block positions 1 .. L: position i predicts
   the token i places after the last committed one, so L = block_size - 1 next-token distributions
   come out of one pass, the per-depth q_1 .. q_L that DDTree builds its tree from.

`propose` runs this for a batch of sequences whose contexts have different lengths (left-aligned,
padded): padded context rows are zeroed and masked out of attention, there is no host sync and no
data-dependent shape, so it can be captured in a CUDA graph.

Module and parameter names are the published checkpoint's ("fc.weight", "hidden_norm.weight",
"layers.N.self_attn.q_proj.weight", ..., "norm.weight"), so loading is a direct state-dict copy.
See docs/dflash.md for the checkpoint format and the choices made where it was ambiguous.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from treeverify.models.config import LlamaConfig, RopeConfig
from treeverify.models.layers import MLP, RMSNorm, Rope, apply_rope, rope_inv_freq

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
        if not self.target_layer_ids or min(self.target_layer_ids) < 0:
            raise ValueError(
                f"target_layer_ids: expected a non-empty list of layer indices >= 0, got "
                f"{self.target_layer_ids}"
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


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------


class DFlashAttention(nn.Module):
    """Block queries over [context rows; block rows] keys/values, non-causal, GQA."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.sm_scale = self.d**-0.5
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.hq * self.d, bias=bias)
        self.k_proj = nn.Linear(h, self.hkv * self.d, bias=bias)
        self.v_proj = nn.Linear(h, self.hkv * self.d, bias=bias)
        self.o_proj = nn.Linear(self.hq * self.d, h, bias=bias)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # (B, T, H) the block, after the layer's input norm
        ctx: torch.Tensor,  # (B, C, H) projected context rows
        cos: torch.Tensor,  # (B, C + T, D/2) rotary cos for keys [context; block]
        sin: torch.Tensor,  # (B, C + T, D/2)
        bias: torch.Tensor,  # (B, 1, 1, C + T) fp32: 0 for visible keys, -inf for padding
    ) -> torch.Tensor:  # (B, T, H)
        b, t, _ = x.shape
        s = ctx.shape[1] + t
        g = self.hq // self.hkv
        kv_in = torch.cat([ctx, x], dim=1)  # (B, S, H)
        q = self.q_norm(self.q_proj(x).view(b, t, self.hq, self.d))  # (B, T, Hq, D)
        k = self.k_norm(self.k_proj(kv_in).view(b, s, self.hkv, self.d))  # (B, S, Hkv, D)
        v = self.v_proj(kv_in).view(b, s, self.hkv, self.d)  # (B, S, Hkv, D)
        cos_k, sin_k = cos.reshape(b * s, -1), sin.reshape(b * s, -1)  # (B*S, D/2) keys
        cos_q = cos[:, s - t :].reshape(b * t, -1)  # (B*T, D/2) queries: the block rows
        sin_q = sin[:, s - t :].reshape(b * t, -1)  # (B*T, D/2)
        q = apply_rope(q.reshape(b * t, self.hq, self.d), cos_q, sin_q)  # (B*T, Hq, D)
        k = apply_rope(k.reshape(b * s, self.hkv, self.d), cos_k, sin_k)  # (B*S, Hkv, D)
        # Query head h reads KV head h // g: group the g query heads of a KV head together.
        qg = q.view(b, t, self.hkv, g, self.d).permute(0, 2, 3, 1, 4)  # (B, Hkv, g, T, D)
        qg = qg.reshape(b, self.hkv, g * t, self.d).float()  # (B, Hkv, g*T, D)
        kg = k.view(b, s, self.hkv, self.d).transpose(1, 2).float()  # (B, Hkv, S, D)
        vg = v.transpose(1, 2).float()  # (B, Hkv, S, D)
        scores = torch.matmul(qg, kg.transpose(-1, -2)) * self.sm_scale + bias  # (B, Hkv, g*T, S)
        o = torch.matmul(scores.softmax(dim=-1), vg)  # (B, Hkv, g*T, D)
        o = o.view(b, self.hkv, g, t, self.d).permute(0, 3, 1, 2, 4)  # (B, T, Hkv, g, D)
        return self.o_proj(o.reshape(b, t, self.hq * self.d).to(x.dtype))  # (B, T, H)


class DFlashDecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, ctx, cos, sin, bias):  # x (B, T, H) -> (B, T, H)
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, bias)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """The DFlash drafter; borrows the target's embedding table and lm_head (not its own params).

    Attributes the engine reads: `target_layer_ids` (which target decoder layers' outputs it needs,
    concatenated in this order), `block_size`, `mask_token_id`, `config`.
    """

    def __init__(
        self,
        cfg: DFlashConfig,
        target_embed: nn.Embedding | None = None,
        target_lm_head: nn.Linear | None = None,
    ):
        super().__init__()
        self.config = cfg
        self.target_layer_ids: list[int] = list(cfg.target_layer_ids)
        self.block_size: int = cfg.block_size
        self.mask_token_id: int = cfg.mask_token_id
        self.layers = nn.ModuleList(DFlashDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(cfg.context_features, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = Rope(cfg.rope, cfg.head_dim)  # inv_freq: a non-persistent fp32 buffer
        # A plain tuple, not submodules: the target owns these, and they must stay out of this
        # module's state_dict (the published checkpoint has neither).
        self._target: tuple[nn.Embedding, nn.Linear] | None = None
        if target_embed is not None or target_lm_head is not None:
            if target_embed is None or target_lm_head is None:
                raise ValueError("target_embed/target_lm_head: give both or neither")
            self.attach_target(target_embed, target_lm_head)

    def attach_target(self, target_embed: nn.Embedding, target_lm_head: nn.Linear) -> None:
        """Use the target's embedding table and lm_head (checked against this drafter's config)."""
        cfg = self.config
        if target_embed.embedding_dim != cfg.hidden_size:
            raise ValueError(
                f"target_embed: embedding_dim {target_embed.embedding_dim} != the drafter's "
                f"hidden_size {cfg.hidden_size}"
            )
        if target_lm_head.in_features != cfg.hidden_size:
            raise ValueError(
                f"target_lm_head: in_features {target_lm_head.in_features} != the drafter's "
                f"hidden_size {cfg.hidden_size}"
            )
        if cfg.mask_token_id >= target_embed.num_embeddings:
            raise ValueError(
                f"mask_token_id: {cfg.mask_token_id} is outside the target's embedding table "
                f"({target_embed.num_embeddings} rows)"
            )
        if cfg.vocab_size is not None and target_lm_head.out_features != cfg.vocab_size:
            raise ValueError(
                f"vocab_size: the drafter's config says {cfg.vocab_size}, the target's lm_head "
                f"has {target_lm_head.out_features} outputs"
            )
        self._target = (target_embed, target_lm_head)

    def _apply(self, fn, recurse=True):
        # Keep the rotary inverse frequencies fp32 (and exact) whatever dtype the weights take.
        super()._apply(fn, recurse)
        device = self.rope.inv_freq.device
        self.rope.inv_freq = rope_inv_freq(self.config.rope, self.config.head_dim).to(device)
        return self

    def propose(
        self,
        context_hidden: torch.Tensor,  # (B, C, len(target_layer_ids) * H) left-aligned, padded
        context_lens: torch.Tensor,  # (B,) int: valid context rows per sequence
        last_tokens: torch.Tensor,  # (B,) int64: the last committed token (block position 0)
        depth: int,  # L, 1 <= L <= block_size - 1
        context_start: torch.Tensor | None = None,  # (B,) int: position of context row 0
    ) -> torch.Tensor:  # (B, L, V) fp32 logits for the next L positions
        """Draft logits for the L positions after each sequence's last committed token.

        context_hidden[b, :context_lens[b]] are the target's hidden states (the outputs of the
        decoder layers in `target_layer_ids`, concatenated in that order) of the committed tokens
        just before last_tokens[b]; rows past context_lens[b] are ignored, whatever they hold.
        The full block is always run (the drafter was trained on full blocks); only the first
        `depth` predictions are projected to the vocabulary.
        """
        if self._target is None:
            raise RuntimeError("DFlashDrafter: no target embedding/lm_head; call attach_target()")
        embed, lm_head = self._target
        cfg = self.config
        if context_hidden.dim() != 3 or context_hidden.shape[-1] != cfg.context_features:
            raise ValueError(
                f"context_hidden: expected (B, C, {cfg.context_features}), got "
                f"{tuple(context_hidden.shape)}"
            )
        b, c, _ = context_hidden.shape
        if c < 1:
            raise ValueError("context_hidden: expected at least one context row (C >= 1)")
        if context_lens.shape != (b,) or last_tokens.shape != (b,):
            raise ValueError(
                f"context_lens/last_tokens: expected ({b},) each, got "
                f"{tuple(context_lens.shape)} and {tuple(last_tokens.shape)}"
            )
        if not 1 <= depth <= self.block_size - 1:
            raise ValueError(f"depth: expected 1..{self.block_size - 1}, got {depth}")
        t = self.block_size
        device = context_hidden.device
        dtype = self.fc.weight.dtype

        # Context rows: zero the padding (so nothing it holds reaches the math), project.
        rows = torch.arange(c, device=device)  # (C,)
        lens = context_lens.to(device=device, dtype=torch.long)  # (B,)
        ctx_valid = rows[None, :] < lens[:, None]  # (B, C)
        feats = context_hidden.to(dtype).masked_fill(~ctx_valid[:, :, None], 0.0)  # (B, C, F)
        ctx = self.hidden_norm(self.fc(feats))  # (B, C, H)

        # The block: [last token, MASK x (T-1)] through the target's embedding table.
        masks = torch.full((b, t - 1), self.mask_token_id, dtype=torch.long, device=device)
        ids = torch.cat([last_tokens.to(device=device, dtype=torch.long)[:, None], masks], 1)
        x = embed(ids).to(dtype)  # (B, T, H)
        if cfg.input_embedding_scale != 1.0:
            x = x * cfg.input_embedding_scale

        # Positions: context rows from p0, the block right after each sequence's valid rows.
        if context_start is None:
            p0 = torch.zeros(b, dtype=torch.long, device=device)  # (B,)
        else:
            p0 = context_start.to(device=device, dtype=torch.long)  # (B,)
        ctx_pos = p0[:, None] + rows[None, :]  # (B, C)
        blk_pos = (p0 + lens)[:, None] + torch.arange(t, device=device)[None, :]  # (B, T)
        pos = torch.cat([ctx_pos, blk_pos], dim=1)  # (B, S = C + T)
        cos, sin = self.rope(pos.reshape(-1))  # (B*S, D/2) each
        cos, sin = cos.view(b, c + t, -1), sin.view(b, c + t, -1)  # (B, S, D/2)

        # Keys visible to every block query: the valid context rows and the whole block.
        key_valid = torch.cat([ctx_valid, ctx_valid.new_ones(b, t)], dim=1)  # (B, S)
        bias = torch.zeros(b, 1, 1, c + t, dtype=torch.float32, device=device)
        bias = bias.masked_fill(~key_valid[:, None, None, :], float("-inf"))  # (B, 1, 1, S)

        for layer in self.layers:
            x = layer(x, ctx, cos, sin, bias)  # (B, T, H)
        h = self.norm(x[:, 1 : 1 + depth])  # (B, L, H)
        logits = lm_head(h.to(lm_head.weight.dtype)).float()  # (B, L, V)
        if cfg.output_multiplier != 1.0:
            logits = logits * cfg.output_multiplier
        if cfg.final_logit_softcapping:
            cap = cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits


# ----------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------


def _safetensors():
    try:
        import safetensors.torch as st
        from safetensors import safe_open
    except ImportError as exc:
        raise RuntimeError(
            "dflash: reading/writing *.safetensors needs the 'safetensors' package "
            "(pip install safetensors)"
        ) from exc
    return safe_open, st


def read_dflash_config(directory: str | Path) -> DFlashConfig:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"dflash directory {directory}: {CONFIG_FILE} not found")
    return DFlashConfig.from_hf_dict(json.loads(path.read_text()))


@torch.no_grad()
def load_dflash(
    path: str | Path,
    target_embed: nn.Embedding,
    target_lm_head: nn.Linear,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
) -> DFlashDrafter:
    """A drafter from a local directory: config.json + *.safetensors (published names).

    A missing file is a FileNotFoundError naming it; a missing, unexpected or mis-shaped tensor a
    ValueError naming it. A "model." prefix on tensor names is accepted; "rotary_emb.inv_freq"
    is skipped. Returns the drafter in eval mode, without gradients, attached to the target.
    """
    directory = Path(path)
    cfg = read_dflash_config(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"dflash directory {directory}: no *.safetensors file found")
    safe_open, _ = _safetensors()

    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    model = model.to(dtype=dtype).to_empty(device=device)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    unexpected: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if key.endswith("rotary_emb.inv_freq"):
                    continue
                name = key.removeprefix("model.") if key not in params else key
                if name not in params:
                    unexpected.append(key)
                    continue
                if name in loaded:
                    raise ValueError(f"dflash weights: tensor {key!r} appears twice ({file.name})")
                tensor = f.get_tensor(key)
                if tuple(tensor.shape) != tuple(params[name].shape):
                    raise ValueError(
                        f"dflash weights: tensor {key!r} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(params[name].shape)}"
                    )
                params[name].copy_(tensor.to(dtype))
                loaded.add(name)
    if unexpected:
        raise ValueError(f"dflash weights: unexpected tensors {sorted(unexpected)[:8]}")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"dflash weights: missing tensors {missing[:8]}")
    model.attach_target(target_embed, target_lm_head)
    return model.requires_grad_(False).eval()


def save_dflash(drafter: DFlashDrafter, path: str | Path) -> None:
    """Write config.json + model.safetensors in the published format (what load_dflash reads)."""
    _, st = _safetensors()
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = drafter.fc.weight.dtype
    (directory / CONFIG_FILE).write_text(json.dumps(drafter.config.to_hf_dict(dtype), indent=2))
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in drafter.state_dict().items()}
    st.save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})


def tiny_dflash(
    target_config: LlamaConfig,
    seed: int = 0,
    *,
    target_embed: nn.Embedding | None = None,
    target_lm_head: nn.Linear | None = None,
    block_size: int = 16,
    num_hidden_layers: int = 2,
    target_layer_ids: list[int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> DFlashDrafter:
    """A small seeded random drafter matched to a (tiny) target: its hidden size and vocab.

    GQA 4 query / 2 KV heads of 32; mask token = the target's last vocab id (the byte
    tokenizer's PAD); target layers: the first two of the target's (all of tiny-llama's).
    Weights as models.tiny draws them (same seed, same weights anywhere). In eval mode, on CPU.
    """
    from treeverify.models.tiny import init_random_weights

    n_target = target_config.num_hidden_layers
    cfg = DFlashConfig(
        hidden_size=target_config.hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=2 * target_config.hidden_size,
        block_size=block_size,
        mask_token_id=target_config.vocab_size - 1,
        target_layer_ids=list(target_layer_ids or range(min(2, n_target))),
        vocab_size=target_config.vocab_size,
        num_target_layers=n_target,
        rms_norm_eps=target_config.rms_norm_eps,
        rope=RopeConfig(theta=target_config.rope.theta),
    )
    model = DFlashDrafter(cfg)
    init_random_weights(model, seed)
    model = model.to(dtype).requires_grad_(False).eval()
    if target_embed is not None or target_lm_head is not None:
        if target_embed is None or target_lm_head is None:
            raise ValueError("target_embed/target_lm_head: give both or neither")
        model.attach_target(target_embed, target_lm_head)
    return model
