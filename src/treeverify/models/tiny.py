"""Built-in tiny models, generated in memory from a fixed seed (no download, no committed weights).

tiny-llama: GQA (4 query / 2 KV heads of 64: a head dim the CUDA GQA kernel takes), 2 layers.
tiny-kimi: the Kimi K2 structure in miniature: MLA with the real latent dims (kv_lora_rank 512,
qk_rope 64: absorbed K rows of 576, V of 512, the layout the CUDA MLA kernel takes), q LoRA, YaRN
rope, a first dense layer then MoE layers (sigmoid + noaux_tc, 2 groups, shared expert).
Both use the byte tokenizer. Weights: normal(0, 0.02) projections, norms 1 + small noise, router
bias small positive, drawn from a CPU generator so the same seed gives the same weights anywhere.
"""

from __future__ import annotations

import torch

from treeverify.models.config import DeepseekV3Config, LlamaConfig, RopeConfig
from treeverify.models.deepseek_v3 import DeepseekV3ForCausalLM
from treeverify.models.llama import LlamaForCausalLM
from treeverify.models.tokenizer import ByteTokenizer

TINY_MODELS = ("tiny-llama", "tiny-kimi")
DEFAULT_SEED = 0


def tiny_llama_config() -> LlamaConfig:
    tok = ByteTokenizer()
    return LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=256,
        rope=RopeConfig(theta=10000.0),
        max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id,
        eos_token_ids=tok.eos_token_ids,
        model_type="llama",
    )


def tiny_kimi_config() -> DeepseekV3Config:
    tok = ByteTokenizer()
    return DeepseekV3Config(
        vocab_size=tok.vocab_size,
        hidden_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=256,
        q_lora_rank=64,
        kv_lora_rank=512,
        qk_nope_head_dim=32,
        qk_rope_head_dim=64,
        v_head_dim=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        rope=RopeConfig(
            theta=50000.0,
            type="yarn",
            factor=4.0,
            original_max_position_embeddings=1024,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id,
        eos_token_ids=tok.eos_token_ids,
        model_type="kimi_k2",
    )


@torch.no_grad()
def init_random_weights(model: torch.nn.Module, seed: int) -> None:
    """Deterministic weights, drawn in parameter-name order from a CPU generator."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            val = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        elif name.endswith("e_score_correction_bias"):
            val = 0.05 * torch.rand(p.shape, generator=gen)
        elif name.endswith(".bias"):
            val = 0.02 * torch.randn(p.shape, generator=gen)
        else:
            val = 0.02 * torch.randn(p.shape, generator=gen)
        p.copy_(val.to(p.dtype))


def build_tiny(name: str, seed: int = DEFAULT_SEED, dtype: torch.dtype = torch.float32):
    """(config, model, tokenizer) for "tiny-llama" or "tiny-kimi"; model in eval mode, on CPU."""
    if name == "tiny-llama":
        cfg = tiny_llama_config()
        model = LlamaForCausalLM(cfg)
    elif name == "tiny-kimi":
        cfg = tiny_kimi_config()
        model = DeepseekV3ForCausalLM(cfg)
    else:
        raise ValueError(f"name: expected one of {', '.join(TINY_MODELS)}, got {name!r}")
    init_random_weights(model, seed)
    model = model.to(dtype).requires_grad_(False).eval()
    if isinstance(model, DeepseekV3ForCausalLM):
        model.keep_router_fp32()
    return cfg, model, ByteTokenizer()
