"""scripts/probe_price.py: a probe's price fitted from bench_pair passes (synthetic pair files
with a known slope; the script reads what bench_pair writes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "probe_price.py"
sys.path.insert(0, str(SCRIPT.parent))
from probe_price import fit, passes  # noqa: E402


def _rows(probes: list[int], price: float, base: float, batch: int) -> list[dict]:
    """bench_pair's rows of one batch size: plain decoding and the adaptive engine."""
    plain = [{"step_ms_sum": 150.0 + i, "outside_ms": 4.0} for i in range(len(probes))]
    ada = [{"step_ms_sum": 150.0 + i + base + price * p, "outside_ms": 4.0}
           for i, p in enumerate(probes)]  # fmt: skip
    decisions = [{"explorations": p, "steps_by_budget": {"0": 1000, "64": p}} for p in probes]
    return [
        {"config": "none", "text": "prose-sampled", "batch": batch, "passes_step_walls": plain},
        {"config": "DDTREE(dflash) adaptive<=64", "text": "prose-sampled", "batch": batch,
         "passes_step_walls": ada, "passes_decisions": decisions},
        {"config": "none", "text": "code", "batch": batch,
         "passes_step_walls": plain},  # another text: ignored
    ]  # fmt: skip


def _pair_file(path: Path, probes: list[int], price: float, base: float,
               b8: list[int] | None = None) -> Path:  # fmt: skip
    """A pair file whose adaptive passes cost `base + price * probes` ms beyond plain's at b=1;
    with `b8`, rows at b=8 too (another price), as `--batches 1,8` writes them."""
    rows = _rows(probes, price, base, 1) + (_rows(b8, 3 * price, base, 8) if b8 else [])
    path.write_text(json.dumps({"rows": rows}))
    return path


def test_the_fitted_price_is_the_slope_the_passes_were_made_with(tmp_path):
    files = [_pair_file(tmp_path / "a.json", [2, 9, 14], 0.9, 3.5),
             _pair_file(tmp_path / "b.json", [3, 7], 0.9, 3.5)]  # fmt: skip
    rows = passes(files, "prose-sampled", "DDTREE(dflash) adaptive<=64")
    assert [r["probes"] for r in rows] == [2, 9, 14, 3, 7]
    assert rows[1]["rounds"] == 9
    a, b = fit(rows)
    assert a == pytest.approx(0.9, abs=1e-6) and b == pytest.approx(3.5, abs=1e-6)


def test_one_probe_count_has_no_slope(tmp_path):
    rows = passes([_pair_file(tmp_path / "a.json", [4, 4], 1.0, 2.0)], "prose-sampled",
                  "DDTREE(dflash) adaptive<=64")  # fmt: skip
    with pytest.raises(ValueError, match="same number of probes"):
        fit(rows)


def test_the_script_prints_the_price_and_writes_json(tmp_path):
    f = _pair_file(tmp_path / "a.json", [1, 5, 11], 0.5, 2.0)
    out = tmp_path / "price.json"
    run = subprocess.run([sys.executable, str(SCRIPT), str(f), "--json", str(out)],
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert "a probe costs 0.50 ms" in run.stdout
    assert json.loads(out.read_text())["probe_ms"] == pytest.approx(0.5)
    miss = subprocess.run([sys.executable, str(SCRIPT), str(f), "--text", "code"],
                          capture_output=True, text=True)  # fmt: skip
    assert miss.returncode == 1 and "fewer than two passes" in miss.stdout


def test_each_batch_size_is_fitted_apart_and_older_files_are_skipped(tmp_path):
    """`--batches 1,8` files hold a row per batch size (the b=8 one must not replace b=1's);
    files from before per-pass walls were kept are left out, not a KeyError."""
    f = _pair_file(tmp_path / "a.json", [2, 6, 10], 0.9, 3.0, b8=[1, 3, 5])
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"rows": [
        {"config": "none", "text": "prose-sampled", "batch": 1},
        {"config": "DDTREE(dflash) adaptive<=64", "text": "prose-sampled", "batch": 1,
         "passes_decisions": [{"explorations": 1, "steps_by_budget": {}}]}]}))  # fmt: skip
    cfg = "DDTREE(dflash) adaptive<=64"
    b1 = passes([f, old], "prose-sampled", cfg, 1)
    b8 = passes([f, old], "prose-sampled", cfg, 8)
    assert [r["probes"] for r in b1] == [2, 6, 10] and [r["probes"] for r in b8] == [1, 3, 5]
    assert fit(b1)[0] == pytest.approx(0.9) and fit(b8)[0] == pytest.approx(2.7)
