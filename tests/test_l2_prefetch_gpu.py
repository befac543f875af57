"""The L2 prefetch (models/l2_prefetch.py) on a GPU: its side branch is captured with the step
(the kernel runs in every replay) and changes no result: a GEMV chain replayed on fresh inputs
equals eager bit for bit, and engines with it on give the greedy tokens of engines with it off
(plain decode graphs, DDTREE verify graphs, DFlash whole rounds)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from torch.profiler import ProfilerActivity, profile  # noqa: E402

from treeverify.engine.llm import LLM  # noqa: E402
from treeverify.engine.sampling_params import SamplingParams  # noqa: E402
from treeverify.models import gemv as gemv_mod  # noqa: E402
from treeverify.models import l2_prefetch  # noqa: E402


def prefetch_launches(graph: torch.cuda.CUDAGraph) -> int:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if "l2_prefetch" in e.key)


def test_a_captured_chain_with_the_branch_replays_bit_equal(monkeypatch):
    monkeypatch.setattr(l2_prefetch, "budget_bytes", lambda: 24 << 20)
    k, n = 2048, 4096
    w1 = (torch.randn(k, k, device="cuda") / k**0.5).to(torch.bfloat16)
    w2 = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    x = torch.randn(1, k, device="cuda").to(torch.bfloat16)

    def chain(x):
        y = gemv_mod.linear(x, w1)
        l2_prefetch.issue(x, (w2, w1))
        out = gemv_mod.linear(torch.relu(y), w2)
        l2_prefetch.join(out)
        return out

    chain(x)  # compile outside the capture (eager: no branch)
    assert not l2_prefetch._pending
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(x)
    assert not l2_prefetch._pending  # the capture ended joined
    assert prefetch_launches(graph) == 1
    for _ in range(3):
        x.copy_(torch.randn(1, k, device="cuda").to(torch.bfloat16))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, chain(x), rtol=0, atol=0)


def greedy(n: int = 20) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize(
    "model,spec",
    [
        ("tiny-llama", {}),
        ("tiny-llama", dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=8)),
        ("tiny-llama", dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=8,
                            speculative_draft_model_path="tiny-dflash")),
        ("tiny-kimi", {}),
        ("tiny-kimi", dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=8)),
    ],
    ids=["llama-plain", "llama-ddtree-ngram", "llama-ddtree-dflash", "kimi-plain",
         "kimi-ddtree-ngram"],
)  # fmt: skip
def test_engines_with_it_on_give_the_tokens_of_engines_with_it_off(monkeypatch, model, spec):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (40,), generator=g).tolist() for _ in range(3)]
    prompts.append(list(range(65, 80)) * 3)  # repetitive: the n-gram drafter hits
    outs = {}
    for mb in (0, 1):
        monkeypatch.setattr(l2_prefetch, "budget_bytes", lambda mb=mb: mb << 20)
        llm = LLM(model, device="cuda", num_pages=256, cuda_graph_max_bs=4,
                  **spec)  # fmt: skip
        outs[mb] = [o.token_ids for o in llm.generate(prompts, greedy())]
        named = sum(bool(m.l2_next) for m in llm.runner.model.modules() if hasattr(m, "l2_next"))
        launches = prefetch_launches(llm.runner.graphs.steps[(1, 1)].graph)
        assert named > 0 and launches == (named if mb else 0)  # a branch a layer, with a budget
        if spec:
            assert llm.spec_stats["rounds"] > 0
        assert not l2_prefetch._pending
        del llm
    assert outs[1] == outs[0]
