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

import torch
import torch.nn.functional as F
from torch import nn

from treeverify import env
from treeverify.models.gemv import Linear, linear
from treeverify.models.layers import (
    MLP,
    RMSNorm,
    Rope,
    apply_rope_tables,
    fuse_linears,
    rope_inv_freq,
)
from treeverify.spec.dflash_config import DFlashConfig


def ring_valid(counts: torch.Tensor, ends: torch.Tensor, width: int, rows: int) -> torch.Tensor:
    """(B, rows) bool: ring row r of request b holds one of its newest counts[b] positions
    (those below ends[b]); the ring has `width` rows, the first `rows` of them are read."""
    r = torch.arange(rows, device=counts.device)  # (rows,)
    age = torch.remainder(ends[:, None] - 1 - r[None, :], width)  # (B, rows) newest = 0
    return age < counts[:, None]


class DFlashAttention(nn.Module):
    """Block queries over [context rows; block rows] keys/values, non-causal, GQA.

    A context row's key and value depend on that row alone (its projected features and its
    position), so they can be computed once, when the row is committed, and kept (`context_kv`);
    a round then projects only the block (`forward`)."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.sm_scale = self.d**-0.5
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.hq * self.d, bias=bias)
        self.k_proj = nn.Linear(h, self.hkv * self.d, bias=bias)
        self.v_proj = nn.Linear(h, self.hkv * self.d, bias=bias)
        self.o_proj = Linear(self.hq * self.d, h, bias=bias)  # nn.Linear's state, linear()
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # after fuse()

    @torch.no_grad()
    def fuse(self) -> None:
        """q|k|v as one GEMM (the projections' parameters become views into it)."""
        if self.qkv is None:
            self.qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def forward_ring(
        self,
        x: torch.Tensor,  # (B, T, H) the block, after the layer's input norm
        store: torch.Tensor,  # (slots, W, n_layers, 2, Hkv, D) the context rings
        layer: int,
        meta: torch.Tensor,  # (4, B) int64: rows held, roots, ends, ring slots
        rows: int,  # ring rows to walk
        cos2: torch.Tensor,  # (B*T, D) rotate-half tables at the block's positions
        sin2: torch.Tensor,  # (B*T, D)
    ) -> torch.Tensor:  # (B, T, H)
        """`forward` over keys/values read from the rings in place, by the Triton kernels of
        spec/dflash_fused.py (after `fuse()`; `dflash_fused.supported` says where)."""
        b, t, _ = x.shape
        qkv = linear(x.reshape(b * t, -1), *self.qkv)  # (B*T, (Hq+2Hkv) D)
        return self.attend_ring(qkv, store, layer, meta, rows, cos2, sin2, b)

    def attend_ring(self, qkv, store, layer, meta, rows, cos2, sin2, b: int) -> torch.Tensor:
        """`forward_ring` after its qkv projection (B*T, (Hq+2Hkv) D) of b blocks: the q / k
        norms and rotary, the ring attention, o_proj. Returns (B, T, H)."""
        from treeverify.spec import dflash_fused

        qkv = qkv.view(qkv.shape[0], -1, self.d)  # (B*T, Hq+2Hkv, D)
        q, blk_kv = dflash_fused.qk_norm_rope(qkv, self.q_norm, self.k_norm, cos2, sin2,
                                              self.hq, self.hkv, b)  # fmt: skip
        o = dflash_fused.ring_attention(q, store, layer, meta, rows, blk_kv, self.sm_scale)
        return self.o_proj(o).view(b, qkv.shape[0] // b, -1)  # (B*T, Hq*D) -> (B, T, H)

    def keys_values(
        self,
        rows: torch.Tensor,  # (R, H) projected context rows, or the normed block
        cos2: torch.Tensor,  # (R, D) Rope.rotate_half_tables at the rows' positions
        sin2: torch.Tensor,  # (R, D)
    ) -> torch.Tensor:  # (R, 2, Hkv, D): rotated keys, values
        r = rows.shape[0]
        k = self.k_norm(self.k_proj(rows).view(r, self.hkv, self.d))  # (R, Hkv, D)
        k = apply_rope_tables(k, cos2, sin2)
        v = self.v_proj(rows).view(r, self.hkv, self.d)  # (R, Hkv, D)
        return torch.stack((k, v), dim=1)

    def forward(
        self,
        x: torch.Tensor,  # (B, T, H) the block, after the layer's input norm
        ctx_kv: torch.Tensor,  # (B, C, 2, Hkv, D) the context rows' keys/values (keys_values)
        cos2: torch.Tensor,  # (B, T, D) rotate-half tables at the block's positions
        sin2: torch.Tensor,  # (B, T, D)
        bias: torch.Tensor,  # (B, 1, 1, C + T) fp32: 0 for visible keys, -inf for padding
    ) -> torch.Tensor:  # (B, T, H)
        b, t, _ = x.shape
        g = self.hq // self.hkv
        cos_q, sin_q = cos2.reshape(b * t, -1), sin2.reshape(b * t, -1)  # (B*T, D)
        q = self.q_norm(self.q_proj(x).view(b * t, self.hq, self.d))  # (B*T, Hq, D)
        q = apply_rope_tables(q, cos_q, sin_q)
        blk_kv = self.keys_values(x.reshape(b * t, -1), cos_q, sin_q).view(b, t, 2, self.hkv, -1)
        kv = torch.cat((ctx_kv.to(x.dtype), blk_kv), dim=1)  # (B, S = C + T, 2, Hkv, D)
        # Query head h reads KV head h // g: group the g query heads of a KV head together.
        qg = q.view(b, t, self.hkv, g, self.d).permute(0, 2, 3, 1, 4)  # (B, Hkv, g, T, D)
        qg = qg.reshape(b, self.hkv, g * t, self.d)  # (B, Hkv, g*T, D)
        kg = kv[:, :, 0].transpose(1, 2)  # (B, Hkv, S, D)
        vg = kv[:, :, 1].transpose(1, 2)  # (B, Hkv, S, D)
        # A fused attention kernel in the model dtype: scores and softmax stay fp32 inside it.
        # (Plain bf16 matmuls round the scores to bf16 before the softmax: measured on the H200,
        # prose acceptance fell 4.58 -> 3.93; fp32 matmuls cost ~50 us a round.)
        o = F.scaled_dot_product_attention(
            qg, kg, vg, attn_mask=bias.to(qg.dtype), scale=self.sm_scale
        )  # (B, Hkv, g*T, D)
        o = o.view(b, self.hkv, g, t, self.d).permute(0, 3, 1, 2, 4)  # (B, T, Hkv, g, D)
        return self.o_proj(o.reshape(b, t, self.hq * self.d))  # (B, T, H)


class DFlashDecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, ctx_kv, cos2, sin2, bias):  # x (B, T, H) -> (B, T, H)
        x = x + self.self_attn(self.input_layernorm(x), ctx_kv, cos2, sin2, bias)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_ring(self, h, residual, store, layer, meta, rows, cos2, sin2):
        """h (B, T, H) = input_layernorm(residual (B*T, H)), made by the caller together with
        the previous add (fused_ops.add_rmsnorm). Returns (the MLP's output, the residual after
        attention), both (B*T, H); the caller adds them."""
        from treeverify.models.fused_ops import add_rmsnorm

        b, t, hid = h.shape
        a = self.self_attn.forward_ring(h, store, layer, meta, rows, cos2, sin2)
        normed, residual = add_rmsnorm(a.view(b * t, hid), residual, self.post_attention_layernorm)
        return self.mlp(normed), residual

    def forward_ring_folded(self, m, residual, store, layer, meta, rows, cos2, sin2, b: int):
        """`forward_ring` with both adds + norms made on its projections' loads
        (models/norm_linear.py; the drafter's `fold_norms`): m (B*T, H) is what the layer
        before added (residual None: the embedded block, normed with no add). Returns (the
        MLP's output, the residual after attention), both (B*T, H)."""
        from treeverify.models.gemv import down_of_silu
        from treeverify.models.norm_linear import add_norm_linear

        attn, mlp = self.self_attn, self.mlp
        qkv, residual = add_norm_linear(m, residual, self.input_layernorm, *attn.qkv)
        a = attn.attend_ring(qkv, store, layer, meta, rows, cos2, sin2, b)  # (B, T, H)
        post = self.post_attention_layernorm
        gate_up, residual = add_norm_linear(a.view(m.shape), residual, post, *mlp.gate_up)
        return down_of_silu(gate_up, mlp.down_proj.weight, mlp.down_proj.bias), residual


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
        self.fc = Linear(cfg.context_features, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = Rope(cfg.rope, cfg.head_dim)  # inv_freq: a non-persistent fp32 buffer
        # A plain tuple, not submodules: the target owns these, and they must stay out of this
        # module's state_dict (the published checkpoint has neither).
        self._target: tuple[nn.Embedding, nn.Linear] | None = None
        self.fold_norms = False  # fuse_for_inference reads TREEVERIFY_NORM_LINEAR
        self.block_fused = False  # fuse_for_inference reads TREEVERIFY_ROUND_GLUE (GPU only)
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
    ) -> torch.Tensor:  # (B, L, V) logits for the next L positions (dtype: logits_dtype())
        """Draft logits for the L positions after each sequence's last committed token.

        context_hidden[b, :context_lens[b]] are the target's hidden states (the outputs of the
        decoder layers in `target_layer_ids`, concatenated in that order) of the committed tokens
        just before last_tokens[b]; rows past context_lens[b] are ignored, whatever they hold.
        The full block is always run (the drafter was trained on full blocks); only the first
        `depth` predictions are projected to the vocabulary.
        """
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
        self._check_round(depth)
        device = context_hidden.device
        # Zero the padding (whatever it holds, nothing of it reaches the math), then every
        # row's keys/values at its position p0 + row.
        rows = torch.arange(c, device=device)  # (C,)
        lens = context_lens.to(device=device, dtype=torch.long)  # (B,)
        ctx_valid = rows[None, :] < lens[:, None]  # (B, C)
        feats = context_hidden.masked_fill(~ctx_valid[:, :, None], 0.0)  # (B, C, F)
        if context_start is None:
            p0 = torch.zeros(b, dtype=torch.long, device=device)  # (B,)
        else:
            p0 = context_start.to(device=device, dtype=torch.long)  # (B,)
        ctx_pos = p0[:, None] + rows[None, :]  # (B, C)
        kv = self.context_kv(feats.reshape(b * c, -1), ctx_pos.reshape(-1))  # (B*C, nl, 2, ..)
        return self.propose_from_kv(kv.view(b, c, *kv.shape[1:]), lens, last_tokens,
                                    p0 + lens, depth)  # fmt: skip

    def context_kv(
        self,
        features: torch.Tensor,  # (R, F) target hidden states of committed tokens
        positions: torch.Tensor,  # (R,) int: their positions
        interpret: bool = False,  # the Triton CPU interpreter (tests)
    ) -> torch.Tensor:  # (R, n_layers, 2, Hkv, D): every layer's rotated keys and values
        """The part of a draft that depends on one context row only: computed once per committed
        token and kept by the caller (the engine's DraftContextCache), not once per round. On a
        GPU after `fuse_for_inference`: one GEMM and one kernel per layer (spec/dflash_fused)."""
        dtype = self.fc.weight.dtype
        ctx = self.hidden_norm(self.fc(features.to(dtype)))  # (R, H)
        pos = positions.to(device=features.device, dtype=torch.long).reshape(-1)  # (R,)
        cos2, sin2 = self.rope.rotate_half_tables(pos, ctx.dtype)  # (R, D) each, once
        if self.ring_fused(ctx, interpret):
            from treeverify.spec import dflash_fused

            return dflash_fused.context_keys_values(ctx, self.layers, cos2, sin2)
        return torch.stack([layer.self_attn.keys_values(ctx, cos2, sin2) for layer in self.layers],
                           dim=1)  # fmt: skip

    def propose_from_kv(
        self,
        ctx_kv: torch.Tensor,  # (B, C, n_layers, 2, Hkv, D) left-aligned context keys/values
        context_lens: torch.Tensor,  # (B,) int: valid context rows per sequence
        last_tokens: torch.Tensor,  # (B,) int64: the last committed token (block position 0)
        block_start: torch.Tensor,  # (B,) int: the position of the block's first row
        depth: int,  # L, 1 <= L <= block_size - 1
        context_valid: torch.Tensor | None = None,  # (B, C) bool: rows to attend (else < lens)
    ) -> torch.Tensor:  # (B, L, V) logits for the next L positions (dtype: logits_dtype())
        """`propose` from context keys/values already computed by `context_kv`; rows past
        context_lens[b] are masked out of attention (they must be finite), or, given
        `context_valid`, the rows it leaves out (a ring of rows in any order: each key carries
        its rotary position, so the order of rows does not matter)."""
        self._check_round(depth)
        b, c = ctx_kv.shape[:2]
        t = self.block_size
        device = ctx_kv.device
        if context_valid is None:
            lens = context_lens.to(device=device, dtype=torch.long)  # (B,)
            ctx_valid = torch.arange(c, device=device)[None, :] < lens[:, None]  # (B, C)
        else:
            ctx_valid = context_valid  # (B, C)
        x, cos2, sin2 = self._block(last_tokens, block_start)  # (B, T, H), (B*T, D) x2
        cos2, sin2 = cos2.view(b, t, -1), sin2.view(b, t, -1)  # (B, T, D)

        # Keys visible to every block query: the valid context rows and the whole block.
        key_valid = torch.cat([ctx_valid, ctx_valid.new_ones(b, t)], dim=1)  # (B, S)
        bias = torch.zeros(b, 1, 1, c + t, dtype=torch.float32, device=device)
        bias = bias.masked_fill(~key_valid[:, None, None, :], float("-inf"))  # (B, 1, 1, S)

        for i, layer in enumerate(self.layers):
            x = layer(x, ctx_kv[:, :, i], cos2, sin2, bias)  # (B, T, H)
        return self._logits(x, depth)

    def fuse_for_inference(self) -> DFlashDrafter:
        """q|k|v and gate|up as one GEMM each: what `propose_from_ring`'s fused path needs."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        self.fold_norms = env.norm_linear()  # the layers' norms on their projections' loads
        # the block's embedding and rotary rows by one kernel (spec/dflash_fused.block_rows)
        from treeverify.spec import dflash_fused

        self.block_fused = env.round_glue() and dflash_fused._block_kernel() is not None
        return self

    def ring_fused(self, x: torch.Tensor, interpret: bool = False) -> bool:
        """`propose_from_ring` and `context_kv` run the Triton kernels of spec/dflash_fused.py
        on tensors like x (the rings' store, the context rows)."""
        from treeverify.spec import dflash_fused

        fused = all(layer.self_attn.qkv is not None for layer in self.layers)
        return fused and dflash_fused.supported(x, self.config.head_dim, interpret)

    def propose_from_ring(
        self,
        store: torch.Tensor,  # (slots, W, n_layers, 2, Hkv, D) the DraftContextCache's rings
        meta: torch.Tensor,  # (4, B) int64: rows held per request, roots, ends, ring slots
        rows: int,  # the first `rows` ring rows are read (rows older than a ring's end wrap)
        depth: int,  # L
        interpret: bool = False,  # the Triton CPU interpreter (tests)
    ) -> torch.Tensor:  # (B, L, V) logits (dtype: logits_dtype())
        """`propose_from_kv` over each request's ring, read in place: row r of ring `slots[b]`
        is visible when its age (ends[b] - 1 - r) mod W is below counts[b]. On a GPU after
        `fuse_for_inference` (see `ring_fused`): three Triton kernels per layer; elsewhere the
        PyTorch path (a gather of the rows, then `propose_from_kv`). Capture-safe either way."""
        counts, roots, ends, slots = meta  # (B,) each
        if not self.ring_fused(store, interpret):
            ctx = store[slots, :rows]  # (B, rows, n_layers, 2, Hkv, D)
            valid = ring_valid(counts, ends, store.shape[1], rows)  # (B, rows)
            return self.propose_from_kv(ctx, counts, roots, ends, depth, context_valid=valid)
        from treeverify.models.fused_ops import residual_stream
        from treeverify.models.norm_linear import folded_residual_stream

        self._check_round(depth)
        x, cos2, sin2 = self._block(roots, ends)  # (B, T, H), (B*T, D) x2
        b, t, hid = x.shape
        if self.fold_norms:
            h, _ = folded_residual_stream(
                x.reshape(b * t, hid), self.layers, self.norm,
                lambda i, layer, m, residual, tap: layer.forward_ring_folded(
                    m, residual, store, i, meta, rows, cos2, sin2, b),
            )  # fmt: skip
            return self._logits(h.view(b, t, hid), depth, normed=True)
        h, _ = residual_stream(
            x.reshape(b * t, hid), self.layers, self.norm,
            lambda i, layer, h, residual: layer.forward_ring(h.view(b, t, hid), residual, store,
                                                             i, meta, rows, cos2, sin2),
        )  # fmt: skip
        return self._logits(h.view(b, t, hid), depth, normed=True)

    def _check_round(self, depth: int) -> None:
        """A round needs the target's embedding and lm_head, and a depth inside the block."""
        if self._target is None:
            raise RuntimeError("DFlashDrafter: no target embedding/lm_head; call attach_target()")
        if not 1 <= depth <= self.block_size - 1:
            raise ValueError(f"depth: expected 1..{self.block_size - 1}, got {depth}")

    def _block(
        self,
        last_tokens: torch.Tensor,  # (B,) int: block position 0
        block_start: torch.Tensor,  # (B,) int: its position
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # (B, T, H), cos2/sin2 (B*T, D)
        """The block [last token, MASK x (T-1)] through the target's embedding table, and the
        rotary tables at its positions (right after each sequence's context)."""
        embed, _ = self._target
        b, t = last_tokens.shape[0], self.block_size
        device, dtype = self.fc.weight.device, self.fc.weight.dtype
        tables = self.rope.tables
        if (self.block_fused and device.type == "cuda" and tables is not None
                and isinstance(embed, torch.nn.Embedding) and embed.weight.is_contiguous()
                and embed.weight.dtype == dtype == tables[0].dtype
                and self.config.input_embedding_scale == 1.0
                and last_tokens.device == block_start.device == embed.weight.device == device
                and tables[0].device == device):  # fmt: skip
            from treeverify.spec import dflash_fused  # (TREEVERIFY_ROUND_GLUE, on a GPU)

            return dflash_fused.block_rows(embed.weight, last_tokens, block_start,
                                           self.mask_token_id, tables[0], tables[1], t)  # fmt: skip
        masks = torch.full((b, t - 1), self.mask_token_id, dtype=torch.long, device=device)
        ids = torch.cat([last_tokens.to(device=device, dtype=torch.long)[:, None], masks], 1)
        x = embed(ids).to(dtype)  # (B, T, H)
        if self.config.input_embedding_scale != 1.0:
            x = x * self.config.input_embedding_scale
        start = block_start.to(device=device, dtype=torch.long)  # (B,)
        blk_pos = start[:, None] + torch.arange(t, device=device)[None, :]  # (B, T)
        cos2, sin2 = self.rope.rotate_half_tables(blk_pos.reshape(-1), dtype)  # (B*T, D) each
        return x, cos2, sin2

    def logits_dtype(self) -> torch.dtype:
        """The dtype of the draft logits `propose*` return: the lm_head's bf16 on CUDA when
        nothing rescales them (no output multiplier, no softcap), else fp32. Captured consumers
        (the general path's tree build) size their input buffers by it."""
        _, lm_head = self._target
        w, cfg = lm_head.weight, self.config
        if (w.is_cuda and w.dtype == torch.bfloat16 and cfg.output_multiplier == 1.0
                and not cfg.final_logit_softcapping):  # fmt: skip
            return torch.bfloat16
        return torch.float32

    def _logits(self, x: torch.Tensor, depth: int,
                normed: bool = False) -> torch.Tensor:  # (B, T, H) -> (B, L, V)  # fmt: skip
        """Final norm (unless `normed`: x has had it) and the target's lm_head on block
        positions 1 .. depth: fp32, or on CUDA the lm_head's own bf16 when nothing rescales
        them (the tree build's top-k reads bf16 exactly, spec/topk_cuda.py; CHAIN's argmax is
        the same on either: the upcast was a copy kernel a round for nothing)."""
        _, lm_head = self._target
        cfg = self.config
        h = x[:, 1 : 1 + depth] if normed else self.norm(x[:, 1 : 1 + depth])  # (B, L, H)
        logits = lm_head(h.to(lm_head.weight.dtype))  # (B, L, V)
        if self.logits_dtype() == torch.bfloat16:  # kept as is: nothing rescales them
            return logits
        logits = logits.float()
        if cfg.output_multiplier != 1.0:
            logits = logits * cfg.output_multiplier
        if cfg.final_logit_softcapping:
            cap = cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits
