"""The fused accept on a GPU (TREEVERIFY_FUSED_ACCEPT): ddtree_walk_pack against the walk and
engine/speculative.py `_move_and_pack`'s arithmetic on random DDTree trees, kv_move_rows against
the gather/scatter on random stacked caches, and the engine's greedy tokens equal with the
switch on and off (whole rounds captured, and the general path). Integer work and copies: every
comparison is exact."""

from __future__ import annotations

import os

import pytest
import torch

from walk_trees import tree_and_posterior

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _pack_reference(tokens, posterior, parents, slots, max_depth):
    """walk_tree, then `_move_and_pack`'s packing and indices (without the move)."""
    from treeverify.spec.accept import walk_tree

    acc = walk_tree(tokens, parents, posterior, max_depth)
    k = min(acc.path.shape[1], tokens.shape[1])
    path = acc.path[:, :k]
    node = path.clamp(min=0)
    keep = torch.arange(k, device=path.device)[None, :] < acc.length[:, None]
    dst = slots[:, :k]
    src = torch.where(keep, slots.gather(1, node), dst)
    packed = torch.cat((acc.length[:, None], acc.bonus[:, None], tokens.gather(1, node), path), 1)
    return packed, src, dst, acc.length, acc.bonus


def test_walk_pack_equals_the_walk_and_the_pack():
    pytest.importorskip("cuda.bindings.driver")
    from treeverify.spec.walk_cuda import walk_pack_cuda

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    for budget in (1, 4, 16, 17, 64, 300, 1024):
        for bsz in (1, 5):
            tree, post, n_depth = tree_and_posterior(gen, budget, bsz, dev)
            t = tree.tokens.shape[1]
            slots = torch.randperm(bsz * t * 3, generator=gen)[: bsz * t].view(bsz, t).to(dev)
            for cap in {0, 1, n_depth, max(0, n_depth - 2), t - 1, t + 5, 1100}:
                want = _pack_reference(tree.tokens, post, tree.parents, slots, cap)
                got = walk_pack_cuda(tree.tokens, tree.parents, post, slots, cap)
                for name, g, w in zip(("packed", "src", "dst", "length", "bonus"), got, want,
                                      strict=True):  # fmt: skip
                    assert torch.equal(g, w), (name, budget, bsz, cap)
    one = torch.tensor([[7]], device=dev)  # a lone root (T = 1): length 1, the bonus its token
    packed, src, dst, length, bonus = walk_pack_cuda(one, one * 0 - 1, one + 1, one * 0 + 4, 5)
    assert packed.tolist() == [[1, 8, 7, 0]] and src.tolist() == dst.tolist() == [[4]]
    assert length.tolist() == [1] and bonus.tolist() == [8]
    with pytest.raises(ValueError, match="tokens, parents, posterior, slots"):
        walk_pack_cuda(one, one, one, torch.zeros(1, 2, dtype=torch.int64, device=dev), 3)


@pytest.mark.parametrize("v_row", [(2, 64), None])  # GQA's K and V; MLA's latent only
def test_kv_move_rows_equals_the_gather_scatter(v_row):
    """Random stacked caches (every row random), pairs as walks make them (each request's own
    slots, a path's sources at or after their positions, src == dst past its end, a padding
    row at the scratch slot), some requests' K past the shared-memory limit (the gather /
    scatter then)."""
    pytest.importorskip("cuda.bindings.driver")
    from treeverify.engine.kv_cache import KVCache

    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    k_row = (2, 64) if v_row is not None else (1, 576)
    spec_ = [(k_row, v_row)] * 5
    for bsz, k in ((1, 16), (4, 16), (3, 33), (2, 200)):
        a = KVCache(64, 16, "cuda", spec=spec_, dtype=torch.bfloat16)
        b = KVCache(64, 16, "cuda", spec=spec_, dtype=torch.bfloat16)
        for x, y in zip((*a.k.values(), *a.v.values()), (*b.k.values(), *b.v.values()),
                        strict=True):  # fmt: skip
            if x is not None:
                x.copy_(torch.randn(x.shape, generator=gen).to(x.dtype))
                y.copy_(x)
        starts = torch.randperm(64 * 16 // 256, generator=gen)[:bsz] * 256  # disjoint ranges
        src, dst = [], []
        for s0 in starts.tolist():
            length = int(torch.randint(1, k + 1, (1,), generator=gen))
            nodes = torch.sort(torch.randperm(255, generator=gen)[: length - 1] + 1).values
            path = torch.cat((torch.zeros(1, dtype=torch.int64), nodes))  # increasing, root 0
            d = torch.arange(k) + s0
            sv = d.clone()
            sv[:length] = path + s0
            src.append(sv)
            dst.append(d)
        pad = torch.full((k,), a.scratch_slot)  # a graph bucket's padding row: nothing moves
        src, dst = torch.stack([*src, pad]).cuda(), torch.stack([*dst, pad]).cuda()
        launches = a._move_launches(src)
        assert (launches is not None) == (k * k_row[0] * k_row[1] * 2 <= 48 * 1024), (k, launches)
        a.move_rows(src, dst)
        b.move_slots(src.reshape(-1), dst.reshape(-1))
        for x, y in zip((*a.k.values(), *a.v.values()), (*b.k.values(), *b.v.values()),
                        strict=True):  # fmt: skip
            if x is not None:
                assert torch.equal(x, y), (bsz, k)


@pytest.mark.parametrize("general", [False, True])
def test_engine_greedy_tokens_equal_with_the_fused_accept(monkeypatch, general):
    """tiny-code + its DFlash drafter, greedy, batched and alone: the same tokens with the fused
    accept (in the captured whole rounds, or the general path's captured accept) as without."""
    import json

    from treeverify.engine.llm import LLM
    from treeverify.engine.sampling_params import SamplingParams
    from treeverify.models.shipped import shipped_dir

    heldout = json.loads((shipped_dir("tiny-code") / "heldout.json").read_text())["prompts"]
    prompts = [p[:400] for p in heldout[:3]]
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    outs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("TREEVERIFY_FUSED_ACCEPT", flag)
        llm = LLM("tiny-code", device="cuda", num_pages=256, cuda_graph_max_bs=4,
                  speculative_algorithm="DDTREE", speculative_ddtree_budget=16,
                  speculative_adaptive=False, disable_round_graphs=general)  # fmt: skip
        outs[flag] = [o.token_ids for o in llm.generate(prompts, sp)]
        outs[flag].append(llm.generate(prompts[:1], sp)[0].token_ids)
        assert llm.spec_stats["rounds"] > 0
        del llm
    assert outs["0"] == outs["1"]
