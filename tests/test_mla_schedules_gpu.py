"""The two sm_90a MLA kernels (TREEVERIFY_CUDA_MLA_SCHEDULE: pair = v10, the default; split = v9)
against the reference on the cases the pair schedule makes special.

Skipped where no CUDA GPU exists; scripts/gpu-check and scripts/mla_schedule_ab run them on the
H200 (where sm_90a picks the wgmma kernels). Outputs are poisoned with NaN before the kernel
runs; inputs are fresh random data.
"""

from __future__ import annotations

import pytest
import torch

from test_cuda_gpu import TOL, _cuda, _poisoned, _reference, _rel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# MLA edge cases for the pair schedule (v10: warpgroups take even / odd tiles): tile counts of
# 1, 2, 3, 4+ per split (an odd count runs its last odd tile fully masked), empty prefixes, a
# tree crossing a tile edge, many splits, 128 heads (two row tiles a node).
MLA_EDGES = [
    (8, 16, [0, 1, 47, 63, 64, 65, 191], [1, 16, 17, 1, 64, 3, 1]),
    (128, 1, [5000, 130], [16, 64]),
    (16, 64, [70000], [33]),
]


@pytest.mark.parametrize("schedule", ["pair", "split"])
@pytest.mark.parametrize("edge", MLA_EDGES, ids=["tiles1-4", "heads128", "long"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_mla_schedules_match_reference(schedule, edge, dtype, monkeypatch):
    """Both sm_90a MLA kernels (TREEVERIFY_CUDA_MLA_SCHEDULE) against the reference."""
    from treeverify.bench.cases import Case, make_inputs

    monkeypatch.setenv("TREEVERIFY_CUDA_MLA_SCHEDULE", schedule)
    hq, page, prefixes, trees = edge
    case = Case("mla", len(prefixes), max(prefixes), max(trees), hq, 1, 576, 512, True)
    inp = make_inputs(case, page_size=page, device="cuda", dtype=dtype, seed=len(prefixes) * 7,
                      prefix_lens=prefixes, tree_sizes=trees)  # fmt: skip
    out = _cuda(inp, out=_poisoned(inp, 512))
    assert _rel(out, _reference(inp)) <= TOL
