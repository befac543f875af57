"""Plain greedy decode steps launched ahead (engine/decode_ahead.py) on a GPU: captured per batch
bucket, each step replayed before the previous one is read. Against the same engine reading
every step first (the decode bucket's own graph: the same kernels over the same shapes, so the
tokens must be equal, not close), step by step through requests finishing at different steps, a
late arrival and an abort, with the block manager's holds checked after every step; on
random:mla-moe (its decode MoE path under capture) too; with tiny-code's DFlash drafter (plain
steps hand it their hidden rows); and steady-state steps make no host sync. Real CUDA graphs;
skipped without a GPU. (The CPU runs the same body eagerly: test_decode_ahead.py.)
"""

from __future__ import annotations

import os
import random

import pytest
import torch

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from lockstep import (  # noqa: E402
    add_pairs,
    cycle_budgets,
    heldout_prompts,
    parted_at_near_tie,
    record_budgets,
    replay_budgets,
    step_in_lockstep,
)
from treeverify.engine.llm import LLM  # noqa: E402
from treeverify.engine.sampling_params import SamplingParams  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _engine(model: str = "tiny-code", **kw) -> LLM:
    kw.setdefault("num_pages", 256)
    return LLM(model, device="cuda", cuda_graph_max_bs=4, max_num_seqs=4, **kw)


@pytest.mark.parametrize("holes", ["1", "0"], ids=["holes", "no-holes"])
def test_steps_launched_ahead_equal_read_first_step_by_step(monkeypatch, holes):
    """`holes` (TREEVERIFY_AHEAD_HOLES): a finished request's row a hole of the next steps
    launched ahead (its K/V to the scratch slot, its prefix 0), or the step after a finish read
    first. Equal token for token, except at a bf16 near-tie that the late arrival's step may
    make: the read-first engine runs its prefill in one forward with the three decodes (GEMMs
    over more rows: another tiling, other roundings), the engine launching ahead runs it alone
    after the step it took (on the H100, seed 172712899 parted the arrival at its 4th token, at
    95983b4 and at 227d96f alike). Each request may part once, at a near-tie of the reference's
    top 2 (read first, with logprobs=2: its tokens do not change); anything else fails."""
    # LOCKSTEP_SEED=172712899 re-runs the prompts that parted at a near-tie
    seed = int(os.environ.get("LOCKSTEP_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"seed {seed}")  # shown with a failure: the same prompts again
    rng = random.Random(seed)
    prompts = heldout_prompts(rng, 4)
    monkeypatch.setenv("TREEVERIFY_AHEAD_HOLES", holes)
    ahead, first = _engine(decode_lookahead=True), _engine(decode_lookahead=False)
    assert ahead.ahead is not None and ahead.ahead.captured and first.ahead is None
    pairs = []
    for prompt, n in zip(prompts[:3], (70, 17, 41), strict=True):
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        ref = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)
        pairs.append((ahead.add_request(prompt, sp), first.add_request(prompt, ref)))
    steps, parted = 0, set()
    while ahead.has_unfinished() or first.has_unfinished():
        if steps == 9:  # its prefill runs after the step launched ahead, which is taken
            sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
            ref = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
            pairs.append((ahead.add_request(prompts[3], sp), first.add_request(prompts[3], ref)))
        if steps == 30:
            assert ahead.abort(pairs[0][0].request_id) and first.abort(pairs[0][1].request_id)
        ahead.step()
        first.step()
        steps += 1
        for i, (a, b) in enumerate(pairs):
            msg = f"step {steps}: {a.request_id}"
            assert a.num_cached_tokens == b.num_cached_tokens, msg
            if i not in parted and parted_at_near_tie(
                a.output_token_ids, b.output_token_ids, first.logprobs_so_far(b.request_id), msg
            ):
                parted.add(i)
        ahead.block_manager.check(ahead.scheduler.running)
    info = ahead.ahead.info
    # the arrival's prefill runs beside the step launched ahead (taken), the abort drops a row
    assert info["ahead_used"] > 20 and info["ahead_partial"] >= 1 and info["ahead_discarded"] == 0
    assert (info["holed_rows"] > 0) == (holes == "1")
    assert ahead.block_manager.num_free_pages == ahead.block_manager.num_pages
    assert ahead.cuda_graph_info["decode_ahead"]["replays"] == info["replays"]


def test_steps_launched_ahead_on_mla_moe_equal_read_first():
    """Requests of one length: a batch of other rows would route other (token, expert) pairs
    and take the other MoE path (GEMV pairs vs grouped GEMM), whose roundings differ; on
    random weights that parts greedy tokens at near-ties (forty-second session)."""
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(40 + 9 * i)] for i in range(3)]
    outs = {}
    for on in (True, False):
        llm = _engine("random:mla-moe", decode_lookahead=on, num_pages=64)
        outs[on] = [o.token_ids for o in llm.generate(prompts, sp)]
        if on:
            assert llm.ahead.ahead_used > 10
        del llm
        torch.cuda.empty_cache()
    assert outs[True] == outs[False]


