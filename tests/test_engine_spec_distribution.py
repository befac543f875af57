"""Sampled speculation is lossless in the engine: over many seeded requests, the tokens a DDTree
round commits follow the target model's own distribution (chi-square against the exact
probabilities computed from the model), and a planted wrong bonus token fails the same test
(negative control). Fixed seeds: the outcome is deterministic, not flaky. Also with the adaptive
budget switching between tree sizes (rounds at budget 4 and 8 in one run).

Two pairs: tiny-llama (random weights) with the n-gram drafter, on its own greedy continuation of
a sentence (a 2-cycle, so the n-gram trees are often accepted and the walk, not only the bonus
draw, is exercised); and the trained pair tiny-code + tiny-code-dflash (its own drafter, picked by
default) on a code prompt at temperature 1.
"""

from __future__ import annotations

import pytest
import torch

scipy_stats = pytest.importorskip("scipy.stats")

from treeverify.engine.llm import LLM  # noqa: E402
from treeverify.engine.sampling_params import SamplingParams  # noqa: E402
from treeverify.models import TorchAttention  # noqa: E402

N = 1500
TOP = 3  # cells: the TOP most likely tokens at each of the three positions, plus "the rest"
# model -> (temperature, prompt, LLM keywords). The tiny random model is flat: a low temperature
# makes it peaked; the trained one is sampled as it is.
CASES = {
    "tiny-llama": (0.05, "The capital of France is", {"speculative_num_draft_tokens": 3}),
    "tiny-code": (1.0, "def read_config(path):\n", {}),
}


def _prompt(llm: LLM, text: str) -> list[int]:
    base = llm.tokenizer.encode(text)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return base + llm.generate([base], greedy)[0].token_ids


def _probs(llm: LLM, ids: list[int], temp: float) -> torch.Tensor:
    with torch.inference_mode():
        t = torch.tensor(ids)
        logits = llm.model(t, torch.arange(len(t)), attention=TorchAttention())[-1]
    return torch.softmax(logits.double() / temp, -1)  # (V,)


def _run(model: str, fault: str | None, monkeypatch, adaptive: bool = False):
    if fault:
        monkeypatch.setenv("TREEVERIFY_FAULT", fault)
    temp, text, kw = CASES[model]
    # Adaptive: a given cost curve that favours budget 4 once acceptance is measured, and no
    # dwell, so the first round of each batch runs at 8 and the next ones at 4. Fixed: budget 8.
    costs = {0: 1.0, 4: 0.5, 8: 1.0} if adaptive else None
    llm = LLM(model, max_num_seqs=256, speculative_algorithm="DDTREE",
              speculative_ddtree_budget=8, speculative_adaptive=adaptive,
              speculative_cost_seconds=costs, **kw)  # fmt: skip
    if adaptive:
        llm.controller.cfg.min_dwell, llm.controller.cfg.confirm = 0, 1
    prompt = _prompt(llm, text)
    params = [SamplingParams(temperature=temp, seed=s, max_tokens=3, ignore_eos=True)
              for s in range(N)]  # fmt: skip
    outs = llm.generate([prompt] * N, params)
    # Token 1 comes from the prefill; tokens 2 and 3 from the first speculative round.
    return [tuple(o.token_ids) for o in outs], llm, prompt, temp


def _p_value(triples, llm, prompt, temp) -> float:
    expected: dict[tuple, float] = {}
    p1 = _probs(llm, prompt, temp)
    for a in torch.topk(p1, TOP).indices.tolist():
        p2 = _probs(llm, prompt + [a], temp)
        for b in torch.topk(p2, TOP).indices.tolist():
            p3 = _probs(llm, prompt + [a, b], temp)
            for c in torch.topk(p3, TOP).indices.tolist():
                expected[(a, b, c)] = float(p1[a] * p2[b] * p3[c]) * len(triples)
    keep = [k for k, e in expected.items() if e >= 5]
    counts = {k: 0 for k in keep}
    for t in triples:
        if t in counts:
            counts[t] += 1
    obs = [counts[k] for k in keep] + [len(triples) - sum(counts.values())]
    exp = [expected[k] for k in keep] + [len(triples) - sum(expected[k] for k in keep)]
    return float(scipy_stats.chisquare(obs, exp).pvalue)


@pytest.mark.parametrize("model, adaptive", [(m, False) for m in CASES] + [("tiny-llama", True)])
def test_spec_rounds_commit_target_samples(model, adaptive, monkeypatch):
    triples, llm, prompt, temp = _run(model, None, monkeypatch, adaptive)
    hist = llm.spec.stats.histogram
    assert sum(n for k, n in hist.items() if k >= 2) > N // 10  # trees accepted, not only bonuses
    if adaptive:
        assert llm.controller.steps_by_budget[4] > 0 and llm.controller.steps_by_budget[8] > 0
    assert _p_value(triples, llm, prompt, temp) > 1e-4


@pytest.mark.parametrize("model", list(CASES))
def test_a_wrong_bonus_token_fails_the_same_test(model, monkeypatch):
    triples, llm, prompt, temp = _run(model, "spec_diverge", monkeypatch)
    assert _p_value(triples, llm, prompt, temp) < 1e-6
