"""Sweep the Triton backend's tile configs on a GPU, then time the 54-case grid with the winners.

For each config family (MLA; GQA with >= 128 packed rows per KV head; GQA with fewer) time a few
spill-free candidates (see kernels/triton/aot_check.py) on representative grid cases, checking
each against the reference; then run the whole grid with the best per family (patched into
choose_config for this process) and write both as JSON. Run on the GPU machine:

    PYTHONPATH=src python3 scripts/triton_sweep.py --out DIR
    TRITON_INTERPRET=1 PYTHONPATH=src python3 scripts/triton_sweep.py --smoke   (CPU, code paths)
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from treeverify.bench.cases import Case, load_grid, make_inputs
from treeverify.kernels.reference import tree_attention_reference
from treeverify.kernels.triton import runner as trt

CANDIDATES = {  # (bm, bn, num_warps, num_stages); the first is the current choice
    "mla": [(64, 32, 8, 3), (64, 16, 8, 4), (64, 32, 8, 2)],
    "gqa_big": [(128, 32, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3)],
    "gqa_small": [(64, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 4)],
}
REPRESENTATIVE = {
    "mla": ["kimi-k2-mla-tp1/B8/L8192/N16"],
    "gqa_big": ["llama8b-gqa/B8/L8192/N64"],
    "gqa_small": ["llama8b-gqa/B8/L8192/N16"],
}


def family(mla: bool, rows: int, dv: int) -> str:
    if mla or dv >= 256:
        return "mla"
    return "gqa_big" if rows >= 128 else "gqa_small"


def time_config(case: Case, inp: dict, cfg: tuple, device: str) -> tuple[float, float]:
    """(seconds per launch, rel err) of one config on one case, via CUDA-graph replay on a GPU."""
    config = trt.TritonConfig(*cfg)
    total_q = inp["q"].shape[0]
    att = trt.TritonTreeAttention(
        case.hq, case.hkv, case.dqk, case.dv, case.mla, case.B, case.N, case.L + case.N,
        total_q, device, inp["q"].dtype, config=config,
    )  # fmt: skip
    o_shape, lse_shape = att.workspace_shapes()
    part_o = torch.empty(o_shape, dtype=torch.float32, device=device)
    part_lse = torch.empty(lse_shape, dtype=torch.float32, device=device)
    out = torch.full((total_q, case.hq, case.dv), float("nan"), dtype=inp["q"].dtype,
                     device=device)  # fmt: skip
    args = (inp["q"], inp["k_cache"], inp["v_cache"], out, inp["block_table"],
            inp["prefix_lens"], inp["qo_indptr"], inp["tree_mask"], part_o, part_lse,
            inp["sm_scale"])  # fmt: skip
    att.launch(*args)
    ref = tree_attention_reference(
        inp["q"], inp["k_cache"], inp["v_cache"], inp["block_table"], inp["prefix_lens"],
        inp["qo_indptr"], inp["tree_mask"], inp["sm_scale"], v_head_dim=inp["v_head_dim"],
        check_data=False,
    )  # fmt: skip
    err = float((out.double() - ref.double()).norm() / ref.double().norm())
    if device != "cuda":
        return float("nan"), err
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            att.launch(*args)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / 10)
    return sorted(times)[len(times) // 2], err


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--smoke", action="store_true", help="tiny cases on the CPU interpreter")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.smoke else "cuda"
    cases = {c.name: c for c in load_grid()[0]}
    sweep, best = [], {}
    for fam, names in REPRESENTATIVE.items():
        scores = {}
        for cfg in CANDIDATES[fam]:
            logs = []
            for name in names:
                case = cases[name]
                if args.smoke:  # same family, interpreter-sized
                    hq, hkv = (2, 1) if case.mla else (8, 2)
                    case = Case(case.model, 1, 70, case.N, hq, hkv, case.dqk, case.dv, case.mla)
                inp = make_inputs(case, page_size=16, device=device, seed=7)
                t0 = time.perf_counter()
                try:
                    secs, err = time_config(case, inp, cfg, device)
                except Exception as exc:  # a config that fails to compile is a row, not a stop
                    sweep.append({"family": fam, "case": name, "config": cfg, "error": str(exc)})
                    print(f"{fam:<9} {name:<32} {cfg} ERROR {exc}", flush=True)
                    logs = None
                    break
                ok = err <= 5e-3
                sweep.append({"family": fam, "case": name, "config": cfg, "us": secs * 1e6,
                              "rel_err": err, "ok": ok,
                              "wall_s": time.perf_counter() - t0})  # fmt: skip
                print(f"{fam:<9} {name:<32} {cfg} {secs * 1e6:9.1f} us err {err:.1e}", flush=True)
                if not ok:
                    logs = None
                    break
                logs.append(math.log(secs) if secs == secs else 0.0)
            if logs:
                scores[cfg] = sum(logs)
        best[fam] = min(scores, key=scores.get) if scores else CANDIDATES[fam][0]
        print(f"best {fam}: {best[fam]}", flush=True)
        record = {"sweep": sweep, "best": {k: list(v) for k, v in best.items()}}
        (out / "triton_sweep.json").write_text(json.dumps(record, indent=1))
    if args.smoke:
        return

    original = trt.choose_config

    def patched(*, hq, hkv, dqk, dv, mla, max_tree, dtype):
        if dtype == torch.float32:
            return original(hq=hq, hkv=hkv, dqk=dqk, dv=dv, mla=mla, max_tree=max_tree,
                            dtype=dtype)  # fmt: skip
        bm, bn, w, s = best[family(mla, max_tree * (hq // hkv), dv)]
        rows = max_tree * (hq // hkv)
        bm = min(bm, max(16, trt._next_pow2(rows)))
        return trt.TritonConfig(bm, bn, w if bm >= 64 else 4, s)

    trt.choose_config = patched
    from treeverify.bench.kernel import print_table, run_grid, write_json

    result = run_grid(["triton"])
    result["triton_configs"] = {k: list(v) for k, v in best.items()}
    result["command"] = "scripts/triton_sweep.py (grid with the sweep's winners)"
    write_json(result, out / "bench_triton_swept.json")
    print_table(result)


if __name__ == "__main__":
    main()
