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
    """Every linear layer on cuBLAS (TREEVERIFY_SKINNY_GEMM=0, TREEVERIFY_DECODE_GEMV=0) for a
    test comparing two engine paths token for token where one pads a batch (or the drafter's
    context rows) to its graph bucket and the other does not (eager steps, or another step
    path): the GEMV takes one row, the few-row kernel 2..32 and cuBLAS more, each summing in its
    own order, so 27 real rows (eager) and 36 padded ones (a graph) round differently and part
    at a near-tie (seen on the H100: CHAIN-8 at batch 3 in bucket 4). Both kernels have their
    own graph-vs-eager tests at equal row counts."""
    from linear_switches import linear_switches

    yield from linear_switches(monkeypatch, TREEVERIFY_SKINNY_GEMM="0", TREEVERIFY_DECODE_GEMV="0")
