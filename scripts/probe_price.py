"""What a probe costs in the engine, read from bench_pair passes: for every interleaved pass of an
adaptive engine on one text, its wall (steps + outside them) minus plain decoding's in the same
pass, against the pass's probes (`explorations` in its decision log); a least-squares line
gives the price of one probe (ms) and what the engine costs beyond plain decoding with none.

    python scripts/probe_price.py bench_results/*-pair_*.json [--text prose-sampled]
        [--config "DDTREE(dflash) adaptive<=64"] [--json out.json]

No GPU, no torch: the pair files' own figures. A pass whose steps differ from plain decoding's
median step by more than noise (rounds that pay) is not a probe's cost: use it on text where
the adaptive engine stays at plain decoding between probes (prose sampled at T=1).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def passes(files: list[Path], text: str, config: str, batch: int = 1) -> list[dict]:
    """One row per pass at `batch` requests: file, pass index, probes, rounds, the adaptive
    engine's extra ms. Files without per-pass walls or decision logs (older bench_pair
    versions) and passes the two rows do not both have are left out."""
    out = []
    for f in files:
        rows = {r["config"]: r for r in json.loads(f.read_text())["rows"]
                if r.get("text") == text and r.get("batch", 1) == batch}  # fmt: skip
        ada, plain = rows.get(config), rows.get("none")
        if ada is None or plain is None or not ada.get("passes_decisions"):
            continue
        walls_a, walls_p = ada.get("passes_step_walls"), plain.get("passes_step_walls")
        if not walls_a or not walls_p:
            continue
        decisions = ada["passes_decisions"]
        n = min(len(walls_a), len(walls_p), len(decisions))
        triples = zip(walls_a[:n], walls_p[:n], decisions[:n], strict=True)
        for i, (wa, wp, dec) in enumerate(triples):
            extra = (wa["step_ms_sum"] + wa["outside_ms"]) - (wp["step_ms_sum"] + wp["outside_ms"])
            rounds = sum(v for k, v in dec["steps_by_budget"].items() if k != "0")
            out.append({"file": f.name, "pass": i, "probes": dec["explorations"],
                        "rounds": rounds, "extra_ms": round(extra, 2)})  # fmt: skip
    return out


def fit(rows: list[dict]) -> tuple[float, float]:
    """Least squares extra_ms = a * probes + b: (a, b)."""
    n = len(rows)
    xs, ys = [r["probes"] for r in rows], [r["extra_ms"] for r in rows]
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("every pass made the same number of probes: no slope to fit")
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return a, my - a * mx


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--text", default="prose-sampled")
    ap.add_argument("--config", default="DDTREE(dflash) adaptive<=64")
    ap.add_argument("--batch", type=int, default=1, help="the rows of this many requests")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rows = passes(args.files, args.text, args.config, args.batch)
    if len(rows) < 2:
        print(f"fewer than two passes of {args.config!r} on {args.text!r} at b={args.batch} "
              "in these files")  # fmt: skip
        return 1
    for r in rows:
        print(f"{r['file'][:48]:<48} pass {r['pass']}  probes {r['probes']:>2}  rounds "
              f"{r['rounds']:>2}  extra {r['extra_ms']:6.1f} ms")  # fmt: skip
    a, b = fit(rows)
    print(f"{len(rows)} passes: a probe costs {a:.2f} ms beyond plain decoding; with none the "
          f"engine costs {b:.2f} ms a pass more")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"text": args.text, "config": args.config,
                                         "batch": args.batch,
                                         "probe_ms": round(a, 3), "base_ms": round(b, 3),
                                         "passes": rows}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
