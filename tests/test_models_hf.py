"""Our Llama / Qwen2 / Qwen3 / DeepSeek-V3 (Kimi K2) logits equal transformers' on the same random
weights: the HF model is built from a small config, randomised, saved as safetensors, loaded with
our loader, and both run in fp32 on the CPU. transformers is a test-only dependency."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from treeverify.models import TorchAttention, load_model  # noqa: E402

ATOL = 1e-4


def write_tokenizer(directory) -> None:
    """A small word-level tokenizer.json so the directory is complete."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights with O(1) activations (std 1/sqrt(fan_in)), norms near 1, small positive router
    bias: the defaults (zeros, ones) would leave parts of the architecture untested."""
    gen = torch.Generator().manual_seed(seed)
    tensors = dict(model.named_parameters())
    tensors.update({n: b for n, b in model.named_buffers() if "e_score_correction_bias" in n})
    for name, p in sorted(tensors.items()):
        if "norm" in name:
            val = 1.0 + 0.2 * torch.randn(p.shape, generator=gen)
        elif "e_score_correction_bias" in name:
            val = 0.1 * torch.rand(p.shape, generator=gen)
        elif p.dim() == 2 and "embed" not in name:
            val = torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5
        else:
            val = 0.5 * torch.randn(p.shape, generator=gen)
        p.copy_(val)


def save_hf(hf_cfg, cls, directory, seed=0):
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(hf_cfg).eval()
    randomize(model, seed)
    model.save_pretrained(directory, safe_serialization=True)
    write_tokenizer(directory)
    return model


def hf_logits(model, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=ids[None], position_ids=positions[None], use_cache=False)
    return out.logits[0].float()


def compare(hf_model, directory, **fwd):
    cfg, ours, tok = load_model(directory)
    assert tok is not None and tok.eos_token_id == 2
    gen = torch.Generator().manual_seed(1)
    a = torch.randint(0, cfg.vocab_size, (7,), generator=gen)
    b = torch.randint(0, cfg.vocab_size, (5,), generator=gen)
    pa, pb = torch.arange(7), torch.arange(90, 95)  # b: a later position range
    ref = torch.cat([hf_logits(hf_model, a, pa), hf_logits(hf_model, b, pb)])
    assert ref.std() > 0.1, "degenerate logits: the comparison would prove little"
    with torch.no_grad():
        got = ours(torch.cat([a, b]), torch.cat([pa, pb]), attention=TorchAttention([7, 5]), **fwd)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=1e-4)
    return cfg, ours


COMMON = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    hf_cfg = transformers.LlamaConfig(
        **COMMON,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        attention_bias=True,
    )
    model = save_hf(hf_cfg, transformers.LlamaForCausalLM, tmp_path)
    cfg, _ = compare(model, tmp_path)
    assert cfg.rope.type == "llama3" and cfg.qkv_bias and cfg.o_bias


def test_qwen2_tied_matches_transformers(tmp_path):
    hf_cfg = transformers.Qwen2Config(**COMMON, tie_word_embeddings=True, rope_theta=1e6)
    model = save_hf(hf_cfg, transformers.Qwen2ForCausalLM, tmp_path)
    cfg, ours = compare(model, tmp_path)
    assert cfg.qkv_bias and not cfg.o_bias and cfg.tie_word_embeddings
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()


def test_qwen3_qk_norm_yarn_matches_transformers(tmp_path):
    hf_cfg = transformers.Qwen3Config(
        **COMMON,
        head_dim=32,  # != hidden / heads
        tie_word_embeddings=False,
        rope_theta=1e6,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    )
    model = save_hf(hf_cfg, transformers.Qwen3ForCausalLM, tmp_path)
    cfg, _ = compare(model, tmp_path)
    assert cfg.qk_norm and cfg.head_dim == 32 and cfg.rope.yarn_cos_sin_factor() > 1.0


def deepseek_hf_config(q_lora_rank):
    return transformers.DeepseekV3Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        n_shared_experts=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rope_scaling={
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,  # != mscale: exercises both the cos/sin and softmax factors
        },
        bos_token_id=1,
        eos_token_id=2,
    )


@pytest.mark.parametrize("q_lora_rank", [32, None])
@pytest.mark.parametrize("absorbed", [True, False])
def test_deepseek_v3_matches_transformers(tmp_path, q_lora_rank, absorbed):
    model = save_hf(deepseek_hf_config(q_lora_rank), transformers.DeepseekV3ForCausalLM, tmp_path)
    cfg, ours = compare(model, tmp_path, absorbed=absorbed)
    assert cfg.sm_scale != cfg.qk_head_dim**-0.5  # the yarn mscale is in play
    counts = ours.moe_expert_counts
    assert counts.shape == (3, 8) and counts[0].sum() == 0  # layer 0 is dense
    assert (counts[1:].sum(-1) == 12 * 3).all()  # 12 tokens x top-3 per MoE layer


def test_kimi_k2_config_loads_as_deepseek_v3(tmp_path):
    model = save_hf(deepseek_hf_config(32), transformers.DeepseekV3ForCausalLM, tmp_path)
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    raw["model_type"] = "kimi_k2"
    path.write_text(json.dumps(raw))
    cfg, _ = compare(model, tmp_path)
    assert cfg.model_type == "kimi_k2" and cfg.topk_method == "noaux_tc"
