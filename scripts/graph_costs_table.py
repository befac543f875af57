"""One table of several scripts/graph_costs_gpu.py runs (a flag A/B: gpu-round step flags_ab):
each graph's GPU ms a replay per run, and each run's change against the first.

    python3 scripts/graph_costs_table.py a.json b.json ... [--labels A B ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="graph_costs_gpu.py --json files")
    ap.add_argument("--labels", nargs="*", default=None, help="one label a run (default: file)")
    args = ap.parse_args(argv)
    labels = args.labels or [p.stem for p in args.runs]
    if len(labels) != len(args.runs):
        ap.error(f"--labels: expected {len(args.runs)} labels, got {len(labels)}")
    runs = []
    for p in args.runs:
        try:
            rows = json.loads(p.read_text())["rows"]
        except (OSError, ValueError, KeyError) as exc:
            print(f"{p}: unreadable ({type(exc).__name__}: {exc}); left out")
            runs.append(None)
            continue
        runs.append({r["graph"]: r["gpu_ms_per_replay"] for r in rows})
    graphs = next((list(r) for r in runs if r), [])
    short = [g.split(" (")[0][:14] for g in graphs]
    width = min(90, max(len(x) for x in [*labels, "run"]))  # labels whole: they name the flags
    print(f"{'run':{width}s} " + " ".join(f"{s:>14s}" for s in short))
    base = runs[0]
    for label, r in zip(labels, runs, strict=True):
        if r is None:
            print(f"{label[:width]:{width}s} (missing)")
            continue
        cells = []
        for g in graphs:
            ms = r.get(g)
            if ms is None:
                cells.append(f"{'-':>14s}")
            elif base and g in base and r is not base:
                cells.append(f"{ms:.4f} {100 * (ms / base[g] - 1):+5.1f}%".rjust(14))
            else:
                cells.append(f"{ms:.4f}".rjust(14))
        print(f"{label[:width]:{width}s} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
