"""DeepSeek-V3 / Kimi K2: MLA attention + MoE, over a flat batch of tokens with explicit positions.

MLA per token (L = kv_lora_rank, R = qk_rope_head_dim, N = qk_nope_head_dim, Dv = v_head_dim):
  q = q_b(norm(q_a(x))) (or q_proj(x))                   -> per head [q_nope (N) | q_pe (R)]
  [c_kv (L) | k_pe (R)] = kv_a_proj_with_mqa(x);  c_kv = kv_a_layernorm(c_kv);  k_pe shared by heads
  kv_b = W (H, N + Dv, L): per head k_nope = W_uk c_kv, v = W_uv c_kv
Naive: K = [k_nope | k_pe], V = v per head.  Absorbed (decode/verify; what the kernels take):
  q_lat = W_ukᵀ q_nope (L);  Q = [q_lat | q_pe] (L+R per head); one latent KV head
  K row = [c_kv | k_pe] (L+R = 576 for V3/K2), V = K[:, :L] (512);  out = W_uv · attn_out_latent.
  Q·K = q_nopeᵀ W_uk c_kv + q_pe·k_pe, identical scores, so both forms agree.
sm_scale = 1/sqrt(N + R) · mscale(factor, mscale_all_dim)² under YaRN (config.sm_scale).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from treeverify import env
from treeverify.kernels.api import triton_available
from treeverify.models import fused_mla
from treeverify.models.config import DeepseekV3Config
from treeverify.models.fused_ops import add_rmsnorm, residual_stream, rmsnorm, rmsnorm_pair
from treeverify.models.gemv import Linear, linear
from treeverify.models.layers import (
    MLP,
    Attention,
    RMSNorm,
    Rope,
    TorchAttention,
    apply_rope,
    check_flat_batch,
    fuse_linears,
)
from treeverify.models.moe import DeepseekMoE


class MLAttention(nn.Module):
    def __init__(self, cfg: DeepseekV3Config, layer: int):
        super().__init__()
        self.layer = layer
        self.cfg = cfg
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        self.nh = nh
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(h, nh * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(h, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = Linear(cfg.q_lora_rank, nh * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = Linear(
            cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False
        )
        self.o_proj = Linear(nh * cfg.v_head_dim, h, bias=False)
        # The absorbed form's rope + operand packing in one kernel on a GPU (models/fused_mla.py)
        self.fused_rope = env.fused_mla_rope() and triton_available()
        # q_a_proj | kv_a_proj_with_mqa as one weight after `fuse()` (both read the same x)
        self.qkv_a: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def fuse(self) -> None:
        """q_a_proj and kv_a_proj_with_mqa as one (Q + L + R, h) GEMM (inference; the Linears
        become views, as Llama's qkv): one GEMV launch a layer instead of two at decode
        (random:mla-moe: 2112 x 2048, 8.7 MB, the decode GEMV's range)."""
        if self.qkv_a is None and self.cfg.q_lora_rank is not None:
            self.qkv_a = fuse_linears(self.q_a_proj, self.kv_a_proj_with_mqa)

    def forward(self, x, cos, sin, attention: Attention, absorbed: bool = True):
        cfg, t, nh = self.cfg, x.shape[0], self.nh
        n, r, lat, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
        if self.qkv_a is not None:  # one GEMM, then both norms in one launch, read in place
            fused_a = linear(x, *self.qkv_a)  # (T, Q + L + R)
            q_a, ckv = rmsnorm_pair(fused_a, self.q_a_layernorm, self.kv_a_layernorm)
            q = self.q_b_proj(q_a)
            k_pe = fused_a[:, -r:]  # (T, R) strided
        else:
            if cfg.q_lora_rank is None:
                q = self.q_proj(x)
            else:
                q = self.q_b_proj(rmsnorm(self.q_a_proj(x), self.q_a_layernorm))
            ckv, k_pe = self.kv_a_proj_with_mqa(x).split([lat, r], dim=-1)  # (T, L), (T, R)
            ckv = rmsnorm(ckv, self.kv_a_layernorm)  # read in place from the strided split
        q = q.view(t, nh, n + r)  # (T, H, N+R)
        q_nope, q_pe = q[..., :n], q[..., n:]
        w = self.kv_b_proj.weight.view(nh, n + dv, lat)  # (H, N+Dv, L)
        rope = functools.partial(apply_rope, cos=cos, sin=sin, interleave=cfg.rope_interleave)
        if absorbed:
            q_lat = torch.einsum("thn,hnl->thl", q_nope, w[:, :n])  # (T, H, L)
            # The engine's paged attention on a GPU: qa packed and ka written to the latent
            # cache by one kernel, then attention (None elsewhere: the steps below)
            fused = getattr(attention, "pack_store_attend", None) if self.fused_rope else None
            o_lat = fused(self.layer, q_lat, q, ckv, k_pe, cos, sin, cfg.rope_interleave,
                          cfg.sm_scale) if fused else None  # fmt: skip
            if o_lat is None:
                # qa, ka in one kernel on a GPU (models/fused_mla.py); None: the PyTorch ops
                packed = fused_mla.mla_rope_pack(
                    q_lat, q, ckv, k_pe, cos, sin, cfg.rope_interleave
                ) if self.fused_rope else None  # fmt: skip
                qa, ka = packed or (  # (T, H, L+R), (T, 1, L+R)
                    torch.cat((q_lat, rope(q_pe)), dim=-1),
                    torch.cat((ckv[:, None, :], rope(k_pe[:, None, :])), dim=-1),
                )
                o_lat = attention(self.layer, qa, ka, None, cfg.sm_scale, v_head_dim=lat)
            # o_lat: (T, H, L)
            o = torch.einsum("thl,hvl->thv", o_lat, w[:, n:])  # (T, H, Dv)
        else:
            q_pe, k_pe = rope(q_pe), rope(k_pe[:, None, :])  # (T, H, R), (T, 1, R)
            kv = self.kv_b_proj(ckv).view(t, nh, n + dv)  # (T, H, N+Dv)
            k = torch.cat((kv[..., :n], k_pe.expand(t, nh, r)), dim=-1)  # (T, H, N+R)
            qn = torch.cat((q_nope, q_pe), dim=-1)  # (T, H, N+R)
            o = attention(self.layer, qn, k, kv[..., n:].contiguous(), cfg.sm_scale)  # (T, H, Dv)
        return self.o_proj(o.reshape(t, nh * dv))


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekV3Config, layer: int):
        super().__init__()
        self.self_attn = MLAttention(cfg, layer)
        self.is_moe = cfg.is_moe_layer(layer)
        self.mlp = DeepseekMoE(cfg) if self.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, residual, cos, sin, attention, absorbed, counter, valid=None):
        """h = input_layernorm(residual), made by the caller together with the previous add
        (fused_ops.add_rmsnorm: one kernel on a GPU instead of an add and a norm). Returns (the
        MLP's output, the residual after attention); the caller adds them. A MoE layer adds its
        valid rows' expert counts to `counter` ((E,) int64) in place."""
        a = self.self_attn(h, cos, sin, attention, absorbed)
        h, residual = add_rmsnorm(a, residual, self.post_attention_layernorm)
        if self.is_moe:
            return self.mlp(h, valid, counter)[0], residual
        return self.mlp(h), residual


