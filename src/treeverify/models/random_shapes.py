"""Random-weight models at real shapes, for GPU benchmarks ("random:llama-1b", ...).

The shapes are the published configs' (Llama 3.2 1B, Llama 3.1 8B; a small DeepSeek-V3-style
MLA+MoE with V3's latent dims); the weights are seeded normal(0, 0.02), drawn on the target device
(an 8B model initialises in seconds). Outputs are meaningless text: these measure speed, memory
and graph-vs-eager agreement, never quality. The tokenizer is the byte one, widened to the vocab
(ids past the byte range decode as "<id>").
"""

from __future__ import annotations

import torch

from treeverify.models.config import DeepseekV3Config, LlamaConfig, RopeConfig
from treeverify.models.deepseek_v3 import DeepseekV3ForCausalLM
from treeverify.models.llama import LlamaForCausalLM
from treeverify.models.tokenizer import ByteTokenizer


class WideByteTokenizer(ByteTokenizer):
    """The byte tokenizer over a larger vocab: ids >= 259 decode as "<id>"."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out, run = [], []
        for i in (int(x) for x in ids):
            if i < ByteTokenizer.vocab_size:
                run.append(i)
            else:
                out.append(super().decode(run, skip_special_tokens) + f"<{i}>")
                run = []
        return "".join(out) + super().decode(run, skip_special_tokens)


def _llama(hidden, layers, heads, kv, head_dim, inter, tie) -> LlamaConfig:
    tok = ByteTokenizer()
    return LlamaConfig(
        vocab_size=128256, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
        intermediate_size=inter, rms_norm_eps=1e-5, rope=RopeConfig(theta=500000.0),
        tie_word_embeddings=tie, max_position_embeddings=131072,
        bos_token_id=tok.bos_token_id, eos_token_ids=tok.eos_token_ids, model_type="llama",
    )  # fmt: skip


def _mla_moe() -> DeepseekV3Config:
    tok = ByteTokenizer()
    return DeepseekV3Config(
        vocab_size=102400, hidden_size=2048, num_hidden_layers=8, num_attention_heads=16,
        intermediate_size=10944, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6,
        moe_intermediate_size=1408, n_shared_experts=2, first_k_dense_replace=1,
        routed_scaling_factor=2.5, scoring_func="sigmoid", topk_method="noaux_tc", n_group=8,
        topk_group=4, norm_topk_prob=True, max_position_embeddings=163840,
        bos_token_id=tok.bos_token_id, eos_token_ids=tok.eos_token_ids, model_type="deepseek_v3",
    )  # fmt: skip


RANDOM_SHAPES = {
    "random:llama-1b": lambda: _llama(2048, 16, 32, 8, 64, 8192, tie=True),
    "random:llama-8b": lambda: _llama(4096, 32, 32, 8, 128, 14336, tie=False),
    "random:mla-moe": _mla_moe,
}


@torch.no_grad()
def build_random(name: str, *, dtype: torch.dtype, device: str | torch.device, seed: int = 0):
    """(config, model, tokenizer) for a RANDOM_SHAPES name; weights drawn on `device`."""
    if name not in RANDOM_SHAPES:
        raise ValueError(f"name: expected one of {', '.join(RANDOM_SHAPES)}, got {name!r}")
    cfg = RANDOM_SHAPES[name]()
    with torch.device("meta"):
        model = (LlamaForCausalLM if isinstance(cfg, LlamaConfig) else DeepseekV3ForCausalLM)(cfg)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty makes separate tensors; tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    gen = torch.Generator(device=device).manual_seed(seed)
    for pname, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if pname.endswith("norm.weight") or pname.endswith("layernorm.weight"):
            p.fill_(1.0)
        elif pname.endswith("e_score_correction_bias"):
            p.uniform_(0.0, 0.05, generator=gen)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    for pname, b in model.named_buffers():  # buffers made on meta: recompute on the device
        if pname.endswith("inv_freq"):
            from treeverify.models.layers import rope_inv_freq

            rope_dim = cfg.head_dim if isinstance(cfg, LlamaConfig) else cfg.qk_rope_head_dim
            b.copy_(rope_inv_freq(cfg.rope, rope_dim))
        else:
            b.zero_()
    model = model.to(dtype).requires_grad_(False).eval()
    if isinstance(model, DeepseekV3ForCausalLM):
        model.keep_router_fp32()
    return cfg, model, WideByteTokenizer(cfg.vocab_size)
