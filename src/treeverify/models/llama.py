"""The Llama family (Llama 3, Qwen2, Qwen3) over a flat batch of tokens with explicit positions.

Module names follow the Hugging Face checkpoints ("model.layers.N.self_attn.q_proj", ...), so
loading is a direct state-dict copy.
"""

from __future__ import annotations

import torch
from torch import nn

from treeverify import env
from treeverify.models.config import LlamaConfig
from treeverify.models.fused_ops import add_rmsnorm, residual_stream, rope_qk
from treeverify.models.gemv import Linear, down_of_silu, linear
from treeverify.models.layers import (
    MLP,
    ROPE_TABLE_SLACK,
    Attention,
    RMSNorm,
    Rope,
    TorchAttention,
    apply_rope,
    apply_rope_tables,
    check_flat_batch,
    fuse_linears,
)
from treeverify.models.norm_linear import add_norm_linear, folded_residual_stream


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.sm_scale = self.d**-0.5
        h = cfg.hidden_size
        self.q_proj = Linear(h, self.hq * self.d, bias=cfg.qkv_bias)
        self.k_proj = Linear(h, self.hkv * self.d, bias=cfg.qkv_bias)
        self.v_proj = Linear(h, self.hkv * self.d, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.hq * self.d, h, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None

    @torch.no_grad()
    def fuse(self) -> None:
        """q, k, v projections as one GEMM (inference; the Linears become views)."""
        if self.qkv is None:
            self.qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x, cos, sin, attention: Attention):
        """cos/sin: Rope's (T, D/2) tables, or with `fuse()` the (T, D) rotate-half tables."""
        if self.qkv is not None:
            return self.attend(linear(x, *self.qkv), cos, sin, attention)
        t, hq, hkv, d = x.shape[0], self.hq, self.hkv, self.d
        q = self.q_proj(x).view(t, hq, d)  # (T, Hq, D)
        k = self.k_proj(x).view(t, hkv, d)  # (T, Hkv, D)
        v = self.v_proj(x).view(t, hkv, d)  # (T, Hkv, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = attention(self.layer, q, k, v, self.sm_scale)  # (T, Hq, D)
        return self.o_proj(o.reshape(t, hq * d))

    def attend(self, qkv, cos, sin, attention: Attention):
        """The rest of a fused layer's attention after its qkv projection (T, (Hq+2Hkv) D):
        rotary, attention, o_proj. cos/sin: the (T, D) rotate-half tables."""
        t, hq, hkv, d = qkv.shape[0], self.hq, self.hkv, self.d
        qkv = qkv.view(t, hq + 2 * hkv, d)  # (T, Hq+2Hkv, D)
        v = qkv[:, hq + hkv :]
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qkv[:, :hq]), self.k_norm(qkv[:, hq : hq + hkv])), 1)
            qk = apply_rope_tables(qk, cos, sin)  # (T, Hq+Hkv, D)
            q, k = qk[:, :hq].contiguous(), qk[:, hq:]
        else:
            # The engine's paged attention on a GPU: q, k rotated and k, v written to the KV
            # cache in one kernel, then attention; elsewhere (None) rope_qk, then attention.
            fused = getattr(attention, "rope_store_attend", None)
            o = fused(self.layer, qkv, cos, sin, hq, hkv, self.sm_scale) if fused else None
            if o is not None:
                return self.o_proj(o.reshape(t, hq * d))
            q, k = rope_qk(qkv, cos, sin, hq, hkv)  # one kernel on a GPU, q contiguous
        o = attention(self.layer, q, k, v, self.sm_scale)  # (T, Hq, D)
        return self.o_proj(o.reshape(t, hq * d))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, residual, cos, sin, attention):
        """h = input_layernorm(residual), made by the caller together with the previous add.
        Returns (mlp output, residual after attention); the caller adds the former."""
        a = self.self_attn(h, cos, sin, attention)
        h, residual = add_rmsnorm(a, residual, self.post_attention_layernorm)
        return self.mlp(h), residual

    def forward_folded(self, m, residual, cos, sin, attention, tap=None):
        """A fused layer with both adds + norms made on its projections' loads
        (models/norm_linear.py): m is what the layer before added (residual None: m is the
        embedding, normed with no add); `tap` takes that add's sum (the layer before's
        output). Returns (mlp output, residual after attention), as `forward`."""
        attn, mlp = self.self_attn, self.mlp
        qkv, residual = add_norm_linear(m, residual, self.input_layernorm, *attn.qkv, tap=tap)
        a = attn.attend(qkv, cos, sin, attention)
        gate_up, residual = add_norm_linear(a, residual, self.post_attention_layernorm,
                                            *mlp.gate_up)  # fmt: skip
        return down_of_silu(gate_up, mlp.down_proj.weight, mlp.down_proj.bias), residual


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
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Layers whose outputs a forward keeps in `captured` (a drafter conditions on them).
        self.capture_layers: frozenset[int] = frozenset()
        self.captured: torch.Tensor | None = None
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.fused = False
        self.fold_norms = False

    def fuse_for_inference(self) -> LlamaForCausalLM:
        """Fewer, larger kernels per layer (qkv and gate|up GEMMs, q and k rotated together);
        parameters stay where loading and state dicts expect them."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        w = self.model.embed_tokens.weight
        self.rope.tabulate(self.config.max_position_embeddings + ROPE_TABLE_SLACK, w.dtype,
                           w.device)  # fmt: skip
        self.fused = True
        self.fold_norms = env.norm_linear()  # the layers' norms on their projections' loads
        return self

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
        check_flat_batch(input_ids, positions)
        attention = attention if attention is not None else TorchAttention()
        x = self.model.embed_tokens(input_ids)  # (T, hidden)
        if self.fused:
            cos, sin = self.rope.rotate_half_tables(positions, x.dtype)  # (T, D) each
        else:
            cos, sin = self.rope(positions)  # (T, D/2) each
        # captured: the tapped layers' outputs side by side (T, len(taps) * hidden), or None
        if self.fold_norms:
            h, self.captured = folded_residual_stream(
                x, self.model.layers, self.model.norm,
                lambda i, layer, m, residual, tap: layer.forward_folded(m, residual, cos, sin,
                                                                        attention, tap),
                self.capture_layers,
            )  # fmt: skip
        else:
            h, self.captured = residual_stream(
                x, self.model.layers, self.model.norm,
                lambda i, layer, h, residual: layer(h, residual, cos, sin, attention),
                self.capture_layers,
            )  # fmt: skip
        if logits_indices is not None:
            h = h[logits_indices]
        return self.lm_head(h).float()