def steps_under_sync_error(monkeypatch, llm: LLM, n: int) -> tuple[int, int]:
    """Run n engine steps under torch.cuda.set_sync_debug_mode("error") (a sync PyTorch issues
    raises), the one intended wait (Event.synchronize, a step's own tokens) let through and
    counted: (waits, steps taken from a step launched ahead)."""
    waits = []
    wait = torch.cuda.Event.synchronize

    def wait_once(event):
        torch.cuda.set_sync_debug_mode("default")
        try:
            waits.append(1)
            return wait(event)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(torch.cuda.Event, "synchronize", wait_once)
    used = llm.ahead.ahead_used
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(n):
            llm.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return len(waits), llm.ahead.ahead_used - used


@pytest.mark.parametrize("drafter", [None, "dflash", "dflash-ring-in-graph"],
                         ids=["plain", "dflash-budget-0", "dflash-ring-in-graph"])  # fmt: skip
def test_steady_steps_launched_ahead_read_the_device_once_and_never_else_sync(monkeypatch, drafter):
    """Under torch.cuda.set_sync_debug_mode("error") (a sync PyTorch issues raises), a steady
    step's only wait is the one intended: for the copy of its own tokens into pinned memory,
    the next step already queued behind it; counted, exactly one a step. With tiny-code's DFlash
    drafter at budget 0 too: the step's hidden rows go to the drafter (and are projected into
    its rings once 32 are pending) without a sync (a Python-list index of the rows did sync:
    most of that engine's plain step, thirty-fourth session); with the step graphs writing
    those rows into the feed ring themselves (TREEVERIFY_RING_IN_GRAPH=1) too."""
    monkeypatch.setenv(
        "TREEVERIFY_RING_IN_GRAPH", "1" if drafter == "dflash-ring-in-graph" else "0"
    )
    if drafter is None:
        llm = _engine(decode_lookahead=True)
    else:
        llm = _engine(decode_lookahead=True, speculative_algorithm="DDTREE",
                      speculative_ddtree_budget=16)  # fmt: skip
        cycle_budgets(llm, [0])  # plain steps only
    sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    seqs = [llm.add_request(p, sp) for p in heldout_prompts(random.Random(5), 2)]
    while any(s.num_output_tokens < 4 for s in seqs):
        llm.step()  # prefills and the first steps, read first
    waits, taken = steps_under_sync_error(monkeypatch, llm, 40)
    assert waits == 40 and taken == 40  # every one of them taken from the step before


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_mapped_readback_gives_the_tokens_the_copy_to_the_host_gives(monkeypatch, temperature):
    """TREEVERIFY_MAPPED_READBACK=1: each step graph's last kernel writes its tokens into pinned
    host rows (engine/mapped_readback.py), two a bucket by a device flip the host mirrors.
    Against an engine copying them to the host after each replay (the same graphs otherwise):
    equal tokens after every step, greedy or sampled, through finishes at different steps (a
    step taken without its finished rows, buckets 4 -> 2 -> 1, each bucket's flip its own);
    then its steady steps wait once a step and never sync otherwise."""
    monkeypatch.setenv("TREEVERIFY_MAPPED_READBACK", "1")
    mapped = _engine(decode_lookahead=True)
    monkeypatch.setenv("TREEVERIFY_MAPPED_READBACK", "0")
    copied = _engine(decode_lookahead=True)
    assert mapped.ahead.mapped and not copied.ahead.mapped
    assert mapped.ahead.info["mapped_readback"]
    prompts = heldout_prompts(random.Random(11), 4)
    pairs = add_pairs(mapped, copied, prompts, (61, 13, 37, 48), temperature)
    step_in_lockstep(mapped, copied, pairs)
    assert mapped.ahead.ahead_used > 40 and len(mapped.ahead.mapped) >= 3
    sp = SamplingParams(temperature=temperature, max_tokens=200, ignore_eos=True,
                        seed=7 if temperature else None)  # fmt: skip
    seqs = [mapped.add_request(p, sp) for p in prompts[:2]]
    while any(s.num_output_tokens < 4 for s in seqs):
        mapped.step()
    waits, taken = steps_under_sync_error(monkeypatch, mapped, 30)
    assert waits == 30 and taken == 30


