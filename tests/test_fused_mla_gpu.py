"""models/fused_mla.py on a GPU: the packed MLA operands bit-equal to the PyTorch path
(apply_rope, then cat), both rotary layouts; random:mla-moe's logits equal with the kernel on
and off (TREEVERIFY_FUSED_MLA_ROPE; the kernel counted, so a silent fallback fails the test),
eager, fresh random weights and tokens."""

from __future__ import annotations

import pytest
import torch

from treeverify.models import fused_mla
from treeverify.models.config import RopeConfig
from treeverify.models.layers import Rope, apply_rope

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BF16 = torch.bfloat16


@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "rotate-half"])
@pytest.mark.parametrize("t,h,n,lat,r", [(1, 16, 128, 512, 64), (17, 8, 128, 512, 64),
                                         (5, 4, 16, 64, 16)])  # fmt: skip
def test_pack_is_bit_equal_to_apply_rope_then_cat(t, h, n, lat, r, interleave):
    g = torch.Generator(device="cuda").manual_seed(t * h + r)
    q = torch.randn(t, h, n + r, device="cuda", generator=g).to(BF16)
    w_uk = (torch.randn(h, n, lat, device="cuda", generator=g) / n**0.5).to(BF16)
    q_lat = torch.einsum("thn,hnl->thl", q[..., :n], w_uk)  # (T, H, L)
    kv_a = torch.randn(t, lat + r, device="cuda", generator=g).to(BF16)
    ckv, k_pe = kv_a.split([lat, r], dim=-1)
    ckv = ckv.contiguous()
    positions = torch.randint(0, 30000, (t,), device="cuda", generator=g)
    rope = Rope(RopeConfig(theta=10000.0), r).cuda()
    cos, sin = rope(positions)  # (T, R/2) fp32
    packed = fused_mla.mla_rope_pack(q_lat, q, ckv, k_pe, cos, sin, interleave)
    assert packed is not None
    qa, ka = packed
    want_qa = torch.cat((q_lat, apply_rope(q[..., n:], cos, sin, interleave)), -1)
    want_ka = torch.cat((ckv[:, None, :], apply_rope(k_pe[:, None, :], cos, sin, interleave)), -1)
    assert torch.equal(qa, want_qa)
    assert torch.equal(ka, want_ka)


def test_mla_moe_logits_equal_with_the_kernel_on_and_off(monkeypatch):
    from treeverify.models.random_shapes import build_random

    launches = []
    real = fused_mla._launch
    monkeypatch.setattr(fused_mla, "_launch", lambda *a: launches.append(1) or real(*a))
    logits = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("TREEVERIFY_FUSED_MLA_ROPE", flag)
        _, model, _ = build_random("random:mla-moe", dtype=BF16, device="cuda", seed=3)
        assert all(layer.self_attn.fused_rope == (flag == "1") for layer in model.model.layers)
        ids = torch.randint(0, model.config.vocab_size, (9,), device="cuda",
                            generator=torch.Generator(device="cuda").manual_seed(5))  # fmt: skip
        positions = torch.arange(100, 109, device="cuda")
        logits[flag] = model(ids, positions)
        # the kernel ran in every layer with the flag on, never with it off
        assert len(launches) == (len(model.model.layers) if flag == "1" else 0)
    assert torch.isfinite(logits["1"]).all()
    assert torch.equal(logits["0"], logits["1"])


def test_engine_greedy_equal_with_the_cache_write_in_the_pack_kernel(monkeypatch):
    """PagedAttention.pack_store_attend (ka written to the latent cache by the pack kernel, no
    cache-write launch) in a real engine with CUDA graphs: greedy tokens equal with
    TREEVERIFY_FUSED_MLA_ROPE on and off (the PyTorch pack and the cache write then), the store
    variant counted so a silent fallback fails, fresh random weights and prompts."""
    from treeverify.engine.llm import LLM
    from treeverify.engine.sampling_params import SamplingParams

    stores = []
    real = fused_mla.mla_rope_pack_store
    monkeypatch.setattr(fused_mla, "mla_rope_pack_store",
                        lambda *a: stores.append(1) or real(*a))  # fmt: skip
    import treeverify.engine.paged_attention as pa

    monkeypatch.setattr(pa, "mla_rope_pack_store", fused_mla.mla_rope_pack_store)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (37, 150)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("TREEVERIFY_FUSED_MLA_ROPE", flag)
        before = len(stores)
        llm = LLM("random:mla-moe", device="cuda", num_pages=256, max_num_seqs=2,
                  cuda_graph_max_bs=2)  # fmt: skip
        tokens[flag] = [o.token_ids for o in llm.generate(prompts, sp)]
        assert (len(stores) > before) == (flag == "1")
        del llm
        torch.cuda.empty_cache()
    assert tokens["0"] == tokens["1"]


@pytest.mark.parametrize("t", [1, 5])
@torch.no_grad()  # the engine's mode: under grad, linear() routes to F.linear (no backward)
def test_q_a_and_kv_a_as_one_product_equal_the_two(t):
    """MLAttention.fuse: one GEMV over q_a_proj | kv_a_proj_with_mqa equals the two
    projections (bit for bit at one row: the decode GEMV sums each output row alone), the two
    weights become views into the fused one, and a weight load afterwards is seen by it."""
    from treeverify.models.deepseek_v3 import MLAttention
    from treeverify.models.gemv import linear
    from treeverify.models.random_shapes import RANDOM_SHAPES

    cfg = RANDOM_SHAPES["random:mla-moe"]()
    attn = MLAttention(cfg, 0).cuda().to(BF16)
    g = torch.Generator(device="cuda").manual_seed(t)
    for lin in (attn.q_a_proj, attn.kv_a_proj_with_mqa):
        lin.weight.data.copy_(torch.randn(lin.weight.shape, device="cuda", generator=g) * 0.02)
    x = torch.randn(t, cfg.hidden_size, device="cuda", generator=g).to(BF16)
    want = (attn.q_a_proj(x), attn.kv_a_proj_with_mqa(x))
    attn.fuse()
    assert attn.qkv_a is not None
    assert attn.q_a_proj.weight.data_ptr() == attn.qkv_a[0].data_ptr()
    fused = linear(x, *attn.qkv_a)
    got = fused.split([cfg.q_lora_rank, fused.shape[1] - cfg.q_lora_rank], dim=-1)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        if t == 1:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b)
    new = torch.randn(attn.kv_a_proj_with_mqa.weight.shape, device="cuda", generator=g) * 0.02
    attn.load_state_dict({"kv_a_proj_with_mqa.weight": new.to(BF16)}, strict=False)
    got = linear(x, *attn.qkv_a)[:, cfg.q_lora_rank :]
    torch.testing.assert_close(got, x @ new.to(BF16).T, rtol=2e-2, atol=2e-2)
