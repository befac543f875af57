"""The linear-layer kernels' switches set for one test (models/gemv.py reads each once a
process, so its cached readers are cleared before and after)."""

from __future__ import annotations

from collections.abc import Iterator


def linear_switches(monkeypatch, **values: str) -> Iterator[None]:
    """Set TREEVERIFY_* switches (e.g. TREEVERIFY_SKINNY_GEMM="0") for a fixture's test."""
    from treeverify.models import gemv

    readers = (gemv.enabled, gemv.skinny_enabled, gemv.skinny_max_rows, gemv.fused_silu_enabled)
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    for read in readers:
        read.cache_clear()
    yield
    for name in values:
        monkeypatch.delenv(name)
    for read in readers:
        read.cache_clear()