def test_a_finish_with_holes_costs_no_step_read_first_and_no_sync(monkeypatch):
    """TREEVERIFY_AHEAD_HOLES=1: one of four requests (bucket 4; the three left still need it)
    finishes inside 40 steady steps; its row becomes a hole (three fills and one non-blocking
    table copy queued, no sync) and every one of the 40 steps is still taken from a step
    launched ahead, with one wait a step, as steps without a finish."""
    monkeypatch.setenv("TREEVERIFY_AHEAD_HOLES", "1")
    llm = _engine(decode_lookahead=True)
    sps = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
           for n in (200, 20, 200, 200)]  # fmt: skip
    seqs = [llm.add_request(p, sp) for p, sp in zip(heldout_prompts(random.Random(6), 4), sps,
                                                      strict=True)]  # fmt: skip
    while any(s.num_output_tokens < 4 for s in seqs):
        llm.step()
    waits, taken = steps_under_sync_error(monkeypatch, llm, 40)
    assert seqs[1].is_finished and not seqs[0].is_finished
    assert llm.ahead.holed_rows == 1
    assert waits == 40 and taken == 40


def test_step_graphs_writing_the_feed_ring_give_the_drafter_the_copys_rows(monkeypatch):
    """TREEVERIFY_RING_IN_GRAPH=1: each plain step graph writes its tapped rows into the DFlash
    context's feed ring itself (engine/ring_put.py, the ring's head on the device too). Against
    the engine copying them after each replay, with the same budgets step for step (plain runs
    that lap the ring, rounds that read it, requests finishing at different steps): equal tokens
    and equal acceptance after every step (a row written to the wrong place drafts otherwise),
    and the device head still the host's at the end."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")  # shown with a failure: the same prompts again
    prompts = heldout_prompts(random.Random(seed), 4)
    knobs = dict(
        speculative_algorithm="DDTREE",
        speculative_ddtree_budget=16,
        decode_lookahead=True,
        num_pages=512,
    )
    engines = {}
    for m in ("1", "0"):
        monkeypatch.setenv("TREEVERIFY_RING_IN_GRAPH", m)
        engines[m] = _engine(**knobs)
        cycle_budgets(engines[m], [0] * 30 + [16, 0, 0, 8])
    graphed, copied = engines["1"], engines["0"]
    assert graphed.ahead.info["ring_in_graph"] and not copied.ahead.info["ring_in_graph"]
    pairs = add_pairs(graphed, copied, prompts, (700, 41, 600, 650))

    def same_acceptance(step: int) -> None:
        hist = [e.spec_stats["accept_length_histogram"] for e in (graphed, copied)]
        assert hist[0] == hist[1], f"step {step}"

    step_in_lockstep(graphed, copied, pairs, same_acceptance)
    ring = graphed.spec.source.context._ring
    assert graphed.ahead.ahead_used > 50 and graphed.spec_stats["rounds"] >= 4
    assert ring.head > ring.rows, f"the ring must have lapped: {ring.head} ids, {ring.rows} rows"
    assert int(ring.device_head) == ring.head


def test_dflash_plain_steps_launched_ahead_feed_the_drafter_the_same_rows():
    """tiny-code's own DFlash drafter conditions on the hidden states of every committed token,
    plain steps' too. With the budgets the first engine ran replayed into the second, steps
    launched ahead and read first give the same tokens and the same acceptance, round by round
    (a wrong or late hidden row would change the drafts)."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")  # shown with a failure: the same prompts again
    rng = random.Random(seed)
    prompts = heldout_prompts(rng, 2)
    sp = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    knobs = dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=16)
    ahead = _engine(decode_lookahead=True, **knobs)
    cycle_budgets(ahead, [0, 0, 0, 16, 16, 0, 0, 8])
    ran = record_budgets(ahead)
    got = [o.token_ids for o in ahead.generate(prompts, sp)]
    stats = ahead.spec_stats
    assert ahead.ahead.ahead_used > 5 and 0 in ran and 16 in ran
    del ahead
    # round lookahead off too: it plans each next step's budget ahead (one draw from the
    # replayed list per plan), and a plan is dropped when a request finishes
    first = _engine(decode_lookahead=False, round_lookahead=False, **knobs)
    budgets = replay_budgets(first, ran)
    assert [o.token_ids for o in first.generate(prompts, sp)] == got
    assert next(budgets, None) is None  # step for step
    assert first.spec_stats["accept_length_histogram"] == stats["accept_length_histogram"]


