"""DFlash drafting in the engine (CPU, fp32, tiny-llama + the seeded tiny DFlash drafter): the
drafter sees the target's hidden states of exactly the committed tokens, and speculation stays
lossless (greedy output equals plain decoding) with DDTREE and CHAIN, alone and batched."""

from __future__ import annotations

import pytest
import torch

from treeverify.engine.llm import LLM
from treeverify.engine.sampling_params import SamplingParams


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(5, 40, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]  # fmt: skip


@pytest.mark.parametrize("algorithm", ["DDTREE", "CHAIN"])
def test_dflash_speculation_is_lossless(algorithm):
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM("tiny-llama", num_pages=128)
    want = [o.token_ids for o in plain.generate(prompts(4), sp)]
    llm = LLM("tiny-llama", num_pages=128, speculative_algorithm=algorithm,
              speculative_ddtree_budget=12, speculative_num_draft_tokens=5,
              speculative_draft_model_path="tiny-dflash",
              speculative_adaptive=False if algorithm == "DDTREE" else None)  # fmt: skip
    got = [o.token_ids for o in llm.generate(prompts(4), sp)]
    assert got == want
    st = llm.spec_stats
    assert st["drafter"] == "dflash" and st["rounds"] > 0
    assert len(llm.spec.source.context) == 0  # finished requests' states are dropped


def test_dflash_context_tracks_the_cache():
    """Mid-generation, the drafter holds keys/values for every cached token, equal to those of
    the target's own layer outputs for that prefix computed from scratch."""
    llm = LLM("tiny-llama", num_pages=128, speculative_algorithm="DDTREE",
              speculative_ddtree_budget=8, speculative_draft_model_path="tiny-dflash")  # fmt: skip
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    seq = llm.add_request(prompts(1, seed=3)[0], sp)
    for _ in range(4):
        llm.step()
    kv, first = llm.spec.source.context.keys_values(seq.request_id)  # (cached, nl, 2, Hkv, D)
    assert first == 0 and kv.shape[0] == seq.num_cached_tokens
    ids = torch.tensor(seq.all_token_ids[: seq.num_cached_tokens])
    with torch.inference_mode():
        llm.model(ids, torch.arange(len(ids)))
        want = llm.spec.source.drafter.context_kv(llm.model.captured, torch.arange(len(ids)))
    torch.testing.assert_close(kv, want, rtol=1e-4, atol=1e-4)


def test_bad_draft_model_path_is_named():
    with pytest.raises(ValueError, match="speculative_draft_model_path"):
        LLM("tiny-llama", num_pages=16, speculative_algorithm="DDTREE",
            speculative_draft_model_path="/nonexistent/drafter")  # fmt: skip


@pytest.mark.parametrize("drafter", ["ngram", "tiny-dflash"])
def test_rounds_in_steps_mixed_with_prefill_stay_lossless(drafter, monkeypatch):
    """A request arriving mid-generation puts prefill chunks into speculating steps: those trees
    run in the same forward as the chunks and go through the same batched acceptance. (Greedy
    DFlash rounds replay whole beside the chunks instead, test_round_graphs.py; here they are
    turned off so the shared forward is the one tested.)"""
    from treeverify.engine.model_runner import ModelRunner

    mixed = []
    real = ModelRunner.run

    def spy(self, batch, tb=None, *args, **kwargs):
        if tb is not None and batch.prefills:
            mixed.append(1)
        return real(self, batch, tb, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "run", spy)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ps = [list(range(65, 80)) * 3, list(range(70, 90)) * 4]
    want = [o.token_ids for o in LLM("tiny-llama", num_pages=128).generate(ps, sp)]
    llm = LLM("tiny-llama", num_pages=128, speculative_algorithm="DDTREE",
              speculative_ddtree_budget=8, chunked_prefill_size=16,
              speculative_draft_model_path=drafter, disable_round_graphs=True)  # fmt: skip
    first = llm.add_request(ps[0], sp)
    for _ in range(3):
        llm.step()
    second = llm.add_request(ps[1], sp)
    while llm.scheduler.has_unfinished():
        llm.step()
    assert mixed, "no step mixed trees with prefill"
    assert [first.output_token_ids, second.output_token_ids] == want
