"""DeepSeek-V3 routing by hand, the two MoE implementations agree, expert counts on device."""

from __future__ import annotations

import dataclasses

import torch

from treeverify.models import load_model
from treeverify.models.moe import select_experts
from treeverify.models.tiny import tiny_kimi_config


def routing_cfg(**kw):
    base = dict(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                routed_scaling_factor=2.0, scoring_func="sigmoid", topk_method="noaux_tc",
                norm_topk_prob=True)  # fmt: skip
    base.update(kw)
    return dataclasses.replace(tiny_kimi_config(), **base)


def logit(p: float) -> float:
    return float(torch.logit(torch.tensor(p)))


def test_noaux_tc_group_limited_by_hand():
    # scores (sigmoid): groups {0,1} {2,3} {4,5} {6,7}
    s = torch.tensor([[0.90, 0.10, 0.60, 0.55, 0.50, 0.50, 0.20, 0.20]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.3, 0.0, 0.0])
    # biased group scores (top-2 sums): 1.00, 1.15, 1.30, 0.40 -> groups 2 and 1 win;
    # expert 0 (the best single score) is in a losing group and must not be picked.
    idx, w = select_experts(torch.logit(s), routing_cfg(), bias)
    assert sorted(idx[0].tolist()) == [2, 5]  # 5 by its biased 0.80, 2 by 0.60 over 3's 0.55
    # weights from the unbiased scores, normalised, times routed_scaling_factor
    want = {2: 0.60 / 1.10 * 2.0, 5: 0.50 / 1.10 * 2.0}
    for e, wt in zip(idx[0].tolist(), w[0].tolist(), strict=True):
        assert abs(wt - want[e]) < 1e-5


def test_without_normalisation_and_softmax_greedy():
    s = torch.tensor([[0.90, 0.10, 0.60, 0.55, 0.50, 0.50, 0.20, 0.20]])
    idx, w = select_experts(torch.logit(s), routing_cfg(norm_topk_prob=False, n_group=1,
                                                        topk_group=1), torch.zeros(8))  # fmt: skip
    assert idx[0].tolist() == [0, 2]
    torch.testing.assert_close(w[0], torch.tensor([0.90, 0.60]) * 2.0)
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    cfg = routing_cfg(scoring_func="softmax", topk_method="greedy", routed_scaling_factor=1.0)
    idx, w = select_experts(logits, cfg)
    assert idx[0].tolist() == [0, 2]
    assert abs(float(w.sum()) - 1.0) < 1e-6  # renormalised over the chosen two
    # group_limited_greedy: group score = max; with topk_group=1 only the best group remains
    cfg = routing_cfg(scoring_func="softmax", topk_method="group_limited_greedy", n_group=4,
                      topk_group=1)  # fmt: skip
    idx, _ = select_experts(logits, cfg)
    assert sorted(idx[0].tolist()) == [0, 1]  # only group {0,1} survives


def test_dense_equals_grouped_and_counts():
    _, model, tok = load_model("tiny-kimi")
    ids = torch.tensor(tok.encode("mixture of experts", add_bos=True))
    pos = torch.arange(len(ids))
    with torch.no_grad():
        grouped = model(ids, pos)
        counts_once = model.moe_expert_counts.clone()
        model.set_moe_impl("dense")
        dense = model(ids, pos)
    torch.testing.assert_close(grouped, dense, atol=1e-5, rtol=1e-5)
    k = model.config.num_experts_per_tok
    assert counts_once[0].sum() == 0  # first_k_dense_replace=1: layer 0 is dense
    assert (counts_once[1:].sum(-1) == len(ids) * k).all()
    assert torch.equal(model.moe_expert_counts, 2 * counts_once)  # accumulates on device
    imb = model.moe_imbalance()
    assert imb[0] == 0 and (imb[1:] >= 1).all()
    model.reset_moe_counts()
    assert model.moe_expert_counts.sum() == 0
    assert model.moe_expert_counts.device == grouped.device
    with torch.no_grad():  # the batched-GEMV path (what decode-sized graph steps take)
        model.set_moe_impl("gather")
        gathered = model(ids, pos)
    torch.testing.assert_close(gathered, grouped, atol=1e-5, rtol=1e-5)


