"""A small representative run of every CUDA kernel, for compute-sanitizer (memcheck/racecheck).

Both kernel families (the sm_90a wgmma kernels, then the portable mma.sync ones via
TREEVERIFY_CUDA_PORTABLE=1): GQA with a 128-row CTA and split-KV + merge, a 256-row one, MLA
with the warpgroup / warp-pair P exchange, page sizes 1 and 16, an empty prefix, a multi-word
tree mask, and the SGLang drop-in with its mask kernel; each with the split merge in the forward
(the last split CTA of a row tile merges, TREEVERIFY_CUDA_SPLIT_MERGE=forward) and as its own
kernel. Exits 1 on a wrong result.
"""

import os
import sys

import torch

sys.path.insert(0, "tests")
from test_cuda_gpu import _cuda, _poisoned, _reference, _rel, _sglang_inputs  # noqa: E402
from treeverify.bench.cases import Case, make_inputs  # noqa: E402
from treeverify.kernels.sglang import extend_attention_fwd  # noqa: E402

CASES = [
    (Case("gqa", 2, 1200, 40, 8, 2, 128, 128, False), 16, [1200, 0], [40, 3]),
    (Case("mla", 2, 700, 33, 8, 1, 576, 512, True), 1, [700, 5], [33, 20]),
    # >= 8192 keys: a balanced plan (v12: splits last in the grid, the batch's key sum)
    (Case("gqa-balanced", 2, 9000, 16, 8, 2, 128, 128, False), 16, [9000, 300], [16, 9]),
    # 64 nodes x group 4: the 256-row CTA (v21; TREEVERIFY_CUDA_GQA_256=1 below, which only
    # this case's rows reach)
    (Case("gqa-256", 2, 1300, 64, 8, 2, 128, 128, False), 16, [1300, 70], [64, 50]),
]
os.environ["TREEVERIFY_CUDA_GQA_256"] = "1"
worst = 0.0
for portable, merge in [(p, m) for p in ("0", "1") for m in ("forward", "kernel")]:
    os.environ["TREEVERIFY_CUDA_PORTABLE"] = portable
    os.environ["TREEVERIFY_CUDA_SPLIT_MERGE"] = merge
    for case, page, prefixes, trees in CASES:
        inp = make_inputs(case, page_size=page, device="cuda", seed=3, prefix_lens=prefixes,
                          tree_sizes=trees)  # fmt: skip
        out = _cuda(inp, out=_poisoned(inp, case.dv))
        err = _rel(out, _reference(inp))
        print(f"portable={portable} merge={merge} {case.model} page {page}: rel err {err:.2e}")
        worst = max(worst, err)
    sg, ours, dv = _sglang_inputs(False, 2, 16, [300, 40], seed=2)
    o = torch.full((32, 32, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    extend_attention_fwd(o_extend=o, **sg)
    err = _rel(o, _reference(ours))
    print(f"portable={portable} merge={merge} sglang drop-in: rel err {err:.2e}")
    worst = max(worst, err)
torch.cuda.synchronize()
print(f"sanitize_case: worst rel err {worst:.2e}")
sys.exit(0 if worst <= 5e-3 else 1)
