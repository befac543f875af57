"""Load a model from a local Hugging Face directory.

Reads config.json, the safetensors weights (model.safetensors.index.json with its shards, or a
single model.safetensors), and tokenizer.json (+ tokenizer_config.json, generation_config.json).
A missing file is a FileNotFoundError naming it; a missing or mismatched key a ValueError naming it.

Weight names: our modules carry the Hugging Face names of Llama/Qwen2/Qwen3 and DeepSeek-V3/Kimi K2
checkpoints ("model.layers.N.self_attn.kv_a_proj_with_mqa.weight", "...mlp.experts.E.gate_proj
.weight", "...mlp.gate.e_score_correction_bias"), so the mapping is the identity, except:
  - "*.weight_scale_inv" (DeepSeek/Kimi FP8 checkpoints): the paired fp8 weight is dequantised by
    blocks (quantization_config.weight_block_size, default 128x128) to the load dtype;
  - layers at index >= num_hidden_layers (DeepSeek-V3's multi-token-prediction layer) and
    "rotary_emb.inv_freq" are skipped;
  - lm_head.weight may be absent when tie_word_embeddings is set.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from treeverify.models.config import DeepseekV3Config, LlamaConfig, config_from_hf_dict
from treeverify.models.deepseek_v3 import DeepseekV3ForCausalLM
from treeverify.models.layers import rope_inv_freq
from treeverify.models.llama import LlamaForCausalLM
from treeverify.models.tokenizer import HFTokenizer
from treeverify.progress import progress

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def _safe_open():
    try:
        from safetensors import safe_open
    except ImportError as exc:
        raise RuntimeError(
            "loader: reading *.safetensors needs the 'safetensors' package "
            "(pip install safetensors)"
        ) from exc
    return safe_open


def read_config(directory: Path) -> tuple[dict, LlamaConfig | DeepseekV3Config]:
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model directory {directory}: config.json not found")
    raw = json.loads(path.read_text())
    return raw, config_from_hf_dict(raw)


def weight_files(directory: Path) -> dict[str, Path]:
    """checkpoint key -> the safetensors file that holds it."""
    safe_open = _safe_open()

    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: missing the required key 'weight_map'")
        files = {}
        for name in sorted(set(weight_map.values())):
            if not (directory / name).is_file():
                raise FileNotFoundError(f"model directory {directory}: shard {name} not found")
            files[name] = directory / name
        return {k: files[v] for k, v in weight_map.items()}
    single = directory / SINGLE_FILE
    if not single.is_file():
        raise FileNotFoundError(
            f"model directory {directory}: neither {INDEX_FILE} nor {SINGLE_FILE} found"
        )
    with safe_open(str(single), "pt") as f:
        return dict.fromkeys(f.keys(), single)


def dequant_fp8_blocks(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]):
    """fp8 weight (out, in) times its per-block scale (ceil(out/bo), ceil(in/bi)) -> fp32."""
    bo, bi = block
    s = scale_inv.float().repeat_interleave(bo, 0).repeat_interleave(bi, 1)
    return w.float() * s[: w.shape[0], : w.shape[1]]


def load_weights(model: torch.nn.Module, cfg, raw: dict, directory: Path) -> None:
    safe_open = _safe_open()

    key_file = weight_files(directory)
    params = dict(model.named_parameters(remove_duplicate=False))
    block = tuple((raw.get("quantization_config") or {}).get("weight_block_size") or (128, 128))
    loaded: set[str] = set()
    unexpected: list[str] = []
    by_file: dict[Path, list[str]] = {}
    for k, f in key_file.items():
        by_file.setdefault(f, []).append(k)
    handles = {}

    def tensor(key: str) -> torch.Tensor:
        f = key_file[key]
        if f not in handles:
            handles[f] = safe_open(str(f), "pt")
        return handles[f].get_tensor(key)

    ordered = [(f, key) for f in sorted(by_file) for key in sorted(by_file[f])]
    for _, key in progress(ordered, "loading weights", unit="tensor"):  # shard by shard
        m = _LAYER_RE.match(key)
        if m and int(m.group(1)) >= cfg.num_hidden_layers:
            continue  # e.g. DeepSeek-V3's MTP layer
        if key.endswith("rotary_emb.inv_freq") or key.endswith(".weight_scale_inv"):
            continue
        if key not in params:
            unexpected.append(key)
            continue
        t = tensor(key)
        scale_key = key[: -len("weight")] + "weight_scale_inv"
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            if scale_key not in key_file:
                raise ValueError(f"checkpoint: fp8 weight {key!r} has no {scale_key!r}")
            t = dequant_fp8_blocks(t, tensor(scale_key), block)
        p = params[key]
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(
                f"checkpoint: {key!r} has shape {tuple(t.shape)}, the model expects "
                f"{tuple(p.shape)} (config.json and weights disagree)"
            )
        with torch.no_grad():
            p.copy_(t.to(p.dtype))
        loaded.add(key)
    if unexpected:
        raise ValueError(
            f"checkpoint: {len(unexpected)} unexpected key(s), e.g. {unexpected[:3]} "
            f"(an architecture this loader does not map?)"
        )
    missing = sorted(set(params) - loaded)
    if cfg.tie_word_embeddings and "lm_head.weight" in missing:
        missing.remove("lm_head.weight")
    if missing:
        raise ValueError(
            f"checkpoint: {len(missing)} weight(s) missing, e.g. {missing[:3]} "
            f"(incomplete download or a missing shard?)"
        )


def load_generation_eos(directory: Path) -> list[int]:
    path = directory / "generation_config.json"
    if not path.is_file():
        return []
    v = json.loads(path.read_text()).get("eos_token_id")
    if v is None:
        return []
    return [int(x) for x in v] if isinstance(v, list) else [int(v)]


def load_pretrained(
    directory: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tokenizer: bool = True,
):
    """(config, model, tokenizer) from a local Hugging Face directory; model in eval mode."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"model directory {directory} not found")
    raw, cfg = read_config(directory)
    cls = LlamaForCausalLM if isinstance(cfg, LlamaConfig) else DeepseekV3ForCausalLM
    with torch.device("meta"):
        model = cls(cfg)
    model = model.to_empty(device=device).to(dtype).requires_grad_(False)
    if isinstance(model, DeepseekV3ForCausalLM):
        model.keep_router_fp32()
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # Buffers are not in the checkpoint: rebuild them on the target device.
    rot_dim = cfg.head_dim if isinstance(cfg, LlamaConfig) else cfg.qk_rope_head_dim
    model.rope.inv_freq = rope_inv_freq(cfg.rope, rot_dim).to(device)
    if isinstance(model, DeepseekV3ForCausalLM):
        model.moe_expert_counts.zero_()
    load_weights(model, cfg, raw, directory)
    tok = None
    if tokenizer:
        eos = list(dict.fromkeys(cfg.eos_token_ids + load_generation_eos(directory)))
        tok = HFTokenizer(directory, eos_token_ids=eos)
    return cfg, model.eval(), tok
