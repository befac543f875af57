"""Whole rounds captured as one CUDA graph each (engine/round_graphs.py), on a GPU: the tiny-code
engine with its trained DFlash drafter produces the same greedy tokens (and, with the fused pick,
the same seeded sampled tokens) with whole rounds as with the general path (draft, build, verify,
accept graphs one by one; the same kernels over the same shapes), batched and alone, at two budgets,
DDTREE and CHAIN; a replay allocates nothing. (Against plain decoding bf16 verify logits may flip
near-ties, ~0.01-0.1 nats apart, as bench_pair's divergence gaps show; the CPU tests compare with
plain decoding in fp32.) Real CUDA graphs; skipped without a GPU. (The CPU runs the same body
eagerly against the general path step by step: test_round_graphs.py.)
"""

from __future__ import annotations

import os
import random

import pytest
import torch

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from lockstep import (  # noqa: E402
    cycle_budgets,
    heldout_prompts,
    record_budgets,
    replay_budgets,
)
from treeverify.engine.llm import LLM  # noqa: E402
from treeverify.engine.sampling_params import SamplingParams  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize(
    "knobs",
    [
        dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=16,
             speculative_adaptive=False),
        dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=32,
             speculative_adaptive=False),
        dict(speculative_algorithm="CHAIN", speculative_ddtree_budget=8,
             speculative_num_draft_tokens=8),
    ],
    ids=["ddtree16", "ddtree32", "chain8"],
)  # fmt: skip
def test_whole_rounds_equal_the_general_path(knobs):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    prompts = heldout_prompts(rng, 3)
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    outs = {}
    variants = (("ahead", {}), ("whole", {"round_lookahead": False}),
                ("general", {"disable_round_graphs": True}))  # fmt: skip
    for name, extra in variants:
        llm = LLM("tiny-code", device="cuda", num_pages=256, cuda_graph_max_bs=4, **knobs, **extra)
        outs[name] = [o.token_ids for o in llm.generate(prompts, sp)]  # batch 3 (bucket 4)
        outs[name].append(llm.generate(prompts[:1], sp)[0].token_ids)  # batch 1
        if name != "general":
            info = llm.cuda_graph_info["rounds"]
            assert info["captured"] and info["replays"] > 0, info
            assert info["lookahead"] == (name == "ahead") and (info["ahead_used"] > 0) == (
                name == "ahead"), info  # fmt: skip
            assert llm.spec_stats["whole_round_steps"] > 0  # (calibration's rounds: not counted)
            assert llm.spec_stats["avg_spec_accept_length"] > 1.5  # the trained pair drafts
        del llm
    assert outs["ahead"] == outs["whole"] == outs["general"], f"seed {seed}: {_parted(outs)}"


def _parted(outs: dict[str, list[list[int]]]) -> str:
    """Where each request's variants first part (position and each variant's token there): what
    a failure report needs to tell a near-tie from a wrong input (tests/lockstep.py)."""
    names = list(outs)
    notes = []
    for i, seqs in enumerate(zip(*(outs[n] for n in names), strict=True)):
        at = next((j for j, toks in enumerate(zip(*seqs, strict=False)) if len(set(toks)) > 1),
                  None)  # fmt: skip
        if at is None and len({len(x) for x in seqs}) > 1:
            at = min(len(x) for x in seqs)
        if at is not None:
            tokens = {n: (x[at] if at < len(x) else None) for n, x in zip(names, seqs, strict=True)}
            notes.append(f"request {i} parts at {at}: {tokens}")
    return "; ".join(notes) or "equal"


