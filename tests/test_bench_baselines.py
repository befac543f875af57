"""`treeverify bench kernel` with optional baselines: a baseline that is not installed is skipped
with one line saying why (never a crash), and the result records it."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from treeverify.bench import baselines
from treeverify.bench.kernel import run_grid


@pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") or importlib.util.find_spec("sglang"),
    reason="a baseline is installed here",
)
def test_missing_baselines_are_skipped_with_one_line_why(monkeypatch, capsys):
    assert "flashinfer-python is not installed" in baselines.unavailable("flashinfer")
    why = baselines.unavailable("sglang-triton")
    assert "extend_attention_fwd not importable" in why and "\n" not in why
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "test")
    result = run_grid(["flashinfer", "sglang-triton"], only="no-such-case", verify=False)
    assert set(result["skipped_backends"]) == {"flashinfer", "sglang-triton"}
    assert result["summary"] == {} and result["rows"] == []
    err = capsys.readouterr().err.splitlines()
    assert [line.split(":")[0] for line in err] == ["flashinfer", "sglang-triton"]
    assert all(": skipped: " in line for line in err)


def test_unknown_baseline_is_a_value_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(ValueError, match="unknown baseline 'cutlass'"):
        baselines.unavailable("cutlass")
    with pytest.raises(ValueError, match="unknown baseline"):
        baselines.time_baseline("cutlass", None, {}, 16, 1, 1)
    assert baselines.geomean([2.0, 8.0]) == pytest.approx(4.0) and baselines.geomean([]) is None
