"""The CUDA backend on a GPU: grid and random cases against the reference, capture/replay with
metadata rewritten in place, no sync / no allocation in run(), and the SGLang drop-in.

Skipped where no CUDA GPU (or no cuda-python) exists; scripts/gpu-check runs them on the H200.
Every output is poisoned with NaN before the kernel runs; inputs are fresh random data.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TOL = 5e-3


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "output has NaN/inf: some element was not written"
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _reference(inp: dict) -> torch.Tensor:
    from treeverify.kernels import tree_attention

    return tree_attention(
        inp["q"].float(), inp["k_cache"].float(),
        None if inp["v_cache"] is None else inp["v_cache"].float(),
        inp["block_table"], inp["prefix_lens"], inp["qo_indptr"], inp["tree_mask"],
        inp["sm_scale"], v_head_dim=inp["v_head_dim"], backend="torch",
    )  # fmt: skip


def _cuda(inp: dict, out: torch.Tensor | None = None) -> torch.Tensor:
    from treeverify.kernels import tree_attention

    return tree_attention(
        inp["q"], inp["k_cache"], inp["v_cache"], inp["block_table"], inp["prefix_lens"],
        inp["qo_indptr"], inp["tree_mask"], inp["sm_scale"], v_head_dim=inp["v_head_dim"],
        out=out, backend="cuda",
    )  # fmt: skip


def _poisoned(inp: dict, dv: int) -> torch.Tensor:
    q = inp["q"]
    return torch.full((q.shape[0], q.shape[1], dv), float("nan"), dtype=q.dtype, device=q.device)


def _load_step(nxt: dict, kc, vc, q) -> tuple[int, torch.Tensor]:
    """A new step's cache pages and queries written into a captured plan's fixed tensors (kc,
    vc: the pools; q: rows past the step get fresh noise): (its rows, the reference output)."""
    n_pages = nxt["k_cache"].shape[0]
    assert n_pages <= kc.shape[0], "the step's pages must fit the captured pool"
    kc[:n_pages].copy_(nxt["k_cache"])
    if vc is not None:
        vc[:n_pages].copy_(nxt["v_cache"])
    total = nxt["q"].shape[0]
    q.normal_()
    q[:total].copy_(nxt["q"])
    ref = _reference(dict(nxt, q=q[:total].clone(), k_cache=kc[:n_pages],
                          v_cache=None if vc is None else vc[:n_pages]))  # fmt: skip
    return total, ref


def _grid():
    from treeverify.bench.cases import load_grid

    return load_grid()[0]


@pytest.mark.parametrize("idx", range(54))
def test_grid_case_matches_reference(idx):
    from treeverify.bench.cases import make_inputs

    case = _grid()[idx]
    inp = make_inputs(case, page_size=16, device="cuda", seed=7 + idx)
    out = _cuda(inp, out=_poisoned(inp, case.dv))
    assert _rel(out, _reference(inp)) <= TOL, case.name


RANDOM = [
    # (model kind, hq, hkv, dqk, dv, mla, page, prefixes, trees, dtype)
    ("gqa", 32, 8, 128, 128, False, 1, [0, 37, 1500], [1, 17, 64], torch.bfloat16),
    ("gqa", 32, 8, 128, 128, False, 16, [5000, 0], [1025, 3], torch.float16),
    ("gqa", 8, 2, 64, 64, False, 64, [130, 64, 0, 4000], [33, 32, 31, 200], torch.bfloat16),
    ("gqa", 16, 4, 256, 256, False, 16, [777, 3], [45, 9], torch.float16),
    ("mha", 8, 8, 128, 128, False, 1, [300, 9000], [12, 70], torch.bfloat16),
    ("mla", 8, 1, 576, 512, True, 64, [0, 2100, 65], [16, 100, 1025], torch.bfloat16),
    ("mla", 64, 1, 576, 512, True, 1, [1000, 3], [5, 40], torch.float16),
    ("mla", 16, 1, 576, 512, True, 16, [20000], [64], torch.bfloat16),
]


@pytest.mark.parametrize(
    "spec", RANDOM, ids=[f"{s[0]}-{s[1]}q-p{s[6]}-{i}" for i, s in enumerate(RANDOM)]
)
@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("portable", [False, True], ids=["best", "portable"])
def test_random_ragged_cases(spec, seed, portable, monkeypatch):
    """Both the arch's best kernels and the portable mma.sync ones (what sm_80/sm_120 run)."""
    from treeverify.bench.cases import Case, make_inputs

    if portable:
        monkeypatch.setenv("TREEVERIFY_CUDA_PORTABLE", "1")
    kind, hq, hkv, dqk, dv, mla, page, prefixes, trees, dtype = spec
    case = Case(kind, len(prefixes), max(prefixes), max(trees), hq, hkv, dqk, dv, mla)
    inp = make_inputs(case, page_size=page, device="cuda", dtype=dtype, seed=seed * 101,
                      prefix_lens=prefixes, tree_sizes=trees)  # fmt: skip
    out = _cuda(inp, out=_poisoned(inp, dv))
    assert _rel(out, _reference(inp)) <= TOL


