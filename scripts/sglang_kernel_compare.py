"""Issue 16 part 2a (GPU, needs the sglang package): SGLang's own Triton `extend_attention_fwd`
vs our drop-in (treeverify.kernels.sglang) vs our plan, on identical random tree batches.

For each grid case (shared/bench/cases.json: GQA llama8b, MLA kimi TP8/TP1) at page sizes 1 and
16: one `make_inputs` batch, re-expressed in SGLang's layout over the same cache memory
(bench/sglang_inputs.py); every implementation's output against the reference (rel err) and ours
against SGLang's directly; each timed by CUDA-graph replay (median), efficiency vs the grid floor.
Writes JSON (one row per case x page size) and prints a table. Run on the H200 2026-12-01
(docs/sglang.md, part (a)).

    python scripts/sglang_kernel_compare.py --json out.json [--only kimi] [--pages 1,16]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys

import torch

from treeverify.bench.baselines import time_captured
from treeverify.bench.cases import floor_seconds, load_grid, make_inputs
from treeverify.bench.kernel import _git_commit, _rel_err, time_plan
from treeverify.bench.sglang_inputs import (
    call_extend_attention,
    load_sglang_extend_attention,
    sglang_layout,
)
from treeverify.kernels.reference import tree_attention_reference


def time_extend(fn, lay: dict, page_size: int, reps: int, replays: int):
    """(median seconds per call, output) of an extend_attention_fwd captured in a CUDA graph."""
    q = lay["q_extend"]
    out = torch.full((q.shape[0], q.shape[1], lay["v_head_dim"]), float("nan"), dtype=q.dtype,
                     device=q.device)  # fmt: skip
    secs, _ = time_captured(
        lambda: call_extend_attention(fn, lay, out, page_size), out, reps, replays
    )
    return secs, out.clone()


def run(args) -> dict:
    from treeverify.kernels.sglang import extend_attention_fwd as ours_dropin

    sglang_fn, where = load_sglang_extend_attention()
    cases, ceilings = load_grid()
    if args.only:
        cases = [c for c in cases if args.only in c.name]
    rows = []
    for page_size in [int(p) for p in args.pages.split(",")]:
        for i, case in enumerate(cases):
            inp = make_inputs(case, page_size=page_size, device="cuda", seed=5000 + i)
            lay = sglang_layout(inp, page_size)
            ref = tree_attention_reference(
                inp["q"], inp["k_cache"], inp["v_cache"], inp["block_table"], inp["prefix_lens"],
                inp["qo_indptr"], inp["tree_mask"], inp["sm_scale"], v_head_dim=inp["v_head_dim"],
                check_data=False,
            )  # fmt: skip
            floor = floor_seconds(case, ceilings)
            row = {"case": case.name, "page_size": page_size, "floor_us": floor * 1e6}
            outs = {}
            impls = ("sglang_triton", "ours_dropin", "ours_plan")
            for name in impls:
                try:
                    if name == "ours_plan":
                        secs, outs[name], _ = time_plan(case, inp, page_size, args.reps,
                                                        args.replays)  # fmt: skip
                    else:
                        fn = sglang_fn if name == "sglang_triton" else ours_dropin
                        secs, outs[name] = time_extend(fn, lay, page_size, args.reps, args.replays)
                except Exception as exc:  # one failing implementation is a field, not a crash
                    row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
                    continue
                row[f"{name}_us"] = secs * 1e6
                row[f"{name}_eff"] = floor / secs
                row[f"{name}_rel_err"] = _rel_err(outs[name], ref)
            if "sglang_triton" in outs:
                for name in ("ours_dropin", "ours_plan"):
                    if name in outs:
                        row[f"{name}_vs_sglang_rel"] = _rel_err(outs[name], outs["sglang_triton"])
                        row[f"{name}_speedup"] = row["sglang_triton_us"] / row[f"{name}_us"]
            rows.append(row)
            print(f"{case.name:<30} p{page_size:<3}"
                  + "".join(f" {n} {row.get(n + '_us', float('nan')):9.1f}us" for n in impls)
                  + f"  x{row.get('ours_plan_speedup', float('nan')):.1f}", flush=True)  # fmt: skip
            del inp, lay, ref, outs
            torch.cuda.empty_cache()
    summary = {}
    for key in ("ours_dropin_speedup", "ours_plan_speedup", "sglang_triton_eff", "ours_plan_eff"):
        vals = [r[key] for r in rows if key in r]
        summary[key + "_geomean"] = (
            math.exp(statistics.fmean(math.log(v) for v in vals)) if vals else None
        )
    errs = [r[k] for r in rows for k in r if k.endswith("rel_err") or k.endswith("_vs_sglang_rel")]
    summary["max_rel_err"] = max(errs) if errs else None
    summary["rows_with_errors"] = sum(any(k.endswith("_error") for k in r) for r in rows)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "commit": _git_commit(),
        "command": " ".join(sys.argv),
        "sglang_module": where,
        "sglang_version": _sglang_version(),
        "reps_per_graph": args.reps,
        "replays": args.replays,
        "summary": summary,
        "rows": rows,
    }


def _sglang_version() -> str:
    try:
        import sglang

        return getattr(sglang, "__version__", "unknown")
    except ImportError as exc:
        return f"not importable as a package ({exc})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--only", help="only cases whose name contains this")
    p.add_argument("--pages", default="1,16", help="comma list of page sizes")
    p.add_argument("--reps", type=int, default=5, help="calls captured per graph")
    p.add_argument("--replays", type=int, default=10, help="graph replays timed (median)")
    p.add_argument("--tol", type=float, default=2e-2, help="max rel err (bf16) to pass")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("sglang_kernel_compare: needs a CUDA GPU", file=sys.stderr)
        return 3
    try:
        result = run(args)
    except ImportError as exc:
        print(
            f"sglang_kernel_compare: {exc}; see docs/sglang.md (wheels to carry)", file=sys.stderr
        )
        return 3
    print(json.dumps(result["summary"], indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    worst = result["summary"]["max_rel_err"]
    failed = result["summary"]["rows_with_errors"] or worst is None or worst > args.tol
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
