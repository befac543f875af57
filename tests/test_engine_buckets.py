"""The CPU side of CUDA-graph buckets: padded bucket plans equal eager ones, padding rows touch
only the scratch slot and are left out of MoE counts, sync-free MoE impls agree, KV sizing math.
(Capture itself needs a GPU: tests/test_engine_gpu.py.)"""

from __future__ import annotations

import pytest
import torch

from treeverify.engine.cuda_graphs import batch_buckets
from treeverify.engine.kv_cache import KVCache, bytes_per_token
from treeverify.engine.paged_attention import PagedAttention
from treeverify.models import load_model
from treeverify.models.random_shapes import RANDOM_SHAPES, WideByteTokenizer


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert batch_buckets(12) == [1, 2, 4, 8, 12]
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        batch_buckets(0)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-kimi"])
def test_padded_bucket_equals_eager(name):
    """3 decodes in bucket (4, 1): the padded forward's 3 rows equal the eager forward's, the
    padding row writes only the scratch slot, and MoE counts see 3 tokens per layer."""
    torch.manual_seed(0)
    _, model, _ = load_model(name)
    spec = model.kv_cache_spec()
    cache = KVCache(8, 4, spec=spec, dtype=torch.float32)
    for layer in cache.k:  # a random prefix of 5 tokens per request, pages 0-1, 2-3, 4-5
        cache.k[layer].normal_()
        if cache.v[layer] is not None:
            cache.v[layer].normal_()
    att = PagedAttention(cache, max_batch=4, max_chunk=8, max_total_q=16, context_length=32)
    tables, prefix = [[0, 1], [2, 3], [4, 5]], [5, 5, 5]
    slots = torch.tensor([0 * 4 + 5, 2 * 4 + 5, 4 * 4 + 5])
    ids, pos = torch.tensor([3, 77, 120]), torch.tensor([5, 5, 5])
    snapshot = {layer: k.clone() for layer, k in cache.k.items()}
    att.select(None)
    att.plan(slots, tables, prefix, [1, 1, 1])
    want = model(ids, pos, attention=att)  # (3, V)
    for layer, k in snapshot.items():  # the same K rows get written again below
        cache.k[layer].copy_(k)
    counts_before = getattr(model, "moe_expert_counts", torch.zeros(1)).clone()
    att.select((4, 1))
    att.plan(slots, tables, prefix, [1, 1, 1])
    padded_ids, padded_pos = torch.tensor([3, 77, 120, 0]), torch.tensor([5, 5, 5, 0])
    valid = torch.tensor([True, True, True, False])
    got = model(padded_ids, padded_pos, attention=att, token_valid=valid)  # (4, V)
    torch.testing.assert_close(got[:3], want, rtol=1e-5, atol=1e-5)
    real = cache.num_pages * cache.page_size
    for layer, k in snapshot.items():  # nothing but the 3 real slots and the scratch page
        flat_new, flat_old = cache.k[layer].view(-1, *k.shape[2:]), k.view(-1, *k.shape[2:])
        changed = (flat_new[:real] != flat_old[:real]).flatten(1).any(-1).nonzero().flatten()
        assert set(changed.tolist()) <= set(slots.tolist())
    if hasattr(model, "moe_expert_counts"):
        added = model.moe_expert_counts - counts_before
        k = model.config.num_experts_per_tok
        moe_rows = added.sum(-1)[added.sum(-1) > 0]
        assert moe_rows.numel() > 0 and bool((moe_rows == 3 * k).all()), added


def test_moe_impls_agree_and_stacking_keeps_weights():
    _, model, tok = load_model("tiny-kimi")
    ids = torch.tensor(tok.encode("sync-free experts for graphs", add_bos=True))
    pos = torch.arange(len(ids))
    outs = {}
    for impl in ("grouped", "dense", "gather", "graph"):
        model.set_moe_impl(impl)
        outs[impl] = model(ids, pos)
    for impl in ("dense", "gather", "graph"):
        torch.testing.assert_close(outs[impl], outs["grouped"], rtol=1e-4, atol=1e-4)
    moe = next(m for m in model.modules() if hasattr(m, "n_experts"))
    assert moe.experts[0].gate_proj.weight.data_ptr() == moe.w_gate_up[0].data_ptr()
    with pytest.raises(ValueError, match="impl"):
        model.set_moe_impl("sparse")


