"""A launch's ctypes arguments checked against its kernel's C signature (a missing or misplaced
argument is CUDA_ERROR_INVALID_VALUE or a crash on the GPU, so the CPU checks the list)."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

CUDA_SOURCES = Path(__file__).resolve().parents[1] / "src" / "treeverify" / "kernels" / "cuda"


def assert_matches_signature(source: str, kernel: str, args: list) -> None:
    """One ctypes argument per parameter of `kernel` in kernels/cuda/`source`, in order, of the
    declared C type (pointer, long long or int)."""
    src = (CUDA_SOURCES / source).read_text()
    params = re.search(kernel + r"\(([^)]*)\)", src).group(1).split(",")
    assert len(args) == len(params), (kernel, len(args), len(params))
    for a, p in zip(args, params, strict=True):
        is_ptr = "*" in p
        assert is_ptr == isinstance(a, ctypes.c_void_p), p
        if not is_ptr:
            want = (ctypes.c_longlong if "long long" in p or "int64_t" in p
                    else ctypes.c_float if "float" in p else ctypes.c_int)  # fmt: skip
            assert isinstance(a, want), p
