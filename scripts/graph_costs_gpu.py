"""What each CUDA graph of a speculative round costs on its own (GPU machine): GPU time per
replay (back-to-back replays between two CUDA events: kernels plus the gaps between them; unlike
bench.kernel.median_replay_seconds, no sync between replays) and host time of the replay call
(queue drained first, so the call is not waiting for room).
tiny-code + its DFlash drafter, DDTREE budget 16, batch 1 by default; the whole-round graph
(engine/round_graphs.py) last, against the sum of its parts. Each graph also timed with its
inputs restored before every replay (`gpu_ms_per_replay_fixed_inputs`: a whole round advances
its own inputs, so back to back it runs at a growing context; the fixed figures compare).
Usage (repo root): PYTHONPATH=src python3 scripts/graph_costs_gpu.py --json F"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from treeverify.bench.kernel import _git_commit
from treeverify.engine.llm import LLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_decode_gpu import _kernels, _table  # noqa: E402


def fixed_inputs_ms(graph: torch.cuda.CUDAGraph, restore, reps: int = 100) -> float:
    """Median GPU ms of one replay, its inputs restored before each (outside the timed span).
    A whole-round replay writes the next round's inputs (ring end, prefix + accepted): back to
    back, `cost`'s 200+ replays run at an ever longer context, its attention with it, so its
    figure did not compare with its parts' (which read their inputs, never advance them)."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        restore()
        starts[i].record()
        graph.replay()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in zip(starts, ends, strict=True))
    restore()
    return times[len(times) // 2]


def cost(graph: torch.cuda.CUDAGraph, reps: int = 200) -> dict:
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    gpu_ms = a.elapsed_time(b) / reps
    host = []
    for _ in range(50):  # one call at a time on an idle queue: the launch's own host cost
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        host.append(time.perf_counter() - t0)
    behind = []
    for _ in range(50):  # launched while its previous replay still runs (a round launched ahead)
        torch.cuda.synchronize()
        graph.replay()
        t0 = time.perf_counter()
        graph.replay()
        behind.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    host.sort()
    behind.sort()
    return {"gpu_ms_per_replay": round(gpu_ms, 4),
            "host_ms_per_launch_median": round(host[len(host) // 2] * 1e3, 4),
            "host_ms_per_launch_behind_itself": round(behind[len(behind) // 2] * 1e3, 4),
            }  # fmt: skip


def _drop_norms() -> None:
    """add_rmsnorm and rmsnorm return their input: no norm kernel (the residual is x)."""
    from treeverify.models import fused_ops, llama

    def add_rmsnorm(x, residual, norm, tap=None):
        return x, x

    fused_ops.add_rmsnorm = llama.add_rmsnorm = add_rmsnorm
    fused_ops.rmsnorm = lambda x, norm: x


def _drop_unpack() -> None:
    """A graph's staged inputs never unpacked: the buffers keep what the capture left."""
    from treeverify.engine.cuda_graphs import CudaGraphs

    CudaGraphs._unpack = lambda self, stage, batch, n: None


DROPS = {"norm": _drop_norms, "unpack": _drop_unpack}


def _round_inputs(llm: LLM, b: int, n: int) -> list[torch.Tensor]:
    """The device buffers a round's graphs read and a whole round rewrites for the next one:
    the draft meta (rows read, roots, ring ends) and the verify stage (prefix lengths, ...)."""
    out = [llm.runner.graphs.stages[(b, n)].dev]
    if llm.rounds is not None:
        out.append(llm.rounds.meta.dev)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--kernels", type=int, default=0, metavar="K",
                    help="also profile each graph's kernels (torch.profiler) and print the K "
                         "costliest per replay")  # fmt: skip
    ap.add_argument("--drop", choices=sorted(DROPS), action="append", default=[],
                    help="a what-if: leave this op's kernels out of every graph (wrong outputs; "
                         "the forwards' times bound what fusing it away could save)")  # fmt: skip
    args = ap.parse_args()
    for what in args.drop:
        DROPS[what]()
    llm = LLM("tiny-code", device="cuda", num_pages=4096, max_num_seqs=args.batch,
              cuda_graph_max_bs=args.batch, speculative_algorithm="DDTREE",
              speculative_ddtree_budget=args.budget)  # fmt: skip
    b, spec = args.batch, llm.spec
    n = spec.nodes_for(args.budget)
    graphs = {
        "decode forward (b, 1)": llm.runner.graphs.steps[(b, 1)].graph,
        f"verify forward (b, {n})": llm.runner.graphs.steps[(b, n)].graph,
        "DFlash draft": spec.source.graphs.graphs[(spec.draft_depth(args.budget), b)][0],
        "tree build + mask": spec._build[args.budget].graphs[b][0],
        "greedy accept + K/V move": spec._accept[n].graphs[b][0],
        "context projection (16 rows)": spec.source.context._captured.graphs[16][0],
    }
    if llm.rounds is not None:  # all of the above (but the decode) in one graph
        graphs["whole round (draft .. context rows)"] = llm.rounds.rounds[(b, args.budget)][0]
    # the rounds' inputs as they are now (every graph reads them; a whole round advances them)
    saved = [(t, t.clone()) for t in _round_inputs(llm, b, n)]

    @torch.inference_mode()  # (the engine's buffers are inference tensors)
    def restore() -> None:
        for t, copy in saved:
            t.copy_(copy)

    rows = []
    for name, g in graphs.items():
        fixed = fixed_inputs_ms(g, restore)
        r = {"graph": name, **cost(g), "gpu_ms_per_replay_fixed_inputs": round(fixed, 4)}
        restore()
        rows.append(r)
        print(f"{name:32s} GPU {r['gpu_ms_per_replay']:.4f} ms/replay"
              f" ({fixed:.4f} inputs fixed)"
              f"  host {r['host_ms_per_launch_median']:.4f} ms/launch"
              f" ({r['host_ms_per_launch_behind_itself']:.4f} behind itself)")  # fmt: skip
        if args.kernels:
            r["kernels"] = _table(_kernels(g, 50))
            r["launches_per_replay"] = round(sum(k["per_replay"] for k in r["kernels"]), 1)
            print(f"    {r['launches_per_replay']} launches a replay; costliest:")
            for k in r["kernels"][: args.kernels]:
                print(f"    {k['us_per_replay']:7.2f} us  x{k['per_replay']:<5} {k['name'][:90]}")
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "commit": _git_commit(),
            "command": " ".join(sys.argv), "dropped": args.drop}  # fmt: skip
    args.json.write_text(json.dumps(meta | {"batch": b, "budget": args.budget, "rows": rows},
                                    indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
