"""`treeverify kernels build --arch LIST`: compile all CUDA variants, no GPU needed; a table."""

from __future__ import annotations

import argparse
import json
import sys
import time

from treeverify.kernels.cuda.variants import ALL_ARCHES, SMEM_LIMIT, all_variants
from treeverify.strict_args import output_file


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("kernels", help="build and inspect the CUDA kernels")
    sub = p.add_subparsers(dest="kernels_cmd", required=True)
    b = sub.add_parser("build", help="compile every variant with NVRTC (no GPU needed)")
    b.add_argument(
        "--arch",
        default=",".join(ALL_ARCHES),
        help=f"comma-separated archs (default: {','.join(ALL_ARCHES)})",
    )
    b.add_argument("--no-cache", action="store_true", help="recompile even if cached")
    b.add_argument("--json", metavar="FILE", type=output_file,
                   help="also write the table as JSON")  # fmt: skip
    return p


def run(args: argparse.Namespace) -> int:
    from treeverify.kernels.cuda.jit import CompileError, compile_variant, nvrtc_version

    parts = [a.strip() for a in args.arch.split(",")]
    arches = [a for a in parts if a]
    bad = [a for a in arches if a not in SMEM_LIMIT]
    if len(arches) < len(parts):  # "" or "sm_80,,": built nothing (or less) and exited 0
        bad.append("(empty)")
    if bad:
        print(f"--arch: unknown {bad}; choose from {', '.join(ALL_ARCHES)}", file=sys.stderr)
        return 64
    rows, failed = [], 0
    print(f"NVRTC {nvrtc_version()}")
    print(
        f"{'variant':<40} {'arch':<8} {'regs':>5} {'spill B':>8} {'stack B':>8} "
        f"{'smem B':>8} {'secs':>6}"
    )
    for arch in arches:
        for v in all_variants(arch):
            t0 = time.perf_counter()
            try:
                k = compile_variant(v, arch, use_cache=not args.no_cache)
            except CompileError as exc:
                failed += 1
                print(f"{v.name:<40} {arch:<8} FAILED: {str(exc).splitlines()[0]}")
                rows.append({"variant": v.name, "arch": arch, "error": str(exc)})
                continue
            secs = time.perf_counter() - t0
            over = " OVER SMEM LIMIT" if k.smem_bytes > SMEM_LIMIT[arch] else ""
            print(
                f"{v.name:<40} {arch:<8} {k.registers:>5} {k.spill_bytes:>8} "
                f"{k.stack_bytes:>8} {k.smem_bytes:>8} {secs:>6.2f}"
                f"{' (cached)' if k.cached else ''}{over}"
            )
            failed += bool(over)
            rows.append(
                {
                    "variant": v.name,
                    "arch": arch,
                    "registers": k.registers,
                    "spill_bytes": k.spill_bytes,
                    "stack_bytes": k.stack_bytes,
                    "smem_bytes": k.smem_bytes,
                    "seconds": round(secs, 3),
                    "cached": k.cached,
                }
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"nvrtc": nvrtc_version(), "variants": rows}, f, indent=1)
    print(f"{len(rows) - failed} built, {failed} failed")
    return 1 if failed else 0
