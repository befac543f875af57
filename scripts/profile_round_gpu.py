"""Where a speculative round's time goes on the GPU (torch.profiler over steady-state steps):
wall ms per step, GPU kernel ms per step (busy share), kernels, host->device syncs and
device->host copies per step, the engine's own phase seconds, the top CUDA kernels and the top
host ops by self time. Plain decoding, CHAIN, DDTREE (fixed budget) and the adaptive DDTREE
engine held at budget 0 and at 64 on the trained pair at batch 1 and 8 (`--configs
DDTREE-16,DDTREE-adaptive@16,DDTREE-adaptive`: the adaptive engine held at 16 and left to its
controller, not in the default set). Before the profiled steps, the same number of steps runs
unprofiled (wall and phase ms per step: the profiler inflates host time) and once under
cProfile (the Python functions where the host time goes).
Usage (GPU machine, repo root): PYTHONPATH=src python3 scripts/profile_round_gpu.py --json F"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from treeverify.bench.kernel import _git_commit
from treeverify.engine.llm import LLM
from treeverify.engine.sampling_params import SamplingParams

DATA = Path(__file__).resolve().parent.parent / "src/treeverify/models/data"
DEVICE = "cuda"
SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def prompts(n: int) -> list[str]:
    return json.loads((DATA / "tiny-code/heldout.json").read_text())["prompts"][:n]


FREE = -1  # `pinned` for an adaptive engine left to its controller (not held)


def build(algo: str | None, batch: int, budget: int, pinned: int | None = None,
          controller: tuple[str, ...] = ()) -> LLM:  # fmt: skip
    """`pinned`: an adaptive DDTREE engine (calibrated, controller on) held at that budget
    (FREE: not held; its controller chooses every step, as served).
    An algorithm "DDTREE-general": DDTREE with whole-round graphs off (the general path);
    "DDTREE-read-first": whole rounds without lookahead (each read before the next launch).
    `controller`: ControllerConfig KNOB=VALUE settings for an adaptive engine."""
    kw = {}
    if algo == "DDTREE-general":
        algo, kw["disable_round_graphs"] = "DDTREE", True
    elif algo == "DDTREE-read-first":
        algo, kw["round_lookahead"] = "DDTREE", False
    if algo:
        kw |= dict(speculative_algorithm=algo, speculative_ddtree_budget=budget)
        if algo == "DDTREE":
            kw["speculative_adaptive"] = pinned is not None
            if pinned is not None and controller:
                kw["speculative_controller"] = controller
    llm = LLM("tiny-code", device=DEVICE, num_pages=4096, max_num_seqs=batch,
              cuda_graph_max_bs=batch, **kw)  # fmt: skip
    if pinned is not None and pinned != FREE:
        llm.controller.pinned = pinned
    return llm


# name: (algorithm, budget, adaptive controller pinned at); "DDTREE-adaptive@0" is the adaptive
# engine's plain steps (budget 0), to compare with "none"'s
CONFIGS = {
    "none": (None, 0, None),
    "CHAIN": ("CHAIN", 15, None),
    "DDTREE-16": ("DDTREE", 16, None),
    "DDTREE-16-general": ("DDTREE-general", 16, None),
    "DDTREE-16-read-first": ("DDTREE-read-first", 16, None),
    "DDTREE-adaptive@0": ("DDTREE", 64, 0),
    "DDTREE-adaptive@64": ("DDTREE", 64, 64),
    # the adaptive engine (graphs for every bucket up to 64) held at 16, against DDTREE-16: a
    # cost of the engine's make-up (plans, graphs, buffers sized for 64) rather than its
    # controller's choices (H100, b=8 queue: its steps at 16 ran 0.71 against 0.48 ms once)
    "DDTREE-adaptive@16": ("DDTREE", 64, 16),
    # the controller choosing every step (code: mostly 16) against DDTREE-16: its host cost a
    # step where the step is host-bound (b=8), in the unprofiled wall and the Python hotspots
    "DDTREE-adaptive": ("DDTREE", 64, FREE),
}


def profile_config(name: str, algo: str | None, batch: int, budget: int, steps: int,
                   pinned: int | None = None) -> dict:  # fmt: skip
    llm = build(algo, batch, budget, pinned)
    seqs = []
    for p in prompts(batch):  # as long as the model's context allows (tiny-code: 1024 positions)
        room = llm.model_config.max_position_embeddings - len(llm.tokenizer.encode(p)) - 64
        sp = SamplingParams(temperature=0, max_tokens=room, ignore_eos=True)
        seqs.append(llm.add_request(p, sp))
    for _ in range(20):  # prefill + warm rounds
        llm.step()
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    plain_wall, plain_phases = unprofiled(llm, steps, sync)
    host_functions = python_hotspots(llm, steps, sync)
    llm.reset_stats()
    sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            llm.step()
        sync()
        wall = time.perf_counter() - t0
    if any(s.is_finished for s in seqs):  # the steps above ran short of work: say so
        print(f"!!! {name} b={batch}: a request reached the context's end within the steps; "
              f"fewer --steps ({steps}) measure full steps")  # fmt: skip
    events = prof.key_averages()
    gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.self_device_time_total for e in gpu)
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]

    def count(names) -> int:
        return sum(e.count for e in cpu if any(n in e.key for n in names))

    stats = llm.spec_stats or {}
    out = {
        "config": name, "batch": batch, "steps": steps,
        "wall_ms_per_step": round(wall * 1e3 / steps, 4),
        "unprofiled_wall_ms_per_step": plain_wall,
        "unprofiled_phase_ms_per_step": plain_phases,
        "python_hotspots": host_functions,
        "gpu_kernel_ms_per_step": round(gpu_us / 1e3 / steps, 4),
        "gpu_busy_share": round(gpu_us / 1e6 / wall, 4),
        "kernels_per_step": round(sum(e.count for e in gpu) / steps, 1),
        "syncs_per_step": round(count(SYNC_OPS) / steps, 2),
        "memcpy_calls_per_step": round(count(("cudaMemcpyAsync", "cudaMemcpy ")) / steps, 2),
        "graph_launches_per_step": round(count(("cudaGraphLaunch",)) / steps, 2),
        "accept_length": stats.get("avg_spec_accept_length"),
        "outside_forward_share": stats.get("outside_forward_share"),
        "phase_seconds": stats.get("phase_seconds"),
        # the budgets the controller chose over every step this engine ran (warm-up included)
        "steps_by_budget": dict(llm.controller.steps_by_budget) if llm.controller else None,
        # every kernel (name, launches, GPU ms a step), dearest first: the round's whole
        # inventory, for planning fusions (a tiny model's round is ~200 latency-bound kernels)
        "top_cuda": [(e.key[:120], e.count, round(e.self_device_time_total / 1e3 / steps, 4))
                     for e in sorted(gpu, key=lambda e: -e.self_device_time_total)],
        "top_host": [(e.key[:90], e.count, round(e.self_cpu_time_total / 1e3 / steps, 4))
                     for e in sorted(cpu, key=lambda e: -e.self_cpu_time_total)[:25]],
    }  # fmt: skip
    print(f"--- {name} b={batch}: unprofiled {plain_wall} ms/step, phases {plain_phases}")
    for fn, calls, tot, cum in host_functions[:12]:
        print(f"   py  tottime {tot:7.4f} cumtime {cum:7.4f} ms/step  x{calls:<5} {fn}")
    print(f"--- {name} b={batch}: {out['wall_ms_per_step']} ms/step wall, "
          f"{out['gpu_kernel_ms_per_step']} ms GPU ({out['gpu_busy_share']:.0%}), "
          f"{out['kernels_per_step']} kernels, {out['syncs_per_step']} syncs, "
          f"{out['memcpy_calls_per_step']} memcpys, {out['graph_launches_per_step']} graphs, "
          f"accept {out['accept_length']}, phases {out['phase_seconds']}, "
          f"budgets {out['steps_by_budget']}")  # fmt: skip
    for k, n, ms in out["top_cuda"][:10]:
        print(f"   gpu {ms:8.4f} ms/step  x{n:<6} {k}")
    for k, n, ms in out["top_host"][:18]:
        print(f"   cpu {ms:8.4f} ms/step  x{n:<6} {k}")
    return out


def unprofiled(llm: LLM, steps: int, sync) -> tuple[float, dict | None]:
    """Wall ms per step and the engine's phase ms per step, no profiler attached."""
    llm.reset_stats()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        llm.step()
    sync()
    wall = (time.perf_counter() - t0) * 1e3 / steps
    phases = (llm.spec_stats or {}).get("phase_seconds")
    per_step = {k: round(v * 1e3 / steps, 4) for k, v in phases.items()} if phases else None
    return round(wall, 4), per_step