@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
@pytest.mark.parametrize("trend", ["rising", "falling"])
def test_running_maximum_moving_every_tile_or_never(mla, trend):
    """v9 rescales O only when some row's running maximum moved (alpha exactly 1 otherwise).
    Keys scaled by their position make the maximum rise in every tile (every tile rescales) or
    sit in the first tiles (later tiles skip the rescale); both must equal the reference, on
    the wgmma kernels and with several splits (prefixes of a few thousand keys)."""
    from treeverify.bench.cases import Case, make_inputs

    page = 16
    prefixes, trees = [3000, 1900], [17, 64]
    case = Case("mla" if mla else "gqa", 2, 3000, 64, 16 if mla else 32, 1 if mla else 8,
                576 if mla else 128, 512 if mla else 128, mla)  # fmt: skip
    inp = make_inputs(case, page_size=page, device="cuda", seed=11, prefix_lens=prefixes,
                      tree_sizes=trees)  # fmt: skip
    inp["q"] = inp["q"] * 3  # a peaked softmax: the maximum decides the output
    for b, (pre, tree) in enumerate(zip(prefixes, trees, strict=True)):
        n_pages = math.ceil((pre + tree) / page)
        ramp = torch.linspace(0.2, 1.5, n_pages, device="cuda")
        if trend == "falling":
            ramp = ramp.flip(0)
        pages = inp["block_table"][b, :n_pages].long()
        inp["k_cache"][pages] *= ramp.to(inp["k_cache"].dtype).view(-1, 1, 1, 1)
    out = _cuda(inp, out=_poisoned(inp, case.dv))
    assert _rel(out, _reference(inp)) <= TOL


def _plan(inp, case, page, max_batch, max_tree, max_pages, max_kv):
    from treeverify.kernels.plan import TreeAttentionPlan

    return TreeAttentionPlan(
        num_qo_heads=case.hq, num_kv_heads=case.hkv, head_dim_qk=case.dqk, head_dim_v=case.dv,
        mla=case.mla, page_size=page, max_batch=max_batch, max_tree=max_tree,
        max_pages_per_request=max_pages, max_kv_len=max_kv, sm_scale=inp["sm_scale"],
        dtype=inp["q"].dtype,
    )  # fmt: skip