def test_kv_bytes_per_token_and_scratch_page():
    _, llama, _ = load_model("tiny-llama")
    _, kimi, _ = load_model("tiny-kimi")
    assert bytes_per_token(llama.kv_cache_spec(), torch.bfloat16) == 2 * 2 * (2 * 64) * 2
    assert bytes_per_token(kimi.kv_cache_spec(), torch.bfloat16) == 3 * 576 * 2
    cache = KVCache(10, 16, spec=kimi.kv_cache_spec(), dtype=torch.bfloat16)
    assert cache.k[0].shape == (11, 16, 1, 576) and cache.v[0] is None
    assert cache.scratch_slot == 160
    with pytest.raises(ValueError, match="dtype"):
        KVCache(10, 16, spec=kimi.kv_cache_spec())


def test_random_shapes_and_wide_tokenizer():
    assert set(RANDOM_SHAPES) == {"random:llama-1b", "random:llama-8b", "random:mla-moe"}
    cfg = RANDOM_SHAPES["random:llama-8b"]()
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads) == (4096, 32, 8)
    tok = WideByteTokenizer(1000)
    assert tok.decode([104, 105, 600, 33]) == "hi<600>!"
    assert tok.decode(tok.encode("plain")) == "plain"


@pytest.mark.parametrize("qk_norm", [False, True])
def test_fused_projections_equal_unfused(qk_norm):
    """fuse_for_inference (qkv and gate|up GEMMs, q and k rotated together) changes no output;
    with qk_norm (Qwen3) as well."""
    import dataclasses

    from treeverify.models.llama import LlamaForCausalLM
    from treeverify.models.tiny import init_random_weights, tiny_llama_config

    cfg = dataclasses.replace(tiny_llama_config(), qk_norm=qk_norm, qkv_bias=True)
    model = LlamaForCausalLM(cfg)
    init_random_weights(model, seed=3)
    model.eval().requires_grad_(False)
    ids = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(21)
    want = model(ids, pos)
    names = sorted(n for n, _ in model.named_parameters())
    got = model.fuse_for_inference()(ids, pos)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert sorted(n for n, _ in model.named_parameters()) == names  # loading still matches


def test_prepare_plans_touches_only_the_scratch_page():
    """Startup without graphs makes each bucket's plans with a forward over the scratch page:
    the pool's K/V stay as they were, the bucket plans exist."""
    from treeverify.engine.llm import LLM

    llm = LLM("tiny-llama", num_pages=16)
    for layer in llm.cache.k:
        llm.cache.k[layer].normal_()
        llm.cache.v[layer].normal_()
    before = {layer: (k[:-1].clone(), llm.cache.v[layer][:-1].clone())
              for layer, k in llm.cache.k.items()}  # fmt: skip
    llm.runner.prepare_plans([(2, 1), (1, 5)])
    for layer, (k, v) in before.items():
        assert torch.equal(llm.cache.k[layer][:-1], k) and torch.equal(llm.cache.v[layer][:-1], v)
    buckets = {key[0] for key in llm.runner.attention._plans}
    assert {(2, 1), (1, 5)} <= buckets and llm.runner.attention.bucket is None