def python_hotspots(llm: LLM, steps: int, sync, top: int = 30) -> list:
    """(function, calls per step, tottime ms/step, cumtime ms/step) by own time, cProfile'd
    (it slows Python calls, not the C++ ops: read shares, not absolute times)."""
    prof = cProfile.Profile()
    sync()
    prof.enable()
    for _ in range(steps):
        llm.step()
    sync()
    prof.disable()
    st = pstats.Stats(prof).stats  # {(file, line, fn): (cc, nc, tt, ct, callers)}
    rows = sorted(st.items(), key=lambda kv: -kv[1][2])[:top]
    return [(f"{Path(f).name}:{ln}({fn})", round(nc / steps, 2), round(tt * 1e3 / steps, 4),
             round(ct * 1e3 / steps, 4)) for (f, ln, fn), (_, nc, tt, ct, _) in rows]  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument(
        "--steps",
        type=int,
        default=40,
        help="steps each of three passes times (after 20 warm-up steps); a request "
        "holds at most the model's context (tiny-code: 1024 positions)",
    )
    ap.add_argument("--batches", default="1,8")
    default = [c for c in CONFIGS if c not in ("DDTREE-adaptive", "DDTREE-adaptive@16")]
    ap.add_argument(
        "--configs", default=",".join(default), help="comma list of: " + ", ".join(CONFIGS)
    )
    ap.add_argument("--cpu", action="store_true", help="a dry run of the script on the CPU")
    args = ap.parse_args()
    if args.cpu:
        global DEVICE
        DEVICE = "cpu"
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        for name in args.configs.split(","):
            algo, budget, pinned = CONFIGS[name]
            rows.append(profile_config(name, algo, b, budget, args.steps, pinned))
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
            "commit": _git_commit(), "command": " ".join(sys.argv)}  # fmt: skip
    args.json.write_text(json.dumps(meta | {"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
