"""The DFlash drafter: config parsing, checkpoint round trip, and propose() against an independent
per-sequence implementation, batching/padding invariance. CPU, fp32, tiny models."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from treeverify.models.tiny import build_tiny
from treeverify.spec.dflash import DFlashDrafter
from treeverify.spec.dflash_config import DFlashConfig, default_target_layer_ids
from treeverify.spec.dflash_io import load_dflash, save_dflash, tiny_dflash

safetensors_torch = pytest.importorskip("safetensors.torch")

# The layout of the published z-lab/Qwen3-8B-DFlash-b16 config.json (see docs/dflash.md).
PUBLISHED_8B = {
    "architectures": ["DFlashDraftModel"],
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "block_size": 16,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "dtype": "bfloat16",
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "layer_types": ["full_attention"] * 5,
    "max_position_embeddings": 40960,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 5,
    "num_key_value_heads": 8,
    "num_target_layers": 36,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


@pytest.fixture(scope="module")
def target():
    cfg, model, _ = build_tiny("tiny-llama", seed=0)
    return cfg, model


@pytest.fixture(scope="module")
def drafter(target):
    cfg, model = target
    return tiny_dflash(
        cfg, seed=1, target_embed=model.model.embed_tokens, target_lm_head=model.lm_head
    )


def _inputs(drafter: DFlashDrafter, lens: list[int], pad_to: int | None = None, seed: int = 0):
    """Random context rows (B, C, F), lens (B,), last tokens (B,); padding rows are zeros."""
    gen = torch.Generator().manual_seed(seed)
    c = pad_to if pad_to is not None else max(lens)
    feats = drafter.config.context_features
    hidden = torch.zeros(len(lens), c, feats)
    for b, n in enumerate(lens):
        hidden[b, :n] = torch.randn(n, feats, generator=gen)
    vocab = drafter.config.vocab_size
    last = torch.randint(0, vocab, (len(lens),), generator=gen)
    return hidden, torch.tensor(lens), last


# ---------------------------------------------------------------------------------------------
# An independent, straightforward implementation: one sequence, explicit attention math.
# ---------------------------------------------------------------------------------------------


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x (n, heads, D) at positions pos (n,): rotate-half RoPE."""
    d = x.shape[-1]
    half = d // 2
    inv = 1.0 / theta ** (torch.arange(half, dtype=torch.float32) * 2 / d)  # (D/2,)
    ang = pos.float()[:, None] * inv[None, :]  # (n, D/2)
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def reference_propose(
    drafter: DFlashDrafter,
    embed_w: torch.Tensor,
    head_w: torch.Tensor,
    feats: torch.Tensor,  # (c, F) this sequence's valid context rows only
    last_token: int,
    depth: int,
    start: int = 0,
) -> torch.Tensor:  # (depth, V)
    cfg = drafter.config
    w = drafter.state_dict()
    eps, t, c = cfg.rms_norm_eps, cfg.block_size, feats.shape[0]
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    ctx = _rms(feats @ w["fc.weight"].T, w["hidden_norm.weight"], eps)  # (c, H)
    x = embed_w[torch.tensor([last_token] + [cfg.mask_token_id] * (t - 1))]  # (T, H)
    pos_k = torch.arange(start, start + c + t)
    pos_q = pos_k[c:]
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        hn = _rms(x, w[p + "input_layernorm.weight"], eps)
        kv = torch.cat([ctx, hn])  # (c + T, H)
        q = (hn @ w[p + "self_attn.q_proj.weight"].T).view(t, hq, d)
        k = (kv @ w[p + "self_attn.k_proj.weight"].T).view(c + t, hkv, d)
        v = (kv @ w[p + "self_attn.v_proj.weight"].T).view(c + t, hkv, d)
        q = _rotate(_rms(q, w[p + "self_attn.q_norm.weight"], eps), pos_q, cfg.rope.theta)
        k = _rotate(_rms(k, w[p + "self_attn.k_norm.weight"], eps), pos_k, cfg.rope.theta)
        out = torch.zeros(t, hq, d)
        for h in range(hq):
            g = h // (hq // hkv)
            att = torch.softmax(q[:, h] @ k[:, g].T / math.sqrt(d), dim=-1)  # (T, c + T)
            out[:, h] = att @ v[:, g]
        x = x + out.reshape(t, hq * d) @ w[p + "self_attn.o_proj.weight"].T
        hn = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        gate = F.silu(hn @ w[p + "mlp.gate_proj.weight"].T)
        x = x + (gate * (hn @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return _rms(x, w["norm.weight"], eps)[1 : 1 + depth] @ head_w.T


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


def test_config_parses_published_layout():
    cfg = DFlashConfig.from_hf_dict(PUBLISHED_8B)
    assert cfg.block_size == 16 and cfg.mask_token_id == 151669
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33]
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == (4096, 5, 12288)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 8, 128)
    assert cfg.rope.theta == 1e6 and cfg.rope.type == "default"
    assert cfg.context_features == 5 * 4096 and cfg.vocab_size == 151936


