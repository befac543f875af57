"""MLA: the absorbed form (one latent KV head of kv_lora_rank + qk_rope, V = the latent) equals
the naive per-head form, in the layout treeverify's MLA kernels take; and both model families run
their attention through `treeverify.kernels.tree_attention` on a paged cache unchanged."""

from __future__ import annotations

import math

import pytest
import torch

from treeverify.kernels import tree_attention
from treeverify.models import TorchAttention, load_model
from treeverify.models.config import DeepseekV3Config, RopeConfig
from treeverify.models.deepseek_v3 import DeepseekV3ForCausalLM
from treeverify.models.tiny import init_random_weights


class Recorder(TorchAttention):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __call__(self, layer, q, k, v, sm_scale, v_head_dim=None):
        self.calls.append((layer, q, k, v, sm_scale, v_head_dim))
        return super().__call__(layer, q, k, v, sm_scale, v_head_dim)


def test_absorbed_equals_naive_tiny_kimi_and_kernel_layout():
    cfg, model, tok = load_model("tiny-kimi")
    ids = torch.tensor(tok.encode("absorbed == naive?", add_bos=True))
    pos = torch.arange(len(ids)) + 3
    rec = Recorder()
    with torch.no_grad():
        absorbed = model(ids, pos, attention=rec, absorbed=True)
        naive = model(ids, pos, absorbed=False)
    torch.testing.assert_close(absorbed, naive, atol=1e-5, rtol=1e-5)
    # The kernel layout: Q (T, H, 576), one latent K head (T, 1, 576), V = K[..., :512].
    layer, q, k, v, sm_scale, v_head_dim = rec.calls[0]
    t = len(ids)
    assert q.shape == (t, cfg.num_attention_heads, 576) and k.shape == (t, 1, 576)
    assert v is None and v_head_dim == 512
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        x = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
        latent = attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(x)[:, :512])
    torch.testing.assert_close(k[:, 0, :512], latent)
    mscale = 0.1 * 1.0 * math.log(4.0) + 1.0  # yarn factor 4, mscale_all_dim 1
    assert sm_scale == pytest.approx((32 + 64) ** -0.5 * mscale**2)


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_absorbed_equals_naive_random_config(q_lora_rank):
    cfg = DeepseekV3Config(
        vocab_size=50, hidden_size=48, num_hidden_layers=2, num_attention_heads=3,
        intermediate_size=64, q_lora_rank=q_lora_rank, kv_lora_rank=40, qk_nope_head_dim=20,
        qk_rope_head_dim=12, v_head_dim=28, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, first_k_dense_replace=1,
        rope=RopeConfig(type="yarn", factor=8.0, original_max_position_embeddings=32,
                        mscale=0.9, mscale_all_dim=0.7),
    )  # fmt: skip
    model = DeepseekV3ForCausalLM(cfg).eval()
    init_random_weights(model, seed=5)
    ids = torch.randint(0, 50, (9,), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(9) * 7
    with torch.no_grad():
        a = model(ids, pos, absorbed=True)
        b = model(ids, pos, absorbed=False)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def mask_words(visible: torch.Tensor) -> torch.Tensor:
    """(T, T) bool -> (T, ceil(T/32)) int32 words: bit j of word j//32 set when j is visible."""
    t = visible.shape[0]
    words = torch.zeros(t, (t + 31) // 32, dtype=torch.int64)
    for j in range(t):
        words[:, j // 32] |= visible[:, j].long() << (j % 32)
    return words.to(torch.int32)


class PagedTreeAttention:
    """A minimal stand-in for the engine: one request, KV written into pages, tree_attention."""

    def __init__(self, page_size=4, num_pages=16):
        self.page_size, self.num_pages = page_size, num_pages
        self.k, self.v = {}, {}
        self.prefix, self.visible = 0, None

    def step(self, visible: torch.Tensor):  # the next call's tree mask over its tokens
        self.visible = visible
        return self

    def commit(self, n):
        self.prefix += n

    def __call__(self, layer, q, k, v, sm_scale, v_head_dim=None):
        t = q.shape[0]
        if layer not in self.k:
            self.k[layer] = k.new_zeros(self.num_pages, self.page_size, *k.shape[1:])
            if v is not None:
                self.v[layer] = v.new_zeros(self.num_pages, self.page_size, *v.shape[1:])
        slots = torch.arange(self.prefix, self.prefix + t)
        pages = slots // self.page_size
        self.k[layer][pages, slots % self.page_size] = k
        if v is not None:
            self.v[layer][pages, slots % self.page_size] = v
        block_table = torch.arange(self.num_pages, dtype=torch.int32)[None]  # (1, pages)
        return tree_attention(
            q, self.k[layer], self.v.get(layer), block_table,
            torch.tensor([self.prefix], dtype=torch.int32),
            torch.tensor([0, t], dtype=torch.int32), mask_words(self.visible), sm_scale,
            v_head_dim=v_head_dim, backend="torch",
        )  # fmt: skip


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-kimi"])
def test_tree_verify_through_paged_tree_attention(name):
    """Prefill a prompt, then verify a tree in one forward (root r = the prompt's last token;
    a, b children of r; c child of a): each node's logits equal a plain causal forward over the
    prompt + its root-to-node path."""
    _, model, tok = load_model(name)
    prompt = tok.encode("tree", add_bos=True)
    r, (a, b, c) = prompt[-1], tok.encode("xyz")
    p = len(prompt) - 1  # cached prefix
    paged = PagedTreeAttention()
    causal = torch.ones(p, p).tril().bool()
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]).bool()
    with torch.no_grad():
        model(torch.tensor(prompt[:-1]), torch.arange(p), attention=paged.step(causal))
        paged.commit(p)
        nodes, depth = torch.tensor([r, a, b, c]), torch.tensor([0, 1, 1, 2])
        got = model(nodes, p + depth, attention=paged.step(tree))
        for row, path in ((0, []), (1, [a]), (2, [b]), (3, [a, c])):
            ids = torch.tensor(prompt + path)
            want = model(ids, torch.arange(len(ids)))[-1]
            torch.testing.assert_close(got[row], want, atol=1e-5, rtol=1e-5)