def test_fused_step_end_equals_the_pytorch_ops_and_the_engine_with_it(monkeypatch):
    """engine/decode_step_end.py compiled (TREEVERIFY_FUSED_DECODE_STEP=1): the same tokens and
    advanced stage as the PyTorch ops on fresh logits of a 129k vocabulary with a tie, and an
    engine ending its steps that way decodes what one without it does."""
    from treeverify.engine.decode_step_end import end_step, end_step_torch
    from treeverify.engine.round_state import RoundState
    from treeverify.engine.step_stage import StepStage

    dev = torch.device("cuda")
    logits = torch.randn(4, 129280, device=dev)  # (b, V) fp32
    logits[2, [70000, 9]] = logits.max() + 1  # a tie across chunks: index 9 wins
    stages = []
    for _ in range(2):
        st = StepStage(4, 1, 1, 8, scratch_slot=12345, device=dev)
        st.write_decodes([1, 2, 3], [15, 3, 40], [15, 3, 40], [[0, 5], [1], [2, 3, 4]])
        stages.append(st)
    torch.cuda.synchronize()
    want = end_step_torch(logits, stages[0].views, 4, 12345, RoundState(dev, 16))
    got = end_step(logits, stages[1].views, 4, 12345, 16)
    assert torch.equal(got, want) and int(got[2]) == 9
    assert torch.equal(stages[1].dev, stages[0].dev)
    monkeypatch.setenv("TREEVERIFY_FUSED_DECODE_STEP", "1")
    prompts = heldout_prompts(random.Random(11), 3)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    fused = _engine(decode_lookahead=True)
    assert fused.ahead.info["fused_step_end"]
    got_tokens = [o.token_ids for o in fused.generate(prompts, sp)]
    del fused
    monkeypatch.setenv("TREEVERIFY_FUSED_DECODE_STEP", "0")
    assert got_tokens == [o.token_ids for o in _engine(decode_lookahead=True).generate(prompts, sp)]


def test_sampled_picks_compiled_equal_the_pytorch_reference():
    """engine/pick_kernels.py compiled: greedy and sampled rows of fresh 129k-vocabulary logits
    pick what the PyTorch reference picks (the same hashed draws; only the Gumbel terms' float
    rounding may differ, never enough to move a token of random logits), and the sampled step
    end advances the stage as its PyTorch ops do."""
    from treeverify.engine.decode_step_end import end_step, end_step_torch
    from treeverify.engine.pick_kernels import pick_tokens, pick_tokens_torch
    from treeverify.engine.round_state import RoundState
    from treeverify.engine.sample_noise import mix
    from treeverify.engine.step_stage import StepStage

    dev = torch.device("cuda")
    logits = torch.randn(64, 129280, device=dev) * 2  # (R, V) fp32
    temps = torch.rand(64, device=dev) * 2  # (R,)
    temps[::4] = 0  # greedy rows among them
    keys = torch.tensor([mix(i * 7919 + 1) for i in range(64)], device=dev)
    positions = torch.randint(0, 30000, (64,), device=dev)
    got = pick_tokens(logits, temps, keys, positions)
    assert torch.equal(got, pick_tokens_torch(logits, temps, keys, positions))
    assert torch.equal(got[::4], logits[::4].argmax(-1))
    assert (got[1::4] != logits[1::4].argmax(-1)).any()  # sampled rows do sample
    stages = []
    for _ in range(2):
        st = StepStage(4, 1, 1, 8, scratch_slot=12345, device=dev)
        st.write_decodes([1, 2, 3], [15, 3, 40], [15, 3, 40], [[0, 5], [1], [2, 3, 4]],
                         [0.0, 0.8, 1.5], [mix(1), mix(2), mix(3)])  # fmt: skip
        stages.append(st)
    torch.cuda.synchronize()
    small = logits[:4].contiguous()  # (4, V)
    want = end_step_torch(small, stages[0].views, 4, 12345, RoundState(dev, 16), sampled=True)
    assert torch.equal(end_step(small, stages[1].views, 4, 12345, 16, sampled=True), want)
    assert torch.equal(stages[1].dev, stages[0].dev)


def test_sampled_steps_launched_ahead_equal_the_general_path(monkeypatch):
    """With the fused step end, sampled plain decodes (seeded, T 0.7 and 1.0, beside a greedy
    one) are launched ahead inside the captured graph and decode what an engine reading every
    step first through the sampler decodes; a top-p request still reads first."""
    monkeypatch.setenv("TREEVERIFY_FUSED_DECODE_STEP", "1")
    prompts = heldout_prompts(random.Random(12), 3)
    params = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=5, max_tokens=48, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=9, max_tokens=48, ignore_eos=True)]  # fmt: skip
    ahead = _engine(decode_lookahead=True)
    assert ahead.ahead.info["sampled_steps"]
    got = [o.token_ids for o in ahead.generate(prompts, params)]
    assert ahead.ahead.ahead_used > 30
    first = _engine(decode_lookahead=False)
    assert got == [o.token_ids for o in first.generate(prompts, params)]
    assert got[1] != [o.token_ids for o in first.generate(prompts[1:2], params[0])][0]
    nucleus = SamplingParams(temperature=1.0, top_p=0.9, seed=2, max_tokens=16, ignore_eos=True)
    used = ahead.ahead.ahead_used
    ahead.generate(prompts[:1], nucleus)
    assert ahead.ahead.ahead_used == used
