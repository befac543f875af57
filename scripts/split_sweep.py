"""Time the CUDA backend on grid cases at every forced split count (TREEVERIFY_CUDA_MAX_SPLITS),
beside the count the policy (kernels/splits.py) picks: which split counts the policy should
have chosen, and what the fp32 partials of a split cost. GPU only.

    PYTHONPATH=src python scripts/split_sweep.py [--only mla] [--max-floor-us 120] \
        [--splits 1,2,4,8,16,32,64] [--json out.json]

Each row: case, splits (0 = the policy's own choice, its count in `policy_splits`), us, rel_err
against the reference, and the partial bytes written (splits x rows x dv x 4, read back once
by the merge). The table printed last gives, per case, the policy's time and the best forced
count's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from treeverify.bench.cases import Case, floor_seconds, load_grid, make_inputs
from treeverify.bench.kernel import _ref_args, _rel_err, time_plan
from treeverify.kernels.reference import tree_attention_reference


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="cases whose name contains this")
    ap.add_argument("--max-floor-us", type=float, default=120.0, help="skip larger cases")
    ap.add_argument("--splits", default="1,2,4,8,16,32,64")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument(
        "--custom",
        action="append",
        default=[],
        help="an extra GQA case MODEL:HQ:HKV:D/B<b>/L<l>/N<n> (e.g. tiny-code:4:2:64/B1/L512/N17, "
        "a tiny model's verify step); with --custom only these run",
    )
    ap.add_argument(
        "--merge-modes",
        default="auto",
        help="TREEVERIFY_CUDA_SPLIT_MERGE values to time each split count under (auto,forward)",
    )
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("split_sweep: needs a CUDA GPU", file=sys.stderr)
        return 2
    counts = [int(s) for s in args.splits.split(",")]
    cases, ceilings = load_grid()
    if args.custom:
        cases = [custom_case(c) for c in args.custom]
    modes = args.merge_modes.split(",")
    rows, table = [], []
    for i, case in enumerate(cases):
        floor = floor_seconds(case, ceilings)
        if args.only not in case.name or floor * 1e6 > args.max_floor_us:
            continue
        inp = make_inputs(case, page_size=args.page_size, device="cuda", seed=2000 + i)
        ref = tree_attention_reference(*_ref_args(inp), v_head_dim=inp["v_head_dim"],
                                       check_data=False)  # fmt: skip
        rows_here = []
        for mode in modes:
            os.environ["TREEVERIFY_CUDA_SPLIT_MERGE"] = mode
            for forced in [0, *counts]:
                if forced:
                    os.environ["TREEVERIFY_CUDA_MAX_SPLITS"] = str(forced)
                else:
                    os.environ.pop("TREEVERIFY_CUDA_MAX_SPLITS", None)
                secs, out, plan = time_plan(case, inp, args.page_size, reps=10, replays=20)
                s = plan.split_policy.max_splits
                row = {
                    "case": case.name, "merge": mode, "splits": forced,
                    "policy_splits": s if not forced else None,
                    "us": secs * 1e6, "floor_us": floor * 1e6, "efficiency": floor / secs,
                    "rel_err": _rel_err(out, ref),
                    "partial_mb": (s * inp["q"].shape[0] * case.hq * case.dv * 4 / 1e6
                                   if s > 1 else 0),
                }  # fmt: skip
                rows_here.append(row)
                print(f"{case.name:<34} {mode:>7} splits {forced or f'policy={s}':>10} "
                      f"{row['us']:8.1f} us eff {row['efficiency']:6.1%} err {row['rel_err']:.1e} "
                      f"partials {row['partial_mb']:6.1f} MB", flush=True)  # fmt: skip
        os.environ.pop("TREEVERIFY_CUDA_MAX_SPLITS", None)
        os.environ.pop("TREEVERIFY_CUDA_SPLIT_MERGE", None)
        policy = rows_here[0]
        best = min(rows_here[1:], key=lambda r: r["us"])
        table.append((case.name, policy["policy_splits"], policy["us"],
                      f"{best['splits'] or 'p'}/{best['merge']}", best["us"]))  # fmt: skip
        rows += rows_here
        del inp, ref
        torch.cuda.empty_cache()
    print(f"\n{'case':<34} {'policy':>7} {'us':>8} {'best':>12} {'us':>8} {'gain':>6}")
    for name, ps, pus, bs, bus in table:
        print(f"{name:<34} {ps:>7} {pus:8.1f} {bs:>12} {bus:8.1f} {pus / bus:6.2f}x")
    if args.json:
        meta = {"gpu": torch.cuda.get_device_name(), "command": " ".join(sys.argv),
                "commit": os.environ.get("TREEVERIFY_COMMIT")}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(meta | {"rows": rows}, f, indent=1)
    return 0


def custom_case(spec: str) -> Case:
    """MODEL:HQ:HKV:D/B<b>/L<l>/N<n> -> a GQA Case (bf16, D for both K and V)."""
    try:
        shape, b, l_, n = spec.split("/")
        model, hq, hkv, d = shape.split(":")
        return Case(model, int(b[1:]), int(l_[1:]), int(n[1:]), int(hq), int(hkv), int(d),
                    int(d), False)  # fmt: skip
    except ValueError as e:
        why = f"--custom: expected MODEL:HQ:HKV:D/B<b>/L<l>/N<n>, got {spec!r} ({e})"
        raise SystemExit(why) from None


if __name__ == "__main__":
    raise SystemExit(main())