def test_config_top_level_layout_and_layer_fallback():
    d = {k: v for k, v in PUBLISHED_8B.items() if k not in ("dflash_config", "block_size")}
    d["mask_token_id"] = 7  # top-level, as some exports have it
    d["dflash_config"] = {"block_size": 8}  # nested, as others have it
    cfg = DFlashConfig.from_hf_dict(d)
    assert (cfg.mask_token_id, cfg.block_size) == (7, 8)
    # No target_layer_ids: the published fallback from num_target_layers (36 -> 1..33 by 8).
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33] == default_target_layer_ids(36, 5)


@pytest.mark.parametrize(
    "key",
    [
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "block_size",
        "mask_token_id",
        "target_layer_ids",
    ],  # fmt: skip
)
def test_config_missing_key_is_named(key):
    d = json.loads(json.dumps(PUBLISHED_8B))
    d.pop(key, None)
    d["dflash_config"].pop(key, None)
    if key == "target_layer_ids":
        d.pop("num_target_layers")
    with pytest.raises(ValueError, match=repr(key)):
        DFlashConfig.from_hf_dict(d)


@pytest.mark.parametrize(
    "patch, named",
    [
        ({"architectures": ["DFlash2DraftModel"]}, "architectures"),
        ({"layer_types": ["sliding_attention"] * 5}, "layer_types"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"is_causal": True}, "is_causal"),
    ],
)
def test_config_rejects_other_variants(patch, named):
    with pytest.raises(ValueError, match=named):
        DFlashConfig.from_hf_dict({**PUBLISHED_8B, **patch})


@pytest.mark.parametrize("ids", [[9, 1, 17, 25, 33], [1, 9, 9, 17, 25], [-1, 9]])
def test_config_target_layers_must_increase(ids):
    """The target hands its tapped layers over side by side in layer order (fused_ops'
    residual_stream), so a drafter that lists them in another order, or twice, would read
    another layer's columns: refused, naming the key."""
    d = json.loads(json.dumps(PUBLISHED_8B))
    d["dflash_config"]["target_layer_ids"] = ids
    with pytest.raises(ValueError, match="target_layer_ids: expected a non-empty increasing"):
        DFlashConfig.from_hf_dict(d)


def test_parameter_names_are_the_published_ones(drafter):
    names = set(drafter.state_dict())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names
    per_layer = {
        "input_layernorm.weight", "post_attention_layernorm.weight",
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    }  # fmt: skip
    n = drafter.config.num_hidden_layers
    assert names == {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{s}" for i in range(n) for s in per_layer
    }
    # The target's embedding/lm_head are borrowed, not part of the drafter's checkpoint.
    assert drafter.state_dict()["fc.weight"].shape == (128, 2 * 128)


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------


