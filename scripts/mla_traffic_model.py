"""Bytes moved between the SMs and L2 by the MLA grid cases, against their measured time.

A model for issue 15's small MLA cases (docs/performance.md, twenty-sixth session): every CTA of
the sm_90a MLA forward loads its 64 query rows (64 x 576 bf16), every 64-key latent tile of its
split (64 x 576 bf16), and writes its fp32 partial output (64 x 512 x 4 B) when the request is
split; the merge reads the partials back. If these cases are bound by the SMs' intake (the
GQA kernels' ~13-16 B a cycle an SM, seventeenth-nineteenth sessions), time ~ bytes / (SMs in
use x intake), and the table's implied TB/s sits near 128 SMs' worth of it; the `bf16 partials`
column predicts the time with the partials stored as bf16 (half their bytes) at the same rate:
a prediction v29 refuted on the H200 (0.70-0.84x; the partials do not cost their bytes at the
intake rate; docs/performance.md), kept as the record of what was predicted.
CPU only (PYTHONPATH=src):  python scripts/mla_traffic_model.py [--grid FILE] [--max-eff 0.4]
    python scripts/mla_traffic_model.py --sweep bench_results/<date>-split_sweep.json
(the tenth session's: 2026-12-02-h200-c29bb0a-split_sweep.json)
"""

from __future__ import annotations

import argparse
import json
import math

from treeverify.bench.cases import load_grid

ROWS, KEYS = 64, 64  # the MLA kernels' row tile and key tile
DQK, DV = 576, 512
SMS = 132  # H200
DEFAULT_GRID = "bench_results/2026-12-04-h200-af07f17-grid_page16_best_of_2.json"  # kernels v28


def traffic(row: dict) -> dict:
    """Bytes of one grid row's verify: Q loads, latent tiles, partials written and read back."""
    rows = row["N"] * row["hq"]
    m_tiles = math.ceil(rows / ROWS)
    tiles = math.ceil((row["L"] + row["N"]) / KEYS)
    splits = min(row["splits"], tiles)
    ctas = row["B"] * m_tiles * splits
    q = ctas * ROWS * DQK * 2
    kv = row["B"] * m_tiles * tiles * KEYS * DQK * 2
    partials = 2 * row["B"] * rows * splits * DV * 4 if splits > 1 else 0  # written + read
    out = row["B"] * rows * DV * 2
    return {"ctas": ctas, "splits": splits, "q": q, "kv": kv, "partials": partials, "out": out}


def sweep(path: str, clock_hz: float) -> None:
    """The model on scripts/split_sweep.py's JSON: the bytes a cycle each SM in use moved, per
    forced split count (roughly constant if the cases are bound by the SMs' intake)."""
    with open(path) as f:
        data = json.load(f)
    cases = {c.name: c for c in load_grid()[0]}  # the sweep's rows name grid cases
    print(f"split sweep {path} (commit {data['commit']}); B a cycle an SM at {clock_hz / 1e9} GHz")
    for r in data["rows"]:
        case = cases[r["case"]]
        if not case.mla:
            continue
        splits = r["splits"] or r["policy_splits"]
        row = {"B": case.B, "L": case.L, "N": case.N, "hq": case.hq, "splits": splits}
        t = traffic(row)
        total = t["q"] + t["kv"] + t["partials"] + t["out"]
        per_sm = total / (r["us"] * 1e-6) / min(t["ctas"], SMS) / clock_hz
        print(f"{r['case']:<32} splits {row['splits']:3d} CTAs {t['ctas']:5d} {r['us']:8.1f} us "
              f"{total / 1e6:6.1f} MB {per_sm:5.1f} B/cycle/SM")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", default=DEFAULT_GRID)
    p.add_argument("--max-eff", type=float, default=0.4, help="only cases under this efficiency")
    p.add_argument("--sweep", help="a scripts/split_sweep.py JSON: the per-SM rate per split count")
    p.add_argument("--clock-ghz", type=float, default=1.98, help="SM clock for --sweep")
    args = p.parse_args()
    if args.sweep:
        sweep(args.sweep, args.clock_ghz * 1e9)
        return 0
    with open(args.grid) as f:
        grid = json.load(f)
    print(f"grid {args.grid} (commit {grid['commit']})")
    print(f"{'case':<32} {'us':>6} {'eff':>6} {'splits':>6} {'CTAs':>5} {'Q MB':>6} {'KV MB':>6} "
          f"{'part MB':>7} {'TB/s':>5} {'bf16 partials':>14}")  # fmt: skip
    rows = [r for r in grid["rows"] if r.get("mla") and "us" in r]
    for r in sorted(rows, key=lambda r: r["floor_us"] / r["us"]):
        eff = r["floor_us"] / r["us"]
        if eff > args.max_eff:
            continue
        t = traffic(r)
        total = t["q"] + t["kv"] + t["partials"] + t["out"]
        rate = total / (r["us"] * 1e-6)
        halved = (total - t["partials"] / 2) / rate * 1e6
        print(f"{r['case']:<32} {r['us']:6.1f} {eff:6.1%} {t['splits']:6d} {t['ctas']:5d} "
              f"{t['q'] / 1e6:6.1f} {t['kv'] / 1e6:6.1f} {t['partials'] / 1e6:7.1f} "
              f"{rate / 1e12:5.2f} {halved:6.1f} us {r['floor_us'] / halved:5.1%}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
