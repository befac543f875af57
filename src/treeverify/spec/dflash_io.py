"""DFlash checkpoints: load from a local directory in the published layout (config.json +
*.safetensors, parameter names as published), write that layout back, and a tiny seeded drafter
for tests. Errors name the missing file or tensor."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from treeverify.models.config import LlamaConfig, RopeConfig
from treeverify.spec.dflash import DFlashDrafter
from treeverify.spec.dflash_config import CONFIG_FILE, WEIGHTS_FILE, DFlashConfig


def _safetensors():
    try:
        import safetensors.torch as st
        from safetensors import safe_open
    except ImportError as exc:
        raise RuntimeError(
            "dflash: reading/writing *.safetensors needs the 'safetensors' package "
            "(pip install safetensors)"
        ) from exc
    return safe_open, st


def read_dflash_config(directory: str | Path) -> DFlashConfig:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"dflash directory {directory}: {CONFIG_FILE} not found")
    return DFlashConfig.from_hf_dict(json.loads(path.read_text()))


@torch.no_grad()
def load_dflash(
    path: str | Path,
    target_embed: nn.Embedding,
    target_lm_head: nn.Linear,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
) -> DFlashDrafter:
    """A drafter from a local directory: config.json + *.safetensors (published names).

    A missing file is a FileNotFoundError naming it; a missing, unexpected or mis-shaped tensor a
    ValueError naming it. A "model." prefix on tensor names is accepted; "rotary_emb.inv_freq"
    is skipped. Returns the drafter in eval mode, without gradients, attached to the target.
    """
    directory = Path(path)
    cfg = read_dflash_config(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"dflash directory {directory}: no *.safetensors file found")
    safe_open, _ = _safetensors()

    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    model = model.to(dtype=dtype).to_empty(device=device)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    unexpected: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if key.endswith("rotary_emb.inv_freq"):
                    continue
                name = key.removeprefix("model.") if key not in params else key
                if name not in params:
                    unexpected.append(key)
                    continue
                if name in loaded:
                    raise ValueError(f"dflash weights: tensor {key!r} appears twice ({file.name})")
                tensor = f.get_tensor(key)
                if tuple(tensor.shape) != tuple(params[name].shape):
                    raise ValueError(
                        f"dflash weights: tensor {key!r} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(params[name].shape)}"
                    )
                params[name].copy_(tensor.to(dtype))
                loaded.add(name)
    if unexpected:
        raise ValueError(f"dflash weights: unexpected tensors {sorted(unexpected)[:8]}")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"dflash weights: missing tensors {missing[:8]}")
    model.attach_target(target_embed, target_lm_head)
    return model.requires_grad_(False).eval()


def save_dflash(drafter: DFlashDrafter, path: str | Path) -> None:
    """Write config.json + model.safetensors in the published format (what load_dflash reads)."""
    _, st = _safetensors()
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = drafter.fc.weight.dtype
    (directory / CONFIG_FILE).write_text(json.dumps(drafter.config.to_hf_dict(dtype), indent=2))
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in drafter.state_dict().items()}
    st.save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})


def tiny_dflash(
    target_config: LlamaConfig,
    seed: int = 0,
    *,
    target_embed: nn.Embedding | None = None,
    target_lm_head: nn.Linear | None = None,
    block_size: int = 16,
    num_hidden_layers: int = 2,
    target_layer_ids: list[int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> DFlashDrafter:
    """A small seeded random drafter matched to a (tiny) target: its hidden size and vocab.

    GQA 4 query / 2 KV heads of 32; mask token = the target's last vocab id (the byte
    tokenizer's PAD); target layers: the first two of the target's (all of tiny-llama's).
    Weights as models.tiny draws them (same seed, same weights anywhere). In eval mode, on CPU.
    """
    from treeverify.models.tiny import init_random_weights

    n_target = target_config.num_hidden_layers
    cfg = DFlashConfig(
        hidden_size=target_config.hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=2 * target_config.hidden_size,
        block_size=block_size,
        mask_token_id=target_config.vocab_size - 1,
        target_layer_ids=list(target_layer_ids or range(min(2, n_target))),
        vocab_size=target_config.vocab_size,
        num_target_layers=n_target,
        rms_norm_eps=target_config.rms_norm_eps,
        rope=RopeConfig(theta=target_config.rope.theta),
    )
    model = DFlashDrafter(cfg)
    init_random_weights(model, seed)
    model = model.to(dtype).requires_grad_(False).eval()
    if target_embed is not None or target_lm_head is not None:
        if target_embed is None or target_lm_head is None:
            raise ValueError("target_embed/target_lm_head: give both or neither")
        model.attach_target(target_embed, target_lm_head)
    return model