def test_save_load_round_trip(tmp_path, target, drafter):
    cfg, model = target
    save_dflash(drafter, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["dflash_config"]["target_layer_ids"] == drafter.target_layer_ids
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["block_size"] == 16
    loaded = load_dflash(
        tmp_path, model.model.embed_tokens, model.lm_head, dtype=torch.float32, device="cpu"
    )
    assert loaded.config == drafter.config
    hidden, lens, last = _inputs(drafter, [5, 2, 9])
    assert torch.equal(
        loaded.propose(hidden, lens, last, 15), drafter.propose(hidden, lens, last, 15)
    )
    assert loaded.rope.inv_freq.dtype == torch.float32


def test_load_bf16_keeps_rope_fp32(tmp_path, target, drafter):
    _, model = target
    save_dflash(drafter, tmp_path)
    loaded = load_dflash(tmp_path, model.model.embed_tokens, model.lm_head, dtype=torch.bfloat16)
    assert loaded.fc.weight.dtype == torch.bfloat16
    assert loaded.rope.inv_freq.dtype == torch.float32
    assert torch.equal(loaded.rope.inv_freq, drafter.rope.inv_freq)


def test_load_errors_name_the_file_or_tensor(tmp_path, target, drafter):
    _, model = target
    embed, head = model.model.embed_tokens, model.lm_head
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_dflash(tmp_path, embed, head, torch.float32)
    save_dflash(drafter, tmp_path)
    weights = tmp_path / "model.safetensors"
    tensors = safetensors_torch.load_file(str(weights))
    weights.unlink()
    with pytest.raises(FileNotFoundError, match=r"\*\.safetensors"):
        load_dflash(tmp_path, embed, head, torch.float32)

    missing = dict(tensors)
    missing.pop("layers.1.mlp.up_proj.weight")
    safetensors_torch.save_file(missing, str(weights))
    with pytest.raises(ValueError, match="layers.1.mlp.up_proj.weight"):
        load_dflash(tmp_path, embed, head, torch.float32)

    extra = {**tensors, "candidate_selector.hidden_projection.weight": torch.zeros(2, 2)}
    safetensors_torch.save_file(extra, str(weights))
    with pytest.raises(ValueError, match="candidate_selector.hidden_projection.weight"):
        load_dflash(tmp_path, embed, head, torch.float32)

    bad = {**tensors, "fc.weight": torch.zeros(3, 3)}
    safetensors_torch.save_file(bad, str(weights))
    with pytest.raises(ValueError, match="fc.weight"):
        load_dflash(tmp_path, embed, head, torch.float32)

    # A "model." prefix (some exports add one) loads to the same weights.
    prefixed = {f"model.{k}": v for k, v in tensors.items()}
    safetensors_torch.save_file(prefixed, str(weights))
    loaded = load_dflash(tmp_path, embed, head, torch.float32)
    for k, v in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_attach_target_checks_shapes(target):
    cfg, model = target
    d = tiny_dflash(cfg, seed=3)
    with pytest.raises(RuntimeError, match="attach_target"):
        d.propose(*_inputs(d, [3]), 2)
    with pytest.raises(ValueError, match="embedding_dim"):
        d.attach_target(torch.nn.Embedding(cfg.vocab_size, 64), model.lm_head)
    with pytest.raises(ValueError, match="vocab_size"):
        d.attach_target(model.model.embed_tokens, torch.nn.Linear(128, 10, bias=False))
    with pytest.raises(ValueError, match="mask_token_id"):
        d.attach_target(torch.nn.Embedding(100, 128), model.lm_head)


# ---------------------------------------------------------------------------------------------
# propose()
# ---------------------------------------------------------------------------------------------


def test_propose_applies_output_multiplier_and_softcap(drafter):
    """An fp32 drafter with an output multiplier and a final softcap rescales its logits
    (logits_dtype() is fp32 there too: the early return kept for bf16 on CUDA only)."""
    hidden, lens, last = _inputs(drafter, [5, 3], seed=7)
    plain = drafter.propose(hidden, lens, last, depth=6)
    cfg = drafter.config
    try:
        cfg.output_multiplier, cfg.final_logit_softcapping = 2.0, 3.0
        assert drafter.logits_dtype() == torch.float32
        got = drafter.propose(hidden, lens, last, depth=6)
    finally:
        cfg.output_multiplier, cfg.final_logit_softcapping = 1.0, None
    torch.testing.assert_close(got, torch.tanh(plain * 2.0 / 3.0) * 3.0)
    assert got.abs().max() < 3.0


def test_propose_shapes_dtype_finite(drafter):
    hidden, lens, last = _inputs(drafter, [4, 1, 7], pad_to=10, seed=5)
    out = drafter.propose(hidden, lens, last, depth=15)
    assert out.shape == (3, 15, drafter.config.vocab_size)
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match="depth"):
        drafter.propose(hidden, lens, last, depth=0)
    with pytest.raises(ValueError, match="depth"):
        drafter.propose(hidden, lens, last, depth=16)
    with pytest.raises(ValueError, match="context_hidden"):
        drafter.propose(hidden[..., :-1], lens, last, depth=3)


def test_propose_equals_independent_implementation(target, drafter):
    _, model = target
    embed_w, head_w = model.model.embed_tokens.weight, model.lm_head.weight
    lens = [6, 1, 11, 3]
    hidden, lens_t, last = _inputs(drafter, lens, pad_to=13, seed=7)
    out = drafter.propose(hidden, lens_t, last, depth=15)
    for b, n in enumerate(lens):
        ref = reference_propose(drafter, embed_w, head_w, hidden[b, :n], int(last[b]), 15)
        torch.testing.assert_close(out[b], ref, atol=1e-5, rtol=1e-4)


