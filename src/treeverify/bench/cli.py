"""`treeverify bench kernel`: the tree-verify grid on the GPU (JSON, table, roofline PNG)."""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from treeverify.strict_args import output_file


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="benchmarks against the roofline")
    sub = p.add_subparsers(dest="bench_cmd", required=True)
    k = sub.add_parser("kernel", help="time tree attention over the 54-case grid (needs a GPU)")
    k.add_argument(
        "--backends", default="cuda",
        help="comma list of cuda,triton,torch and the optional baselines flashinfer,sglang-triton "
        "(skipped with one line why when not installed)",
    )  # fmt: skip
    k.add_argument("--page-size", type=int, default=16)
    k.add_argument("--reps", type=int, default=10, help="launches captured per CUDA graph")
    k.add_argument("--replays", type=int, default=20, help="graph replays timed (median)")
    k.add_argument("--only", help="run only cases whose name contains this")
    k.add_argument(
        "--lengths", choices=("equal", "mixed"), default="equal",
        help="equal: the grid; mixed: the B > 1 cases with prefixes drawn from 1..L per request",
    )  # fmt: skip
    k.add_argument("--no-verify", action="store_true", help="skip the reference comparison")
    k.add_argument("--json", metavar="FILE", type=output_file, help="write the results as JSON")
    k.add_argument("--plot", metavar="PNG", type=output_file, help="write a roofline plot")
    e = sub.add_parser("engine", help="engine suites on a GPU: graphs, decode, verify, spec")
    e.add_argument("--suites", default="graphs,decode,verify,spec", help="comma list")
    e.add_argument("--graphs-models", default="tiny-llama,tiny-kimi,random:llama-1b,random:mla-moe")
    e.add_argument("--decode-models", default="random:llama-1b,random:mla-moe")
    e.add_argument("--verify-models", default="random:llama-8b,random:mla-moe")
    e.add_argument("--spec-models", default="tiny-llama,random:llama-1b")
    e.add_argument("--json", metavar="FILE", type=output_file, help="write the results as JSON")
    try:  # `bench serve` needs the server extra's httpx; leave it out where that is missing
        from treeverify.server import bench_serve
    except ImportError:
        return p
    bench_serve.add_parser(sub)
    return p


def run(args: argparse.Namespace) -> int:
    if args.bench_cmd == "serve":
        from treeverify.server import bench_serve

        return bench_serve.run(args)
    import torch

    if args.bench_cmd == "engine":
        return _run_engine(args, torch)

    if not torch.cuda.is_available():
        print("treeverify bench kernel: needs a CUDA GPU (none visible)", file=sys.stderr)
        return 3
    from treeverify.bench.kernel import plot_roofline, print_table, run_grid, write_json

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    known = ("cuda", "triton", "torch", "flashinfer", "sglang-triton")
    bad = [b for b in backends if b not in known]
    if bad:
        print(f"--backends: unknown {bad}; choose from {', '.join(known)}", file=sys.stderr)
        return 64
    result = run_grid(backends, page_size=args.page_size, reps=args.reps, replays=args.replays,
                      only=args.only, verify=not args.no_verify,
                      lengths=args.lengths)  # fmt: skip
    print_table(result)
    if args.json:
        write_json(result, args.json)
    if args.plot:
        plot_roofline(result, args.plot)
    bad_err = [r for r in result["rows"] if r.get("rel_err", 0) > 5e-3 or "error" in r]
    if bad_err:
        by_backend = Counter(r["backend"] for r in bad_err)
        counts = ", ".join(f"{b} {n}" for b, n in sorted(by_backend.items()))
        print(f"{len(bad_err)} rows failed correctness or errored: {counts}", file=sys.stderr)
        for r in bad_err[:1] + [r for r in bad_err if r["backend"] != bad_err[0]["backend"]][:1]:
            why = _error_line(r["error"]) if "error" in r else f"rel_err {r['rel_err']:.3g}"
            print(f"  first {r['backend']}: {r['case']}: {why[:300]}", file=sys.stderr)
        return 2
    return 0


def _error_line(error: str) -> str:
    """The line of a row's error that says why: the first naming an error (a compiler log's
    first diagnostic), else the last."""
    lines = [ln.strip() for ln in error.strip().splitlines() if ln.strip()]
    named = [ln for ln in lines[1:] if "error" in ln.lower()]
    return (named or lines[-1:])[0]


def _run_engine(args: argparse.Namespace, torch) -> int:
    if not torch.cuda.is_available():
        print("treeverify bench engine: needs a CUDA GPU (none visible)", file=sys.stderr)
        return 3
    import json

    from treeverify.bench.engine import SUITES, print_summary, run_suites

    suites = [s.strip() for s in args.suites.split(",") if s.strip()]
    bad = [s for s in suites if s not in SUITES]
    if bad:
        print(f"--suites: unknown {bad}; choose from {', '.join(SUITES)}", file=sys.stderr)
        return 64
    models = {s: getattr(args, f"{s}_models") for s in SUITES}
    result = run_suites(suites, models)
    result["meta"] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "date": __import__("datetime").date.today().isoformat()}  # fmt: skip
    print_summary({k: v for k, v in result.items() if k != "meta"})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    errors = [r for rows in result.values() if isinstance(rows, list) for r in rows if "error" in r]
    return 2 if errors else 0