def test_plans_size_their_split_grids_for_the_model_not_the_pool():
    """A request holds at most the model's positions (LLM._prepare), so the engine's plans size
    their split-KV grids for that (split_kv_len) while their capacity checks still cover the
    pool. For tiny-code (1024 positions; 2048 pages x 16 in bench_pair) that is 16 splits, not
    the 64 a 32768-key grid takes on a 132-SM GPU: its 17-row verify plan then merges every
    tile in the forward (kernels/splits.py plan_merge_limit), as the forty-ninth session's
    rule meant; sized by the pool, the merge kernel ran every step (measured on the H100 at
    59f5feb: DDTREE 16 at 1.927x plain, 2.004x with every tile forced into the forward)."""
    from treeverify.engine.llm import LLM
    from treeverify.kernels.splits import (
        choose_splits,
        merge_bytes,
        merge_kernel_needed,
        plan_merge_limit,
    )

    llm = LLM("tiny-code", num_pages=2048)
    assert llm.model_config.max_position_embeddings == 1024
    llm.runner.prepare_plans([(1, 17)])
    plans = [p for (bucket, _), p in llm.runner.attention._plans.items() if bucket == (1, 17)]
    assert plans and all(p.split_kv_len == 1024 for p in plans)
    assert all(p.max_kv_len == 2048 * llm.cache.page_size for p in plans)  # checks: the pool
    hq, hkv, dv = plans[0].hq, plans[0].hkv, plans[0].dv
    tile_rows = 17 * hq // hkv  # 34 packed rows: one 64-row tile
    for ctas_per_sm in (1, 2):  # the H100's and H200's 132 SMs, either occupancy
        grid = dict(batch=1, hkv=hkv, m_tiles=1, bn=64, num_sms=132, ctas_per_sm=ctas_per_sm)
        s = choose_splits(**grid, max_kv=plans[0].split_kv_len).max_splits
        assert s == 16 and merge_bytes(s, tile_rows, dv) == 139264
        limit = plan_merge_limit("auto", max_splits=s, tile_rows=tile_rows, dv=dv, mla=False)
        assert not merge_kernel_needed(max_splits=s, tile_rows=tile_rows, dv=dv, limit=limit)
        # sized by the pool (the engine before): 64 splits, the merge kernel every step
        s = choose_splits(**grid, max_kv=plans[0].max_kv_len).max_splits
        limit = plan_merge_limit("auto", max_splits=s, tile_rows=tile_rows, dv=dv, mla=False)
        assert s == 64 and merge_kernel_needed(max_splits=s, tile_rows=tile_rows, dv=dv,
                                               limit=limit)  # fmt: skip


def test_split_kv_len_is_checked_and_capped_by_max_kv_len():
    from treeverify.kernels.plan import TreeAttentionPlan

    kw = dict(num_qo_heads=4, num_kv_heads=2, head_dim_qk=16, page_size=4, max_batch=1,
              max_tree=5, max_pages_per_request=8, sm_scale=0.25, dtype=torch.float32,
              device="cpu", backend="torch")  # fmt: skip
    assert TreeAttentionPlan(**kw).split_kv_len == 32
    assert TreeAttentionPlan(**kw, split_kv_len=20).split_kv_len == 20
    assert TreeAttentionPlan(**kw, split_kv_len=4096).split_kv_len == 32  # never past the pages
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="split_kv_len"):
            TreeAttentionPlan(**kw, split_kv_len=bad)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-kimi"])
def test_stacked_cache_moves_every_layer_like_per_layer_moves(name):
    """A spec whose layers share a row shape gets one tensor per K (V) for all layers; a round's
    move (a path whose sources overlap its destinations, as accepted paths do) then equals the
    per-layer move of an unstacked cache, on random contents, every layer and slot."""
    _, model, _ = load_model(name)
    spec = model.kv_cache_spec()
    stacked = KVCache(6, 4, spec=spec, dtype=torch.float32)
    assert stacked._stacked is not None
    plain = KVCache(6, 4)  # lazily allocated per layer: the per-layer path
    g = torch.Generator().manual_seed(1)
    for layer, kc in stacked.k.items():
        kc.copy_(torch.randn(kc.shape, generator=g))
        vc = stacked.v[layer]
        if vc is not None:
            vc.copy_(torch.randn(vc.shape, generator=g))
        plain._allocate(layer, kc.shape[2:], None if vc is None else vc.shape[2:],
                        kc.dtype, kc.dtype)  # fmt: skip
        plain.k[layer].copy_(kc)
        if vc is not None:
            plain.v[layer].copy_(vc)
    # path nodes 0, 2, 3 of a tree at slots 9.. : node 2 -> slot 10, node 3 -> slot 11
    src, dst = torch.tensor([9, 11, 12]), torch.tensor([9, 10, 11])
    rows = {layer: k.reshape(-1, *k.shape[2:]).clone() for layer, k in stacked.k.items()}
    stacked.move_slots(src, dst)
    plain.move_slots(src, dst)
    for layer in stacked.k:
        assert stacked.k[layer].equal(plain.k[layer]), layer
        if stacked.v[layer] is not None:
            assert stacked.v[layer].equal(plain.v[layer]), layer
        moved = stacked.k[layer].reshape(-1, *stacked.k[layer].shape[2:])
        assert moved[10].equal(rows[layer][11]) and moved[11].equal(rows[layer][12])
