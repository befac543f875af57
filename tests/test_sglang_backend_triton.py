"""treeverify's SGLang backend with a real kernel on the CPU: the Triton plan on Triton's
interpreter (TRITON_INTERPRET=1) behind SGLang's verify batch (faked faithfully,
tests/sglang_fakes.py), eager and through the graph hooks, against float64 brute force.

Skipped where triton is missing or a GPU is present (scripts/gpu-sglang covers the GPU)."""

from __future__ import annotations

import importlib.util
import os
import random

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if torch.cuda.is_available():
    pytest.skip("a GPU is present: scripts/gpu-sglang runs there", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are decorated (first import)

from sglang_fakes import brute_force_attention, make_verify_case  # noqa: E402
from treeverify.integrations.sglang.backend import TreeverifyAttnBackend  # noqa: E402
from treeverify.integrations.sglang.geometry import VerifyGeometry  # noqa: E402
from treeverify.kernels.triton.runner import INTERPRETED  # noqa: E402

if not INTERPRETED:
    pytest.skip(
        "triton kernels were loaded before TRITON_INTERPRET was set", allow_module_level=True
    )


@pytest.mark.parametrize(
    "mla,page_size,hq,hkv,d,dv", [(False, 16, 4, 2, 64, 64), (True, 1, 2, 1, 576, 512)], ids=str
)
def test_triton_plan_behind_sglang_batches(mla, page_size, hq, hkv, d, dv):
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    g = VerifyGeometry(num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=d, head_dim_v=dv, mla=mla,
                       page_size=page_size, max_context_len=160, dtype=torch.float32,
                       device=torch.device("cpu"))  # fmt: skip
    backend = TreeverifyAttnBackend(
        type("Stock", (), {"init_cuda_graph_state": lambda *a: None})(), g, kernel="triton"
    )
    backend.init_cuda_graph_state(2, 2 * 9)
    capture = make_verify_case(rng, page_size=page_size, mla=mla, n=9, prefix=[1, 1], hkv=hkv,
                               d=d, dv=dv)  # fmt: skip
    backend.init_forward_metadata_out_graph(capture.batch, in_capture=True)
    layer = type("Layer", (), {"layer_id": 0, "scaling": d**-0.5, "logit_cap": 0.0})()
    for step in range(2):  # eager, then a "replay" into the captured plan's buffers
        prefix = [rng.randint(0, 70) for _ in range(rng.randint(1, 2))]
        case = make_verify_case(rng, page_size=page_size, mla=mla, n=9, prefix=prefix, hkv=hkv,
                                d=d, dv=dv)  # fmt: skip
        if step == 0:
            backend.init_forward_metadata(case.batch)
        else:
            backend.init_forward_metadata_out_graph(case.batch)
        t = case.k_draft.shape[0]
        q = torch.randn(t, hq * d, generator=torch.Generator().manual_seed(seed + step))
        out = backend.forward(q, case.k_draft, case.v_draft, layer, case.batch)
        want = brute_force_attention(case, q.view(t, hq, d), 0, hq, dv, layer.scaling, mla)
        torch.testing.assert_close(out.view(t, hq, dv).double(), want, rtol=2e-4, atol=2e-5)
