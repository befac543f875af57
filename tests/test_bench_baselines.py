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


@pytest.mark.parametrize(
    "script", ["sglang_kernel_compare.py", "sglang_backend_compare.py", "sglang_cost_model.py"]
)
def test_gpu_sglang_scripts_import_without_sglang_or_a_gpu(script, monkeypatch):
    import importlib.util
    from pathlib import Path

    monkeypatch.setitem(sys.modules, "sglang", None)
    path = Path(__file__).resolve().parents[1] / "scripts" / script
    spec = importlib.util.spec_from_file_location(f"_script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # top level only: main() is not run
    assert callable(module.main)


def test_cost_model_fits_the_measured_grid(capsys, monkeypatch):
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("_cost", root / "scripts/sglang_cost_model.py")
    cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cost)
    grid = root / "bench_results/2026-11-29-h200-cuda-v7-grid.json"
    monkeypatch.setattr(sys, "argv", ["x", "--grid", str(grid)])
    assert cost.main() == 0
    out = capsys.readouterr().out
    assert "TP8 fit (8 heads, 18 rows)" in out and "| 1024 (1025) |" in out
    import json

    t0, rate, worst, n = cost.fit(json.loads(grid.read_text())["rows"], 8)
    assert n == 18 and worst < 0.2 and 10e-6 < t0 < 40e-6 and 2e14 < rate < 4e14


def test_a_failed_jit_build_is_a_short_row_error_that_names_the_compiler_error():
    from treeverify.bench.cli import _error_line
    from treeverify.bench.kernel import short_error

    log = "Ninja build failed. Ninja output:\n" + "nvcc -c a.cu -o a.o\n" * 2000
    log += "fastdiv.cuh(39): error: qualified name is not allowed\nninja: build stopped\n"
    row_error = short_error(RuntimeError(log))
    assert len(row_error) < 2000 and "characters elided" in row_error
    assert row_error.startswith("RuntimeError: Ninja build failed")
    assert _error_line(row_error) == "fastdiv.cuh(39): error: qualified name is not allowed"
    assert short_error(ValueError("small")) == "ValueError: small"
    assert _error_line("RuntimeError: boom\nat line 2") == "at line 2"


def test_host_time_per_step_is_summarised_per_backend(capsys):
    """Ours: plan() + one graph launch a step (host_step_us); FlashInfer: its plan()
    (host_plan_us); the summary keeps each backend's median and the table prints it."""
    from treeverify.bench.kernel import _median_of, print_table

    rows = [
        {"case": "a", "backend": "cuda", "floor_us": 5.0, "us": 10.0, "efficiency": 0.5,
         "host_step_us": 30.0},
        {"case": "b", "backend": "cuda", "floor_us": 5.0, "us": 10.0, "efficiency": 0.5,
         "host_step_us": 50.0},
        {"case": "c", "backend": "cuda", "floor_us": 5.0, "us": 10.0, "efficiency": 0.5,
         "host_step_us": 40.0},
        {"case": "a", "backend": "flashinfer", "floor_us": 5.0, "us": 20.0, "efficiency": 0.25,
         "host_plan_us": 1300.0},
        {"case": "b", "backend": "flashinfer", "floor_us": 5.0, "error": "RuntimeError: x"},
    ]  # fmt: skip
    assert _median_of(rows, "cuda", ("host_step_us", "host_plan_us")) == 40.0
    assert _median_of(rows, "flashinfer", ("host_step_us", "host_plan_us")) == 1300.0
    assert _median_of(rows, "triton", ("host_step_us",)) is None
    summary = {
        "cuda": {"cases": 3, "geomean_efficiency": 0.5, "min_efficiency": 0.5,
                 "max_efficiency": 0.5, "max_rel_err": None, "host_us_median": 40.0},
    }  # fmt: skip
    print_table({"summary": summary, "rows": rows[:3]})
    out = capsys.readouterr().out
    assert "host 40 us a step (median)" in out and "fastest" not in out
    summary["cuda"]["host_min_us_median"] = 21.4  # the fastest of 20 steps, per case
    print_table({"summary": summary, "rows": rows[:3]})
    assert "host 40 us a step (median) / 21 (fastest of 20)" in capsys.readouterr().out


def test_median_round_ratio_pairs_each_round():
    """The harness's in-turns ratio: each round's base / other, then the median, so a round
    where both sides drifted together does not skew it (the medians' ratio would be 30 in the
    second case); unequal or empty rounds are an error naming the arguments."""
    from treeverify.bench.kernel import median_round_ratio

    base, other = [400.0, 440.0, 390.0, 520.0], [80.0, 88.0, 78.0, 100.0]
    assert median_round_ratio(base, other) == pytest.approx(5.0)
    assert median_round_ratio([3.0, 300.0, 30.0], [1.0, 1.0, 10.0]) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="base, other"):
        median_round_ratio([1.0], [])
    with pytest.raises(ValueError, match="base, other"):
        median_round_ratio([], [])


def test_cost_model_default_grid_is_in_the_repository(capsys, monkeypatch):
    """docs/sglang.md's tables come from the script's default grid: it must ship and fit."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("_cost", root / "scripts/sglang_cost_model.py")
    cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cost)
    monkeypatch.chdir(root)
    monkeypatch.setattr(sys, "argv", ["x"])
    assert cost.main() == 0
    out = capsys.readouterr().out
    assert cost.DEFAULT_GRID in out and "TP1 fit (64 heads, 18 rows)" in out
