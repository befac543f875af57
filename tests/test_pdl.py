"""models/pdl.py: which launches of the decode path's Triton kernels use programmatic dependent
launch. On the CPU (and the interpreter) never; the switch is read and named in errors. The
GPU side (kernels launched by PDL against eager, inside CUDA graphs) is in
tests/test_fused_routing_gpu.py and tests/test_gemv_gpu.py."""

from __future__ import annotations

import pytest
import torch

from treeverify import env
from treeverify.models import pdl


def test_cpu_tensors_never_take_pdl(monkeypatch):
    monkeypatch.setenv("TREEVERIFY_TRITON_PDL", "1")
    assert pdl.flags(torch.zeros(2)) == {"PDL": False}
    assert pdl.describe().startswith("PDL: ")


def test_triton_pdl_switch(monkeypatch):
    monkeypatch.delenv("TREEVERIFY_TRITON_PDL", raising=False)
    assert env.triton_pdl() is False  # off until measured on a GPU
    monkeypatch.setenv("TREEVERIFY_TRITON_PDL", "yes")
    assert env.triton_pdl() is True
    monkeypatch.setenv("TREEVERIFY_TRITON_PDL", "sometimes")
    with pytest.raises(ValueError, match="TREEVERIFY_TRITON_PDL"):
        env.triton_pdl()


def test_gdc_pair_matches_availability():
    wait, trigger = pdl.gdc()
    assert (wait is None) == (trigger is None) == (not pdl.available())