def test_sampled_whole_rounds_captured_equal_the_general_path(monkeypatch):
    """With the fused pick (TREEVERIFY_FUSED_DECODE_STEP=1) seeded sampled requests (T 0.7 / 1.0)
    run whole rounds, read first and launched ahead, each node drawn in the graph from its
    request's staged temperature and key: the same tokens as the general path's `draw_nodes`
    over the same verify logits; a top-p request still takes the general path."""
    monkeypatch.setenv("TREEVERIFY_FUSED_DECODE_STEP", "1")
    prompts = heldout_prompts(random.Random(21), 3)
    params = [SamplingParams(temperature=t, seed=s, max_tokens=64, ignore_eos=True)
              for t, s in ((0.7, 1), (1.0, 2), (0.7, 3))]  # fmt: skip
    knobs = dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=16,
                 speculative_adaptive=False)  # fmt: skip
    outs = {}
    for name, extra in (("ahead", {}), ("whole", {"round_lookahead": False}),
                        ("general", {"disable_round_graphs": True})):  # fmt: skip
        llm = LLM("tiny-code", device="cuda", num_pages=256, cuda_graph_max_bs=4, **knobs, **extra)
        outs[name] = [o.token_ids for o in llm.generate(prompts, params)]
        if name != "general":
            assert llm.rounds.sampling and llm.cuda_graph_info["rounds"]["replays"] > 0
            assert llm.spec_stats["whole_round_steps"] > 0
            if name == "ahead":
                nucleus = SamplingParams(temperature=1.0, top_p=0.9, seed=4, max_tokens=16,
                                         ignore_eos=True)  # fmt: skip
                steps = llm.spec_stats["whole_round_steps"]
                llm.generate(prompts[:1], nucleus)
                assert llm.spec_stats["whole_round_steps"] == steps
        del llm
    assert outs["ahead"] == outs["whole"] == outs["general"]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_mapped_readback_of_whole_rounds_equals_the_copy_to_the_host(monkeypatch, temperature):
    """TREEVERIFY_MAPPED_READBACK=1: each whole round's graph writes its packed rows into pinned
    host rows (two a bucket, a device flip the host mirrors) instead of a copy after the
    replay; rounds launched ahead at budgets switching every few steps (each bucket's flip its
    own), plain steps between them the same way: the same tokens as an engine copying."""
    prompts = heldout_prompts(random.Random(31), 3)
    params = [SamplingParams(temperature=temperature, seed=s if temperature else None,
                             max_tokens=60, ignore_eos=True) for s in (1, 2, 3)]  # fmt: skip
    outs = {}
    for m in ("1", "0"):
        monkeypatch.setenv("TREEVERIFY_MAPPED_READBACK", m)
        llm = LLM("tiny-code", device="cuda", num_pages=256, cuda_graph_max_bs=4,
                  speculative_algorithm="DDTREE", speculative_ddtree_budget=16)  # fmt: skip
        cycle_budgets(llm, [16, 16, 8, 0, 16, 4, 4, 0, 0])
        outs[m] = [o.token_ids for o in llm.generate(prompts, params)]
        info = llm.cuda_graph_info["rounds"]
        assert info["mapped_readback"] == (m == "1") and info["ahead_used"] > 0, info
        assert llm.ahead.info["mapped_readback"] == (m == "1")
        del llm
    assert outs["1"] == outs["0"]


def test_ngram_whole_rounds_captured_equal_the_general_path(same_kernels_at_any_padding):
    """The n-gram drafter's whole rounds (ngram_whole_rounds, the default) captured, read first
    and launched ahead: the same greedy tokens as its general path (host votes,
    ngram_whole_rounds=False), batched and alone."""
    seed = int.from_bytes(os.urandom(4), "little")
    prompts = [p * 2 for p in heldout_prompts(random.Random(seed), 3)]  # repeats: the n-gram drafts
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    knobs = dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=16,
                 speculative_adaptive=False, speculative_draft_model_path="ngram")  # fmt: skip
    outs = {}
    variants = (("ahead", {}),
                ("whole", {"round_lookahead": False}),
                ("general", {"ngram_whole_rounds": False}))  # fmt: skip
    for name, extra in variants:
        llm = LLM("tiny-code", device="cuda", num_pages=256, cuda_graph_max_bs=4, **knobs, **extra)
        assert (llm.rounds is not None) == (name != "general")
        outs[name] = [o.token_ids for o in llm.generate(prompts, sp)]
        outs[name].append(llm.generate(prompts[:1], sp)[0].token_ids)
        if name != "general":
            info = llm.cuda_graph_info["rounds"]
            assert info["captured"] and info["replays"] > 0, info
            assert (info["ahead_used"] > 0) == (name == "ahead"), info
            assert llm.spec_stats["avg_spec_accept_length"] > 1.0
        del llm
    assert outs["ahead"] == outs["whole"] == outs["general"], f"seed {seed}"


