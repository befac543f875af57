"""For the tests that run Triton kernels on the CPU interpreter (TRITON_INTERPRET=1): skip the
module where they cannot or should not run, and a fixture that decorates the kernels under the
interpreter.

    interpret_on_cpu("tests/test_x_gpu.py")   # before importing the module with the kernels
    from treeverify... import module
    interpreted_kernels = cache_cleared(module._kernels)   # an autouse fixture
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import pytest
import torch


def interpret_on_cpu(gpu_test: str) -> None:
    """Skip the calling test module without triton or with a GPU (`gpu_test` runs the compiled
    kernels there); else set TRITON_INTERPRET=1, read when a kernel is decorated."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed", allow_module_level=True)
    if torch.cuda.is_available():
        pytest.skip(f"a GPU is present: {gpu_test} runs there", allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"


def cache_cleared(cached: Callable) -> Callable:
    """An autouse fixture that clears a functools.cache'd kernel factory before and after each
    test, so its kernels are decorated under the interpreter, not taken from another test."""

    @pytest.fixture(autouse=True)
    def _cleared():
        cached.cache_clear()
        yield
        cached.cache_clear()

    return _cleared