def test_context_start_is_a_pure_shift(target, drafter):
    """RoPE only sees position differences: absolute positions (the reference's) give the same
    logits as the relative ones; and both match the independent implementation."""
    _, model = target
    hidden, lens, last = _inputs(drafter, [5, 8], seed=11)
    rel = drafter.propose(hidden, lens, last, 15)
    start = torch.tensor([37, 120])
    absolute = drafter.propose(hidden, lens, last, 15, context_start=start)
    torch.testing.assert_close(absolute, rel, atol=1e-4, rtol=1e-4)
    ref = reference_propose(
        drafter, model.model.embed_tokens.weight, model.lm_head.weight,
        hidden[1, :8], int(last[1]), 15, start=120,
    )  # fmt: skip
    torch.testing.assert_close(absolute[1], ref, atol=1e-5, rtol=1e-4)


def test_batching_invariance(drafter):
    lens = [9, 2, 5]
    hidden, lens_t, last = _inputs(drafter, lens, pad_to=12, seed=13)
    batched = drafter.propose(hidden, lens_t, last, depth=15)
    for b, n in enumerate(lens):
        alone = drafter.propose(hidden[b : b + 1, :n], lens_t[b : b + 1], last[b : b + 1], 15)
        torch.testing.assert_close(batched[b : b + 1], alone, atol=1e-5, rtol=0)


def test_depth_returns_the_first_positions(drafter):
    hidden, lens, last = _inputs(drafter, [4, 7], seed=17)
    full = drafter.propose(hidden, lens, last, depth=15)
    for depth in (1, 3, 8, 14):
        part = drafter.propose(hidden, lens, last, depth=depth)
        assert part.shape == (2, depth, drafter.config.vocab_size)
        torch.testing.assert_close(part, full[:, :depth], atol=1e-6, rtol=0)


def test_padding_rows_cannot_influence_results(drafter):
    lens = [3, 10, 6]
    hidden, lens_t, last = _inputs(drafter, lens, pad_to=10, seed=19)
    clean = drafter.propose(hidden, lens_t, last, depth=15)
    gen = torch.Generator().manual_seed(23)
    poisoned = hidden.clone()
    for b, n in enumerate(lens):
        pad = poisoned[b, n:]
        pad.copy_(1e6 * torch.randn(pad.shape, generator=gen))
    poisoned[0, 5, :7] = float("nan")
    poisoned[2, 8, :3] = float("inf")
    assert torch.equal(drafter.propose(poisoned, lens_t, last, depth=15), clean)
    # ...while a valid row does matter (the check above is not vacuous).
    changed = hidden.clone()
    changed[0, 1] = torch.randn(changed.shape[-1], generator=gen)
    moved = drafter.propose(changed, lens_t, last, depth=15)
    assert (moved[0] - clean[0]).abs().max() > 1e-3
    assert torch.equal(moved[1:], clean[1:])


def test_drafts_from_real_target_hidden_states(target, drafter):
    """End to end on the tiny target: capture the outputs of the decoder layers the drafter
    names, feed them as context, and draft; the last committed token conditions the block."""
    _, model = target
    model.capture_layers = frozenset(drafter.target_layer_ids)  # the model's own taps
    try:
        ids = torch.tensor([256, 72, 101, 108, 108, 111])
        model(ids, torch.arange(len(ids)))
        ctx = model.captured  # (T, 2H): the named layers' outputs, concatenated
    finally:
        model.capture_layers = frozenset()
    hidden, lens = ctx[None], torch.tensor([len(ids)])
    a = drafter.propose(hidden, lens, torch.tensor([44]), depth=15)
    b = drafter.propose(hidden, lens, torch.tensor([45]), depth=15)
    assert a.shape == (1, 15, 259) and torch.isfinite(a).all()
    assert not torch.allclose(a, b)


def test_tiny_dflash_is_seeded(target):
    cfg, _ = target
    a, b, c = tiny_dflash(cfg, seed=4), tiny_dflash(cfg, seed=4), tiny_dflash(cfg, seed=5)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.fc.weight, c.fc.weight)
    assert a.target_layer_ids == [0, 1] and a.block_size == 16
    assert a.mask_token_id == cfg.vocab_size - 1
