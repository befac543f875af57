"""The table scripts/engine_flag_ab prints: per (suite, model, batch[, budget]) row, each value's
best time over the passes and its ratio to the first value's (the baseline).
Usage: python scripts/engine_flag_table.py OUT_DIR VALUE0 VALUE1 ... (the files
OUT_DIR/engine_v{i}_pass{p}.json that engine_flag_ab wrote, value i in the order given)."""

from __future__ import annotations

import glob
import json
import sys
from pathlib import Path

# row label -> (the JSON suite, the row's key fields, its time field)
TIMED = {
    "decode": ("decode", ("model", "batch"), "step_ms"),
    "decode forward": ("decode", ("model", "batch"), "forward_ms"),
    "verify": ("verify", ("model", "batch", "budget"), "verify_forward_ms"),
}


def best_times(files: list[str]) -> dict[tuple, float]:
    """(suite, key...) -> the least time over the files (passes) of one value."""
    best: dict[tuple, float] = {}
    for f in files:
        data = json.loads(Path(f).read_text())
        for label, (suite, keys, field) in TIMED.items():
            for row in data.get(suite, []):
                if row.get(field) is None:
                    continue
                key = (label, *(row[k] for k in keys))
                best[key] = min(best.get(key, float("inf")), row[field])
    return best


def table(out_dir: str, values: list[str]) -> list[str]:
    per_value = [best_times(sorted(glob.glob(f"{out_dir}/engine_v{i}_pass*.json")))
                 for i in range(len(values))]  # fmt: skip
    if not per_value or not per_value[0]:
        raise ValueError(f"out_dir: no engine_v0_pass*.json rows under {out_dir}")
    lines = ["row | " + " | ".join(values)]
    for key in sorted(per_value[0], key=str):
        base = per_value[0][key]
        cells = [f"{base:.3f} ms"]
        for other in per_value[1:]:
            t = other.get(key)
            cells.append("-" if t is None else f"{t:.3f} ms (x{base / t:.3f})")
        lines.append(" ".join(str(k) for k in key) + " | " + " | ".join(cells))
    return lines


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: engine_flag_table.py OUT_DIR VALUE0 [VALUE1 ...]")
    print("\n".join(table(sys.argv[1], sys.argv[2:])))
