"""The loader: a tiny model written in Hugging Face layout loads back (single file, sharded, FP8
blocks); a wrong or incomplete directory names the missing file or key."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch")
pytest.importorskip("tokenizers")

from treeverify.models import load_model  # noqa: E402
from treeverify.models.config import DeepseekV3Config, LlamaConfig  # noqa: E402
from treeverify.models.loader import dequant_fp8_blocks  # noqa: E402

TINY_LLAMA_HF = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 259,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 256,
    "eos_token_id": 257,
}


def write_tokenizer(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}})
    )


@pytest.fixture
def tiny_dir(tmp_path):
    """tiny-llama written as a Hugging Face directory (single safetensors file)."""
    _, model, _ = load_model("tiny-llama")
    d = tmp_path / "tiny"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY_LLAMA_HF))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    safetensors_torch.save_file(state, str(d / "model.safetensors"))
    write_tokenizer(d)
    return d, model


def logits(model):
    with torch.no_grad():
        return model(torch.tensor([256, 1, 2, 3]), torch.arange(4))


def test_loads_back_single_file(tiny_dir):
    d, ref = tiny_dir
    cfg, model, tok = load_model(d)
    assert isinstance(cfg, LlamaConfig) and cfg.eos_token_ids == [257]
    assert torch.equal(logits(model), logits(ref))
    assert tok.encode("hello world") == [3, 4] and tok.decode([3, 4]) == "hello world"
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2
    assert tok.eos_token_ids == [257, 2]  # config.json's, then the tokenizer's own


def test_loads_back_sharded(tiny_dir):
    d, ref = tiny_dir
    state = safetensors_torch.load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[::2],
              "model-00002-of-00002.safetensors": keys[1::2]}  # fmt: skip
    weight_map = {}
    for name, ks in shards.items():
        safetensors_torch.save_file({k: state[k] for k in ks}, str(d / name))
        weight_map.update(dict.fromkeys(ks, name))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _, model, _ = load_model(d)
    assert torch.equal(logits(model), logits(ref))
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load_model(d)


def test_missing_files_are_named(tiny_dir, tmp_path):
    d, _ = tiny_dir
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_model(tmp_path / "nowhere")
    for missing, pattern in (("tokenizer.json", "tokenizer.json"),
                             ("model.safetensors", "model.safetensors"),
                             ("config.json", "config.json")):  # fmt: skip
        broken = tmp_path / f"no-{missing}"
        shutil.copytree(d, broken)
        (broken / missing).unlink()
        with pytest.raises(FileNotFoundError, match=pattern.replace(".", r"\.")):
            load_model(broken)


def test_tokenizer_optional_and_chat_template(tiny_dir):
    d, ref = tiny_dir
    (d / "tokenizer.json").unlink()
    _, model, tok = load_model(d, tokenizer=False)
    assert tok is None and torch.equal(logits(model), logits(ref))
    write_tokenizer(d)
    raw = json.loads((d / "tokenizer_config.json").read_text())
    raw["chat_template"] = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (d / "tokenizer_config.json").write_text(json.dumps(raw))
    tok = load_model(d)[2]
    try:
        import jinja2  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="jinja2"):
            tok.apply_chat_template([{"role": "user", "content": "hello"}])
    else:
        assert tok.apply_chat_template([{"role": "user", "content": "hello"}]) == "hello "


def test_config_errors_name_the_key(tiny_dir):
    d, _ = tiny_dir
    for key in ("hidden_size", "vocab_size", "num_hidden_layers"):
        raw = dict(TINY_LLAMA_HF)
        del raw[key]
        (d / "config.json").write_text(json.dumps(raw))
        with pytest.raises(ValueError, match=key):
            load_model(d)
    raw = dict(TINY_LLAMA_HF, model_type="gpt2")
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="gpt2"):
        load_model(d)
    raw = {k: v for k, v in TINY_LLAMA_HF.items() if k != "model_type"}
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="model_type"):
        load_model(d)


def test_weight_errors_name_the_key(tiny_dir):
    d, _ = tiny_dir
    state = safetensors_torch.load_file(str(d / "model.safetensors"))
    dropped = dict(state)
    del dropped["model.layers.1.mlp.up_proj.weight"]
    safetensors_torch.save_file(dropped, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(d)
    extra = dict(state, **{"model.layers.0.mlp.surprise.weight": torch.zeros(2)})
    safetensors_torch.save_file(extra, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="surprise"):
        load_model(d)
    raw = dict(TINY_LLAMA_HF, intermediate_size=200)  # config and weights disagree
    safetensors_torch.save_file(state, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight' has shape"):
        load_model(d)


def test_rope_scaling_errors_name_the_key():
    raw = dict(TINY_LLAMA_HF, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        LlamaConfig.from_hf_dict(raw)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        DeepseekV3Config.from_hf_dict({"model_type": "kimi_k2", "vocab_size": 8, "hidden_size": 8,
                                       "num_hidden_layers": 1, "num_attention_heads": 1,
                                       "intermediate_size": 8})  # fmt: skip


def test_fp8_block_dequant(tiny_dir):
    """DeepSeek/Kimi FP8 checkpoints: weight (fp8) x weight_scale_inv per 128x128 block."""
    d, ref = tiny_dir
    state = safetensors_torch.load_file(str(d / "model.safetensors"))
    key = "model.layers.0.mlp.down_proj.weight"  # (128, 256): 1 x 2 blocks
    w = state[key]
    scale = torch.tensor([[0.5, 2.0]])
    q = (w / scale.repeat_interleave(128, 0).repeat_interleave(128, 1)).to(torch.float8_e4m3fn)
    state[key] = q
    state[key + "_scale_inv"] = scale
    safetensors_torch.save_file(state, str(d / "model.safetensors"))
    _, model, _ = load_model(d)
    loaded = model.model.layers[0].mlp.down_proj.weight
    torch.testing.assert_close(loaded, dequant_fp8_blocks(q, scale, (128, 128)))
    torch.testing.assert_close(loaded, w, atol=0.1 * w.abs().max().item(), rtol=0.1)