@pytest.mark.parametrize("on_host", [False, True], ids=["device-meta", "host-meta"])
@pytest.mark.parametrize("mla", [False, True])
def test_capture_then_rewrite_metadata_in_place(mla, on_host):
    """One graph captured; new lengths, trees and pages written into the plan (from device
    tensors, or from host tensors through the pinned staging ring); replay == eager."""
    from treeverify.bench.cases import Case, make_inputs

    case = Case(
        "t",
        3,
        3000,
        40,
        8 if mla else 16,
        1 if mla else 4,
        576 if mla else 128,
        512 if mla else 128,
        mla,
    )
    page = 16
    first = make_inputs(case, page_size=page, device="cuda", seed=5, prefix_lens=[3000, 10, 700],
                        tree_sizes=[40, 7, 21])  # fmt: skip
    pool_pages = first["k_cache"].shape[0]
    plan = _plan(first, case, page, 3, 40, math.ceil(3100 / page), 3100)
    plan.plan(first["block_table"], first["prefix_lens"], first["qo_indptr"], first["tree_mask"])
    rows = 3 * 40
    q = torch.randn(rows, case.hq, case.dqk, device="cuda", dtype=torch.bfloat16)
    out = torch.full((rows, case.hq, case.dv), float("nan"), device="cuda", dtype=torch.bfloat16)
    kc, vc = first["k_cache"], first["v_cache"]
    plan.run(q, kc, vc, out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(q, kc, vc, out)
    for step, (prefixes, trees) in enumerate([([17, 2990, 0], [1, 40, 33]),
                                              ([1500, 1500, 64], [40, 40, 40]),
                                              ([0], [9])]):  # fmt: skip
        nxt = make_inputs(case, page_size=page, device="cuda", seed=50 + step,
                          prefix_lens=prefixes, tree_sizes=trees)  # fmt: skip
        assert nxt["k_cache"].shape[0] <= pool_pages
        n_pages = nxt["k_cache"].shape[0]
        kc[:n_pages].copy_(nxt["k_cache"])  # new cache content, same pool
        if vc is not None:
            vc[:n_pages].copy_(nxt["v_cache"])
        meta = [nxt[k] for k in ("block_table", "prefix_lens", "qo_indptr", "tree_mask")]
        plan.plan(*[t.cpu() if on_host else t for t in meta])
        total = nxt["q"].shape[0]
        q.normal_()
        q[:total].copy_(nxt["q"])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager_inp = dict(nxt, q=q[:total].clone(), k_cache=kc[:n_pages], v_cache=None
                         if vc is None else vc[:n_pages])  # fmt: skip
        assert _rel(out[:total], _reference(eager_inp)) <= TOL
        assert _rel(out[:total], _cuda(eager_inp)) <= TOL


def test_run_neither_syncs_nor_allocates():
    from treeverify.bench.cases import Case, make_inputs

    case = Case("t", 2, 5000, 16, 32, 8, 128, 128, False)
    inp = make_inputs(case, page_size=16, device="cuda", seed=3)
    plan = _plan(inp, case, 16, 2, 16, inp["block_table"].shape[1], 5016)
    plan.plan(inp["block_table"], inp["prefix_lens"], inp["qo_indptr"], inp["tree_mask"])
    out = _poisoned(inp, 128)
    plan.run(inp["q"], inp["k_cache"], inp["v_cache"], out)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            plan.run(inp["q"], inp["k_cache"], inp["v_cache"], out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="global"):  # strict: unsafe calls raise
        plan.run(inp["q"], inp["k_cache"], inp["v_cache"], out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(out, _reference(inp)) <= TOL


def test_plan_rejects_exceeded_capacity():
    from treeverify.bench.cases import Case, make_inputs

    case = Case("t", 2, 100, 16, 8, 2, 64, 64, False)
    inp = make_inputs(case, page_size=16, device="cuda", seed=3)
    plan = _plan(inp, case, 16, 2, 8, inp["block_table"].shape[1], 116)
    with pytest.raises(ValueError, match="max_tree|max_total_q"):
        plan.plan(inp["block_table"], inp["prefix_lens"], inp["qo_indptr"], inp["tree_mask"])


def _sglang_inputs(mla: bool, batch: int, n: int, prefixes: list[int], seed: int):
    """SGLang's target-verify layout and the same problem in our paged layout (page_size 1)."""
    from treeverify.bench.cases import random_parents
    from treeverify.spec import parents_to_tree_mask

    gen = torch.Generator().manual_seed(seed)
    hq, hkv, dqk, dv = (16, 1, 576, 512) if mla else (32, 8, 128, 128)
    dev, dt = "cuda", torch.bfloat16
    slots = sum(prefixes) + batch * n + 100
    pool_k = torch.randn(slots, hkv, dqk, device=dev, dtype=dt)
    pool_v = pool_k[..., :dv] if mla else torch.randn(slots, hkv, dv, device=dev, dtype=dt)
    perm = torch.randperm(slots, generator=gen)
    prefix_slots = perm[: sum(prefixes)]
    tree_slots = perm[sum(prefixes) : sum(prefixes) + batch * n]
    k_ext = torch.randn(batch * n, hkv, dqk, device=dev, dtype=dt)
    v_ext = k_ext[..., :dv] if mla else torch.randn(batch * n, hkv, dv, device=dev, dtype=dt)
    pool_k[tree_slots.to(dev)] = k_ext  # SGLang also writes the draft K/V to the pool
    if not mla:
        pool_v[tree_slots.to(dev)] = v_ext
    parents = random_parents(batch, n, gen)
    bits = parents_to_tree_mask(parents)  # (B*N, W)
    # custom_mask: per request [N, P+N] bytes, prefix columns 1, last N ancestor-or-self
    vis = torch.zeros(batch, n, n, dtype=torch.uint8)
    for i in range(n):
        vis[:, i, i] = 1
        if i:
            vis[:, i] |= vis[torch.arange(batch), parents[:, i].clamp(min=0)]
    pieces = []
    for b in range(batch):
        m = torch.ones(n, prefixes[b] + n, dtype=torch.uint8)
        m[:, prefixes[b] :] = vis[b]
        pieces.append(m.flatten())
    custom_mask = torch.cat(pieces).to(dev)
    mask_indptr = torch.tensor([0, *torch.tensor([p.numel() for p in pieces]).cumsum(0)
                                .tolist()], dtype=torch.int64, device=dev)  # fmt: skip
    kv_indptr = torch.tensor([0, *torch.tensor(prefixes).cumsum(0).tolist()], dtype=torch.int32,
                             device=dev)  # fmt: skip
    q = torch.randn(batch * n, hq, dqk, device=dev, dtype=dt)
    # Our layout: page_size 1, request b's pages = its prefix slots then its tree slots.
    table = torch.zeros(batch, max(prefixes) + n, dtype=torch.int32)
    for b in range(batch):
        pre = prefix_slots[sum(prefixes[:b]) : sum(prefixes[: b + 1])]
        table[b, : prefixes[b] + n] = torch.cat([pre, tree_slots[b * n : (b + 1) * n]])
    ours = {
        "q": q, "k_cache": pool_k.view(slots, 1, hkv, dqk),
        "v_cache": None if mla else pool_v.view(slots, 1, hkv, dv),
        "block_table": table.to(dev), "prefix_lens": torch.tensor(prefixes, dtype=torch.int32,
                                                                  device=dev),
        "qo_indptr": torch.arange(0, (batch + 1) * n, n, dtype=torch.int32, device=dev),
        "tree_mask": bits.to(dev), "sm_scale": dqk**-0.5 if not mla else 192**-0.5,
        "v_head_dim": dv if mla else None,
    }  # fmt: skip
    sg = dict(
        q_extend=q, k_extend=k_ext, v_extend=v_ext, k_buffer=pool_k, v_buffer=pool_v,
        qo_indptr=ours["qo_indptr"], kv_indptr=kv_indptr, kv_indices=prefix_slots.to(dev),
        custom_mask=custom_mask, is_causal=False, mask_indptr=mask_indptr, max_len_extend=n,
        sm_scale=ours["sm_scale"],
    )  # fmt: skip
    return sg, ours, dv


def _check_drop_in_eager_and_captured(sg: dict, ours: dict, dv: int) -> None:
    """SGLang's drop-in on `sg` (_sglang_inputs), eager, then captured and replayed on new
    queries: equal to the reference on `ours` both times, the output poisoned before each."""
    from treeverify.kernels.sglang import extend_attention_fwd

    o = torch.full((sg["q_extend"].shape[0], sg["q_extend"].shape[1], dv), float("nan"),
                   device="cuda", dtype=torch.bfloat16)  # fmt: skip
    extend_attention_fwd(o_extend=o, **sg)
    assert _rel(o, _reference(ours)) <= TOL
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        extend_attention_fwd(o_extend=o, **sg)
    sg["q_extend"].normal_()
    o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(o, _reference(ours)) <= TOL


@pytest.mark.parametrize("mla", [False, True])
def test_sglang_drop_in_matches_reference_and_captures(mla):
    _check_drop_in_eager_and_captured(*_sglang_inputs(mla, 3, 16, [900, 0, 4100], seed=11))