def test_fused_routing_switch_is_read_checked_and_described(monkeypatch):
    """TREEVERIFY_FUSED_ROUTING: on unless 0; a bad value names the variable; a router built on
    the CPU may hold the switch on but still routes with the PyTorch ops (the kernel is Triton on
    a GPU), and the startup line says which path a GPU takes."""
    import pytest

    from treeverify import env
    from treeverify.kernels.api import triton_available
    from treeverify.models import fused_routing
    from treeverify.models.moe import Router

    monkeypatch.delenv("TREEVERIFY_FUSED_ROUTING", raising=False)
    assert env.fused_routing() is True
    monkeypatch.setenv("TREEVERIFY_FUSED_ROUTING", "0")
    assert env.fused_routing() is False
    assert Router(routing_cfg()).fused is False
    monkeypatch.setenv("TREEVERIFY_FUSED_ROUTING", "sometimes")
    with pytest.raises(ValueError, match="TREEVERIFY_FUSED_ROUTING"):
        env.fused_routing()
    monkeypatch.setenv("TREEVERIFY_FUSED_ROUTING", "1")
    router = Router(routing_cfg())
    assert router.fused is triton_available()
    x = torch.randn(5, router.cfg.hidden_size)
    want_idx, want_w = select_experts(torch.nn.functional.linear(x, router.weight), router.cfg,
                                      router.e_score_correction_bias)  # fmt: skip
    got_idx, got_w = router(x)  # CPU logits: the PyTorch path whatever the switch says
    assert torch.equal(got_idx, want_idx)
    torch.testing.assert_close(got_w, want_w)
    assert fused_routing.describe(True).startswith("MoE routing: one Triton kernel")
    assert "TREEVERIFY_FUSED_ROUTING=0" in fused_routing.describe(False)


def test_moe_experts_startup_line_names_each_path_and_bound():
    """DeepseekMoE.describe: the startup log's line says which path a captured GPU step's
    routed experts take at which batch sizes, under each TREEVERIFY_MOE_GEMV /
    TREEVERIFY_FUSED_MOE_DISPATCH mode (set on the layer as its constructor reads them)."""
    from treeverify.models import fused_moe, moe_gemv
    from treeverify.models.moe import DeepseekMoE

    moe = DeepseekMoE(tiny_kimi_config())
    moe.gemv, moe.fused_dispatch = "auto", "auto"
    line = moe.describe()
    assert line.startswith(f"MoE experts: expert GEMVs up to {moe_gemv.AUTO_MAX_PAIRS} pairs "
                           "(auto; tiles gate_up / down ")  # fmt: skip
    assert f"Triton dispatch up to {fused_moe.AUTO_MAX_PAIRS} pairs (auto)" in line
    moe.gemv, moe.fused_dispatch = "1", "0"
    line = moe.describe()
    assert f"up to {moe_gemv.MAX_PAIRS} pairs (forced" in line and "Triton dispatch" not in line
    moe.gemv = "0"
    assert moe.describe() == ("MoE experts: grouped GEMMs with the PyTorch dispatch "
                              "(sm_90+; else gather/dense)")  # fmt: skip


def test_shared_experts_stacked_after_the_routed_ones():
    """stack_experts with the shared experts on the GEMV path (TREEVERIFY_MOE_GEMV_SHARED): one
    shared expert becomes the stack's last expert with its MLP's weights as views into it (its
    own forward unchanged); two become two chunks (gate / up rows and down columns j*I..);
    a shared MLP not made of whole chunks stays out of the stack."""
    from treeverify.models.moe import DeepseekMoE

    for n_shared in (1, 2):
        cfg = dataclasses.replace(tiny_kimi_config(), n_shared_experts=n_shared)
        torch.manual_seed(n_shared)
        moe = DeepseekMoE(cfg)
        moe.gemv_shared = True
        sh = moe.shared_experts
        x = torch.randn(3, cfg.hidden_size)
        own = sh(x)
        gate, up, down = (w.detach().clone() for w in (sh.gate_proj.weight, sh.up_proj.weight,
                                                        sh.down_proj.weight))  # fmt: skip
        moe.stack_experts()
        e, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
        assert moe.stacked_shared == n_shared and moe.w_gate_up.shape[0] == e
        assert moe.w_gate_up_all.shape[0] == moe.w_down_all.shape[0] == e + n_shared
        for j in range(n_shared):
            rows = slice(j * inter, (j + 1) * inter)
            assert torch.equal(moe.w_gate_up_all[e + j], torch.cat((gate[rows], up[rows])))
            assert torch.equal(moe.w_down_all[e + j], down[:, rows])
        shared_in_stack = sh.gate_proj.weight.data_ptr() == moe.w_gate_up_all[e].data_ptr()
        assert shared_in_stack == (n_shared == 1)
        torch.testing.assert_close(sh(x), own, rtol=0, atol=0)
    moe = DeepseekMoE(tiny_kimi_config())
    moe.gemv_shared = True
    moe.shared_experts.gate_proj.weight.data = moe.shared_experts.gate_proj.weight.data[:-1]
    moe.stack_experts()  # (only the stacking is looked at: this MLP no longer runs)
    assert moe.stacked_shared == 0 and moe.w_gate_up_all.shape[0] == moe.n_experts
