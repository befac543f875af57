"""Two engines stepping the same requests in lockstep: their caches must agree; and the budgets
an adaptive engine ran, step for step, for another engine to replay.

Shared by the whole-round tests (test_round_graphs.py: whole rounds vs the general path), the
lookahead tests (test_round_lookahead.py: rounds launched ahead vs read first), their GPU
version (test_round_graphs_gpu.py) and the plain steps launched ahead on a GPU
(test_decode_ahead_gpu.py: `add_pairs` / `step_in_lockstep`).
"""

from __future__ import annotations

import torch


def kv_rows(llm, seq) -> list[torch.Tensor]:
    """The K/V of every cached position of `seq`, through this engine's own page table (two
    engines may give the same positions different pages)."""
    ps = llm.cache.page_size
    pos = torch.arange(seq.num_cached_tokens)
    slots = torch.tensor(seq.block_table)[pos // ps] * ps + pos % ps  # (cached,)
    return [t.reshape(-1, *t.shape[2:])[slots] for layer in sorted(llm.cache.k)
            for t in (llm.cache.k[layer], llm.cache.v[layer])]  # fmt: skip


def assert_same_state(llm_a, a, llm_b, b, msg: str) -> None:
    """Same K/V in every committed slot and the same drafter context rows (DFlash rings)."""
    for x, y in zip(kv_rows(llm_a, a), kv_rows(llm_b, b), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5, msg=msg)
    kv_a, first_a = llm_a.spec.source.context.keys_values(a.request_id)
    kv_b, first_b = llm_b.spec.source.context.keys_values(b.request_id)
    assert first_a == first_b, msg
    torch.testing.assert_close(kv_a, kv_b, rtol=1e-4, atol=1e-4, msg=msg)


def record_budgets(llm) -> list[int]:
    """From now on, the budget of each of `llm`'s steps that has speculating requests, in order
    (LLM.last_budget); the returned list fills as the engine steps."""
    ran, run_batch = [], llm.run_batch

    def recording(batch):
        out = run_batch(batch)
        if llm.last_budget is not None:
            ran.append(llm.last_budget)
        return out

    llm.run_batch = recording
    return ran


def replay_budgets(llm, budgets: list[int]):
    """Make `llm`'s controller choose `budgets` in order, one per speculating step; returns the
    iterator (exhausted when the replay took every step)."""
    it = iter(budgets)
    llm.controller.choose = lambda ids, path="fast": next(it)
    return it


def cycle_budgets(llm, budgets: list[int]) -> None:
    """Make `llm`'s controller choose `budgets` in a cycle: switches on every few steps, whatever
    the controller would decide (the tests of the rounds around a switch need them)."""
    state = {"i": 0}

    def choose(ids, path="fast"):
        b = budgets[state["i"] % len(budgets)]
        state["i"] += 1
        return b

    llm.controller.choose = choose


def heldout_prompts(rng, k: int) -> list[str]:
    """k of tiny-code's held-out code prompts, each cut to 100-600 characters (the GPU lockstep
    tests' requests)."""
    import json

    from treeverify.models.shipped import shipped_dir

    heldout = json.loads((shipped_dir("tiny-code") / "heldout.json").read_text())["prompts"]
    return [text[: rng.randrange(100, 600)] for text in rng.sample(heldout, k)]


# bf16 noise between two kernels' sums (a GEMM over more rows picks another tiling); a wrong
# K/V, mask or token is far above it
NEAR_TIE_NATS = 0.1


def parted_at_near_tie(got: list[int], want: list[int], want_logprobs: list, msg: str) -> bool:
    """Greedy tokens so far equal, or parted at a bf16 near-tie: at the first difference both
    tokens are in the reference's top 2 (`want_logprobs`, TokenLogprobs per token, logprobs=2)
    within NEAR_TIE_NATS. True once parted (after it the contexts differ: compare no more)."""
    at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    if at is None:
        return False
    top = dict(want_logprobs[at].top)  # token -> logprob under the reference
    assert got[at] in top, f"{msg}: parts at {at}: {got[at]} not in the reference's {top}"
    gap = top[want[at]] - top[got[at]]
    assert gap <= NEAR_TIE_NATS, f"{msg}: parts at {at} by {gap:.3f} nats: not a near-tie"
    return True


def add_pairs(llm_a, llm_b, prompts: list[str], lens, temperature: float = 0.0) -> list:
    """The same requests (max_tokens `lens`, EOS ignored; sampled ones seeded by their index)
    added to both engines: [(seq in a, seq in b)]."""
    from treeverify.engine.sampling_params import SamplingParams

    pairs = []
    for i, (p, n) in enumerate(zip(prompts, lens, strict=True)):
        sp = SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True,
                            seed=i if temperature else None)  # fmt: skip
        pairs.append((llm_a.add_request(p, sp), llm_b.add_request(p, sp)))
    return pairs


def step_in_lockstep(llm_a, llm_b, pairs, each_step=None) -> int:
    """Both engines stepped until both finish, each pair's tokens equal after every step
    (`each_step(step)` then checks more); returns the steps taken."""
    steps = 0
    while llm_a.has_unfinished() or llm_b.has_unfinished():
        llm_a.step()
        llm_b.step()
        steps += 1
        for a, b in pairs:
            assert a.output_token_ids == b.output_token_ids, f"step {steps}: {a.request_id}"
        if each_step is not None:
            each_step(steps)
    return steps
