"""models/pdl.py: which launches of the decode path's Triton kernels use programmatic dependent
launch. On the CPU (and the interpreter) never (the switch itself: tests/test_check_cli.py). The
GPU side (kernels launched by PDL against eager, inside CUDA graphs) is in
tests/test_fused_routing_gpu.py and tests/test_gemv_gpu.py."""

from __future__ import annotations

import torch

from treeverify.models import pdl


def test_cpu_tensors_never_take_pdl(monkeypatch):
    monkeypatch.setenv("TREEVERIFY_TRITON_PDL", "1")
    assert pdl.flags(torch.zeros(2)) == {"PDL": False}
    assert pdl.describe().startswith("PDL: ")


def test_gdc_pair_matches_availability():
    wait, trigger = pdl.gdc()
    assert (wait is None) == (trigger is None) == (not pdl.available())