def test_a_replay_allocates_nothing():
    llm = LLM("tiny-code", device="cuda", num_pages=256, cuda_graph_max_bs=2,
              speculative_algorithm="DDTREE", speculative_ddtree_budget=16,
              speculative_adaptive=False)  # fmt: skip
    rng = random.Random(0)
    sp = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    seqs = [llm.add_request(p, sp) for p in heldout_prompts(rng, 2)]
    while any(s.num_output_tokens < 8 for s in seqs):  # prefills done, rounds running
        llm.step()
    replays = llm.rounds.replays
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    for _ in range(4):
        llm.step()
    torch.cuda.synchronize()
    assert llm.rounds.replays == replays + 4
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before


def test_fused_round_state_equals_the_torch_ops():
    """kernels/cuda/round_state.cu (one launch per phase inside a captured round) against the
    torch ops it replaces, on random prefixes, shuffled page tables, a padding request, window
    clipping: node slots, then the advance of meta and prefix lengths, exactly equal."""
    from treeverify.engine.round_state import RoundState
    from treeverify.engine.step_stage import StepStage

    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    dev = torch.device("cuda")
    b, real, n, ps, pages, window, scratch = 4, 3, 17, 16, 12, 40, 999_983
    starts = [rng.randrange(0, ps * pages - 2 * n) for _ in range(real)]
    perm = list(range(real * pages))
    rng.shuffle(perm)
    tables = [perm[i * pages : (i + 1) * pages] for i in range(real)]  # shuffled, disjoint
    meta0 = torch.tensor([[rng.randrange(1, 60) for _ in range(real)] + [0] * 5,
                          [rng.randrange(100) for _ in range(real)] + [7] * 5,
                          starts + [0] * 5,
                          list(range(real)) + [9] * 5], dtype=torch.int64, device=dev)  # fmt: skip
    length = torch.tensor([rng.randrange(1, 10) for _ in range(b)], device=dev)  # (b,) int64
    bonus = torch.tensor([rng.randrange(100, 200) for _ in range(b)], device=dev)
    got = {}
    for fused in (True, False):
        state = RoundState(dev, ps, fused=fused)
        assert (state.kernel is not None) == fused, "the kernel should load on this GPU"
        stage = StepStage(b, n, 1, pages, scratch, dev)
        stage.write_round(tables, starts)
        v = stage.views
        v["slots"].fill_(-7)  # poisoned: every row must be written
        meta = meta0.clone()
        state.node_slots(v, b, n, scratch)
        slots = v["slots"][: b * n].clone()
        state.advance(meta, b, length, bonus, v, window)
        torch.cuda.synchronize()
        got[fused] = (slots, meta, v["prefix"][:b].clone())
    for x, y in zip(got[True], got[False], strict=True):
        assert torch.equal(x, y), f"seed {seed}"
    slots, meta, prefix = got[True]
    pos = starts[0] + torch.arange(n)  # (n,) request 0 by hand
    want0 = torch.tensor(tables[0])[pos // ps] * ps + pos % ps
    assert torch.equal(slots[:n].cpu(), want0), f"seed {seed}"
    assert (slots[real * n :] == scratch).all()  # the padding request
    assert meta[:, real:].tolist() == meta0[:, real:].tolist()  # padding keeps its inputs
    assert prefix[real].item() == 0


def test_round_glue_kernels_equal_the_torch_ops():
    """round_stage_trees and round_path_rows (TREEVERIFY_ROUND_GLUE, kernels/cuda/round_state.cu)
    against RoundState's torch ops on random trees, masks narrower than the stage's words, paths
    ending early, a padding request and window clipping: every stage field, each index and the
    advanced meta and prefix lengths exactly equal; outputs poisoned first."""
    from treeverify.engine.round_state import RoundState
    from treeverify.engine.step_stage import StepStage

    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    dev = torch.device("cuda")
    b, real, n, ps, pages, window, scratch, words = 4, 3, 17, 16, 12, 40, 999_983, 3
    k, width, scratch_row = 9, 104, 7 * 104
    starts = [rng.randrange(0, ps * pages - 2 * n) for _ in range(real)]
    perm = list(range(real * pages))
    rng.shuffle(perm)
    tables = [perm[i * pages : (i + 1) * pages] for i in range(real)]
    meta0 = torch.tensor([[rng.randrange(1, 60) for _ in range(real)] + [0] * 5,
                          [rng.randrange(100) for _ in range(real)] + [7] * 5,
                          starts + [0] * 5,
                          list(range(real)) + [6] * 5], dtype=torch.int64, device=dev)  # fmt: skip
    tokens = torch.randint(0, 5000, (b, n), generator=gen).to(dev)  # (b, n) int64
    depths = torch.randint(0, 16, (b, n), generator=gen).to(dev)
    tree = torch.randint(-(2**31), 2**31 - 1, (b * n, 2), generator=gen, dtype=torch.int32)
    tree = tree.to(dev)  # (b * n, 2): narrower than the stage's 3 words
    length = [rng.randrange(1, k + 1) for _ in range(b)]
    packed = torch.full((b, 2 + 2 * k), -1, dtype=torch.int64)
    for r, m in enumerate(length):
        packed[r, 0], packed[r, 1] = m, rng.randrange(100, 200)
        packed[r, 2 : 2 + k] = torch.randint(0, 5000, (k,), generator=gen)
        packed[r, 2 + k : 2 + k + m] = torch.randint(0, n, (m,), generator=gen)
    packed = packed.to(dev)
    got = {}
    for fused in (True, False):
        state = RoundState(dev, ps, fused=fused, glue=True)
        assert (state.stage_kernel is not None) == fused, "the kernels should load on this GPU"
        stage = StepStage(b, n, words, pages, scratch, dev)
        stage.write_round(tables, starts)
        v = stage.views
        for field in ("ids", "pos", "slots", "mask"):  # poisoned: every row must be written
            v[field].fill_(-7)
        meta = meta0.clone()
        state.stage_trees(v, b, n, scratch, meta, tokens, depths, tree)
        staged = [v[f][: b * n].clone() for f in ("ids", "pos", "slots", "mask")]
        idx = state.path_rows(meta, b, n, packed, width, scratch_row, v, window)
        torch.cuda.synchronize()
        got[fused] = (*staged, *idx, meta, v["prefix"][:b].clone())
    for name, x, y in zip(("ids", "pos", "slots", "mask", "rows", "pos", "ring", "meta",
                           "prefix"), got[True], got[False], strict=True):  # fmt: skip
        assert torch.equal(x, y), f"{name}, seed {seed}"
    ids, pos, _, mask, rows, ppos, ring, meta, _ = got[True]
    assert torch.equal(ids, tokens.reshape(-1)) and torch.equal(mask[:, :2], tree)
    assert (mask[:, 2] == 0).all() and torch.equal(pos.view(b, n), depths + meta0[2, :b, None])
    r0 = rows.view(b, k)[0, : length[0]]  # request 0's kept path rows by hand
    assert torch.equal(r0, packed[0, 2 + k : 2 + k + length[0]])
    want_ring = meta0[3, 0] * width + ppos.view(b, k)[0] % width
    assert torch.equal(ring.view(b, k)[0, : length[0]], want_ring[: length[0]])
    assert (ring.view(b, k)[0, length[0] :] == scratch_row).all(), f"seed {seed}"
    assert meta[2, 0].item() == starts[0] + length[0]
    assert meta[:, real:].tolist() == meta0[:, real:].tolist()  # padding keeps its inputs


@pytest.mark.parametrize("drafter", ["dflash", "ngram"])
def test_whole_rounds_with_the_round_glue_equal_those_without(monkeypatch, drafter):
    """TREEVERIFY_ROUND_GLUE=1 (the trees staged, the path rows made and the DFlash block's rows
    by one kernel each, captured in every whole round): the same tokens as without, rounds
    launched ahead at budgets switching every few steps, greedy and (DFlash) sampled requests.
    The kernels' launches are counted at capture, so the glue's branches did run."""
    from treeverify.engine import round_state
    from treeverify.spec import dflash_fused

    launched = {"block": 0, "stage": 0, "path": 0}

    def counting(fn, key):
        def wrapper(*args, **kw):
            launched[key] += 1
            return fn(*args, **kw)

        return wrapper

    monkeypatch.setattr(dflash_fused, "block_rows", counting(dflash_fused.block_rows, "block"))
    for name in ("stage_trees", "path_rows"):
        cls = round_state.RoundState
        monkeypatch.setattr(cls, name, counting(getattr(cls, name), name.split("_")[0]))
    prompts = heldout_prompts(random.Random(41), 3)
    if drafter == "ngram":
        prompts = [p * 2 for p in prompts]
    temps = (0.0, 1.0, 0.0) if drafter == "dflash" else (0.0, 0.0, 0.0)
    params = [SamplingParams(temperature=t, seed=i + 1 if t else None, max_tokens=60,
                             ignore_eos=True) for i, t in enumerate(temps)]  # fmt: skip
    extra = {"speculative_draft_model_path": "ngram"} if drafter == "ngram" else {}
    outs = {}
    for g in ("1", "0"):
        monkeypatch.setenv("TREEVERIFY_ROUND_GLUE", g)
        llm = LLM("tiny-code", device="cuda", num_pages=256, cuda_graph_max_bs=4,
                  speculative_algorithm="DDTREE", speculative_ddtree_budget=16,
                  **extra)  # fmt: skip
        state = llm.rounds.state
        assert state.glue == (g == "1") and (state.path_kernel is not None) == (g == "1")
        cycle_budgets(llm, [16, 16, 8, 0, 16, 4, 4, 0, 0])
        outs[g] = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.cuda_graph_info["rounds"]["ahead_used"] > 0
        if g == "1":
            assert launched["stage"] > 0 and launched["path"] > 0, launched
            assert (launched["block"] > 0) == (drafter == "dflash"), launched
        del llm
    assert outs["1"] == outs["0"]


def test_rounds_launched_ahead_across_budget_switches():
    """Budgets switching every few steps (a cycle in place of the controller's choice, so the
    test does not hang on what the controller decides): each round launched ahead of a switch
    runs in the other budget's captured graph, its stage written whole and its prefix lengths
    copied on the device from the round before. The same budgets, step for step, replayed by
    an engine that launches nothing ahead (each round staged by the host) give the same
    tokens: the same graphs over the same shapes, so any difference is a wrong input."""
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    prompts = heldout_prompts(rng, 3)
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    knobs = dict(device="cuda", num_pages=256, cuda_graph_max_bs=4,
                 speculative_algorithm="DDTREE", speculative_ddtree_budget=32)  # fmt: skip
    ahead = LLM("tiny-code", **knobs)
    cycle_budgets(ahead, [32, 32, 8, 16, 16, 32, 4, 16])
    ran = record_budgets(ahead)
    got = [o.token_ids for o in ahead.generate(prompts, sp)]
    got.append(ahead.generate(prompts[:1], sp)[0].token_ids)
    info = ahead.cuda_graph_info["rounds"]
    assert info["captured"] and info["ahead_switched"] >= 2 and len(set(ran)) >= 2, (info, ran)
    assert ahead.spec_stats["avg_spec_accept_length"] > 2.0, ahead.spec_stats
    replay = LLM("tiny-code", round_lookahead=False, **knobs)
    budgets = replay_budgets(replay, ran)
    want = [o.token_ids for o in replay.generate(prompts, sp)]
    want.append(replay.generate(prompts[:1], sp)[0].token_ids)
    assert got == want, ran
    assert next(budgets, None) is None  # step for step
