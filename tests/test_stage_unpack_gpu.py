"""engine/stage_unpack.py inside real CUDA graphs (TREEVERIFY_STAGE_UNPACK=1): every captured
bucket's replay fills its buffers from the stage exactly as the copies did, and engines give the
same greedy tokens with the kernel as with the copies (tiny-code with its DFlash drafter: plain
steps launched ahead, whole captured rounds; tiny-kimi: MLA + MoE, plain and DDTREE steps).
Skipped without a GPU; tests/test_stage_unpack_interpret.py runs the kernel on the CPU.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")
pytest.importorskip("triton")

from treeverify.engine.llm import LLM  # noqa: E402
from treeverify.engine.sampling_params import SamplingParams  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ENGINES = {
    "tiny-code-dflash": dict(model="tiny-code", speculative_algorithm="DDTREE",
                             speculative_ddtree_budget=16, speculative_adaptive=False),
    "tiny-kimi-ddtree": dict(model="tiny-kimi", speculative_algorithm="DDTREE",
                             speculative_ddtree_budget=8),
}  # fmt: skip


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 200, (30 + 7 * i,), generator=g).tolist() for i in range(n)]


def _poison_differs(buf: torch.Tensor, staged: torch.Tensor) -> torch.Tensor:
    """A safe value that differs from the staged one everywhere (0 or 1; the mask's words
    inverted): a buffer the kernel missed keeps it and is seen."""
    if buf.dtype == torch.bool:
        return staged == 0
    return torch.where(staged == 0, 1, 0).to(buf.dtype)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_the_kernel_fills_every_buffer_and_tokens_match_the_copies(engine, monkeypatch):
    knobs = dict(ENGINES[engine])
    model = knobs.pop("model")
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = _prompts(3, seed=len(engine))
    outs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("TREEVERIFY_STAGE_UNPACK", flag)
        llm = LLM(model, device="cuda", num_pages=256, cuda_graph_max_bs=4, **knobs)
        outs[flag] = [o.token_ids for o in llm.generate(prompts, sp)]  # batch 3 (bucket 4)
        outs[flag].append(llm.generate(prompts[:1], sp)[0].token_ids)  # batch 1
        graphs = llm.runner.graphs
        assert graphs is not None and graphs.replays > 0
        if flag == "1":
            checked = 0
            for (b, n), stage in graphs.stages.items():
                if (b, n) not in graphs.steps:
                    continue
                with torch.inference_mode():  # (the buffers are inference tensors)
                    targets = graphs._targets(b, n)
                    for field, buf in targets:
                        buf.copy_(_poison_differs(buf, stage.views[field]))
                    graphs.steps[(b, n)].graph.replay()
                    torch.cuda.synchronize()
                    for field, buf in targets:
                        want = stage.views[field]
                        want = want != 0 if buf.dtype == torch.bool else want.to(buf.dtype)
                        assert torch.equal(buf, want), (b, n, field)
                checked += 1
            assert checked >= 3, checked
        del llm
    assert outs["1"] == outs["0"]
