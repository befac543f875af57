"""Print the markdown table docs/performance.md shows for one `treeverify bench kernel` JSON.

python scripts/perf_table.py bench_results/2026-11-29-h200-cuda-v5-grid.json
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict


def main(path: str) -> None:
    with open(path) as f:
        d = json.load(f)
    backends = list(d["summary"])
    print(
        f"Run: {d['date']}, {d['gpu']}, commit {d['commit']}, page size {d['page_size']}, "
        f"{d['reps_per_graph']} launches per graph, median of {d['replays']} replays.\n"
    )
    head = " | ".join(f"{b} µs | {b} eff | {b} TFLOP/s | {b} TB/s" for b in backends)
    print(f"| case | floor µs | {head} | rel err |")
    print("|" + " --- |" * (2 + 4 * len(backends) + 1))
    per = defaultdict(dict)
    for r in d["rows"]:
        per[r["case"]][r["backend"]] = r
    for name, rs in per.items():
        first = next(iter(rs.values()))
        cells = []
        for b in backends:
            r = rs.get(b, {})
            if "us" in r:
                cells.append(
                    f"{r['us']:.1f} | {r['efficiency']:.1%} | {r['tflop_per_s']:.0f} | "
                    f"{r['tb_per_s']:.2f}"
                )
            else:
                cells.append("- | - | - | -")
        err = max((r.get("rel_err", 0) for r in rs.values()), default=0)
        print(f"| {name} | {first['floor_us']:.1f} | {' | '.join(cells)} | {err:.1e} |")
    print()
    fam = defaultdict(list)
    for r in d["rows"]:
        if "efficiency" in r:
            fam[(r["backend"], f"{r['model']} N={r['N']}")].append(r["efficiency"])
    print("| backend | family | cases | geomean | min | max |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (b, f), xs in fam.items():
        g = math.exp(sum(map(math.log, xs)) / len(xs))
        print(f"| {b} | {f} | {len(xs)} | {g:.1%} | {min(xs):.1%} | {max(xs):.1%} |")
    for b, s in d["summary"].items():
        if s["geomean_efficiency"]:
            print(
                f"| {b} | **all** | {s['cases']} | **{s['geomean_efficiency']:.1%}** | "
                f"{s['min_efficiency']:.1%} | {s['max_efficiency']:.1%} |"
            )


if __name__ == "__main__":
    main(sys.argv[1])