class DeepseekV3Model(nn.Module):
    def __init__(self, cfg: DeepseekV3Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekV3DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV3ForCausalLM(nn.Module):
    """forward(input_ids (T,), positions (T,), attention) -> logits (T, vocab) fp32.

    `moe_expert_counts` (layers, n_routed_experts) int64, on the model's device: tokens routed to
    each expert per layer, accumulated on device across forwards (dense layers' rows stay 0);
    `reset_moe_counts()` zeroes it, `moe_imbalance()` gives max/mean per MoE layer.
    `absorbed` (default True) selects the MLA form; `set_moe_impl("dense")` makes MoE sync-free.
    """

    def __init__(self, cfg: DeepseekV3Config):
        super().__init__()
        self.config = cfg
        self.model = DeepseekV3Model(cfg)
        self.rope = Rope(cfg.rope, cfg.qk_rope_head_dim)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Layers whose outputs a forward keeps in `captured` (a drafter conditions on them).
        self.capture_layers: frozenset[int] = frozenset()
        self.captured: torch.Tensor | None = None
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer(
            "moe_expert_counts",
            torch.zeros(cfg.num_hidden_layers, cfg.n_routed_experts, dtype=torch.int64),
            persistent=False,
        )
        self.absorbed = True

    def fuse_for_inference(self) -> DeepseekV3ForCausalLM:
        """q_a|kv_a as one GEMM in the attention, gate|up as one in the dense MLPs and shared
        experts (routed experts are stacked separately, see DeepseekMoE.stack_experts)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            if not layer.is_moe:
                layer.mlp.fuse()
            elif layer.mlp.shared_experts is not None:
                layer.mlp.shared_experts.fuse()
        return self

    def kv_cache_spec(self) -> list[tuple[tuple[int, ...], tuple[int, ...] | None]]:
        """Per layer (K row shape, V row shape or None): one absorbed latent row per token."""
        c = self.config
        return [((1, c.kv_lora_rank + c.qk_rope_head_dim), None)] * c.num_hidden_layers

    def set_moe_impl(self, impl: str) -> None:
        impls = ("grouped", "dense", "gather", "grouped_mm", "graph")
        if impl not in impls:
            raise ValueError(f"impl: expected one of {', '.join(impls)}, got {impl!r}")
        for layer in self.model.layers:
            if layer.is_moe:
                layer.mlp.impl = impl

    def keep_router_fp32(self) -> DeepseekV3ForCausalLM:
        """Router weights and bias back to fp32 (as DeepSeek runs them) after a `.to(dtype)`."""
        for layer in self.model.layers:
            if layer.is_moe:
                layer.mlp.gate.float()
        return self

    def reset_moe_counts(self) -> None:
        self.moe_expert_counts.zero_()

    def moe_imbalance(self) -> torch.Tensor:  # (layers,) fp32: max/mean, 0 where no tokens
        c = self.moe_expert_counts.float()
        mean = c.mean(-1)
        return torch.where(mean > 0, c.amax(-1) / mean.clamp_min(1e-9), torch.zeros_like(mean))

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,) int
        positions: torch.Tensor,  # (T,) int
        attention: Attention | None = None,
        logits_indices: torch.Tensor | None = None,  # (N,): rows to project; default all
        absorbed: bool | None = None,
        token_valid: torch.Tensor | None = None,  # (T,) bool: padding rows False (MoE counts)
    ) -> torch.Tensor:  # (T or N, vocab) fp32
        check_flat_batch(input_ids, positions)
        attention = attention if attention is not None else TorchAttention()
        absorbed = self.absorbed if absorbed is None else absorbed
        cos, sin = self.rope(positions)  # (T, R/2) each
        x = self.model.embed_tokens(input_ids)  # (T, hidden)
        # captured: the tapped layers' outputs side by side (T, len(taps) * hidden), or None
        h, self.captured = residual_stream(
            x, self.model.layers, self.model.norm,
            lambda i, layer, h, residual: layer(h, residual, cos, sin, attention, absorbed,
                                                self.moe_expert_counts[i], token_valid),
            self.capture_layers,
        )  # fmt: skip
        if logits_indices is not None:
            h = h[logits_indices]
        return self.lm_head(h).float()
