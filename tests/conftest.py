"""Test set-up: import treeverify from this checkout's src/ even when it is not installed."""

from __future__ import annotations

import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

import pytest  # noqa: E402


@pytest.fixture
def same_kernels_at_any_padding(monkeypatch):
    """TREEVERIFY_SKINNY_GEMM=0 for a test comparing two engine paths token for token where one
    pads a batch to its graph bucket and the other does not (eager steps, or another step
    path): the few-row kernel takes a linear of <= 32 rows and cuBLAS a larger one, and the two
    sum in different orders, so 27 real rows (eager) and 36 padded ones (a graph) would round
    differently and part at a near-tie (seen on the H100: CHAIN-8 at batch 3 in bucket 4). The
    few-row kernel has its own graph-vs-eager tests at equal row counts."""
    from treeverify.models import gemv

    monkeypatch.setenv("TREEVERIFY_SKINNY_GEMM", "0")
    gemv.skinny_enabled.cache_clear()
    yield
    monkeypatch.delenv("TREEVERIFY_SKINNY_GEMM")
    gemv.skinny_enabled.cache_clear()
