"""The Llama family (Llama 3, Qwen2, Qwen3) over a flat batch of tokens with explicit positions.

Module names follow the Hugging Face checkpoints ("model.layers.N.self_attn.q_proj", ...), so
loading is a direct state-dict copy.
"""

from __future__ import annotations

import torch
from torch import nn

from treeverify.models.config import LlamaConfig
from treeverify.models.layers import MLP, Attention, RMSNorm, Rope, TorchAttention, apply_rope


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.sm_scale = self.d**-0.5
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.hq * self.d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, self.hkv * self.d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, self.hkv * self.d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.hq * self.d, h, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, attention: Attention):
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.hq, self.d)  # (T, Hq, D)
        k = self.k_proj(x).view(t, self.hkv, self.d)  # (T, Hkv, D)
        v = self.v_proj(x).view(t, self.hkv, self.d)  # (T, Hkv, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = attention(self.layer, q, k, v, self.sm_scale)  # (T, Hq, D)
        return self.o_proj(o.reshape(t, self.hq * self.d))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, attention):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """forward(input_ids (T,), positions (T,), attention) -> logits (T, vocab) fp32."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.rope = Rope(cfg.rope, cfg.head_dim)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def kv_cache_spec(self) -> list[tuple[tuple[int, ...], tuple[int, ...] | None]]:
        """Per layer (K row shape, V row shape) of one token's cache entry."""
        c = self.config
        return [((c.num_key_value_heads, c.head_dim),) * 2] * c.num_hidden_layers

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,) int
        positions: torch.Tensor,  # (T,) int
        attention: Attention | None = None,
        logits_indices: torch.Tensor | None = None,  # (N,): rows to project; default all
        token_valid: torch.Tensor | None = None,  # (T,) bool; unused (no MoE), same signature
    ) -> torch.Tensor:  # (T or N, vocab) fp32
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids/positions: expected matching (T,) tensors, got "
                f"{tuple(input_ids.shape)} and {tuple(positions.shape)}"
            )
        attention = attention if attention is not None else TorchAttention()
        cos, sin = self.rope(positions)  # (T, D/2) each
        x = self.model.embed_tokens(input_ids)  # (T, hidden)
        for layer in self.model.layers:
            x = layer(x, cos, sin, attention)
        if logits_indices is not None:
            x = x[logits_indices]
        return self.lm_head(self.model.norm(x)).float()
