"""Sampled speculative decoding commits exactly plain sampled decoding's tokens for the same
seed (CPU): every tree node at depth d uses plain decoding's draw for the token d places on, so
the output does not depend on the trees, the budget the adaptive controller picks, or the
drafter. Trained pair (tiny-code + its DFlash drafter, DDTREE adaptive and CHAIN) and the n-gram
drafter on tiny-llama with repetitive prompts; fresh seeds and filters each run."""

from __future__ import annotations

import random

import pytest

from treeverify.engine.llm import LLM
from treeverify.engine.sampling_params import SamplingParams

CODE = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n\ndef main(", "class Stack:\n    def "]
REPEAT = ["abcabcabcabcabcabcabc", "1 2 3 4 1 2 3 4 1 2 3 4 1 2", "the cat the cat the cat the"]


def _params(rng: random.Random, n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=rng.uniform(0.3, 1.0), top_p=rng.choice([1.0, 0.9]),
                           top_k=rng.choice([0, 20]), seed=rng.randrange(2**31), max_tokens=40,
                           ignore_eos=True, frequency_penalty=rng.choice([0.0, 0.3]))
            for _ in range(n)]  # fmt: skip


@pytest.mark.parametrize("model,prompts,spec", [
    # own drafter, adaptive; a given cost curve where every round costs half a plain step, so
    # the controller speculates however loaded the machine is (a measured CPU curve may not)
    ("tiny-code", CODE, dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=16,
                             speculative_cost_seconds={0: 1.0, 4: 0.5, 8: 0.5, 16: 0.5})),
    ("tiny-code", CODE, dict(speculative_algorithm="CHAIN")),
    ("tiny-llama", REPEAT, dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=8,
                                speculative_adaptive=False)),
])  # fmt: skip
def test_seeded_sampled_speculation_equals_plain_sampling(model, prompts, spec):
    seed = random.randrange(2**32)
    params = _params(random.Random(seed), len(prompts))
    plain = LLM(model).generate(prompts, params)
    llm = LLM(model, **spec)
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain], f"seed {seed}"
    hist = llm.spec.stats.histogram
    assert sum(hist.values()) >= 3, hist  # speculative rounds ran
    if model == "tiny-code":  # the trained pair accepts trees whatever was sampled; a random
        # model's sampled text rarely repeats, so the n-gram case may accept only the bonus
        assert sum(n for k, n in hist.items() if k > 1) >= 3, hist
    again = llm.generate(prompts[::-1], params[::-1])  # other batch order, warm controller
    assert [o.token_ids for o in again] == [o.token_ids for o in plain][::-1], f"seed {seed}"
