"""Which kernels a captured decode forward runs and what each costs (GPU machine): the engine's
decode graph for `--batch` requests after their prefill (as `bench engine decode` builds it),
replayed under torch.profiler; per kernel name its launches and GPU us per replay, the total,
and the replay's wall time between CUDA events (kernels plus the gaps between them). Where the
engine launches plain greedy steps ahead (engine/decode_ahead.py, the default on a GPU), that
step's graph too: its wall time and the kernels it runs beyond the forward's (argmax, the advance
of its inputs). (Replaying it alone advances its positions each time, past the pages held: a
profile only, its K/V writes land in pages the request holds or page 0.)
For issue 14's decode targets: which kernels a launch-bound step (random:mla-moe) still spends
its time in, and how far the 1B shape's GEMVs are from the roofline.
Usage (repo root): PYTHONPATH=src python3 scripts/profile_decode_gpu.py \
    [--models random:mla-moe,random:llama-1b] [--batch 1] --json F"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from treeverify.bench.engine import _free, _prompts
from treeverify.bench.kernel import _git_commit, median_replay_seconds
from treeverify.engine.llm import LLM
from treeverify.engine.sampling_params import SamplingParams


def _kernels(graph, replays: int) -> list[tuple[str, float, float]]:
    """(kernel name, launches, GPU us) per replay of `graph`, costliest first."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0, 0.0])
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.key][0] += e.count
            per[e.key][1] += e.self_device_time_total
    return sorted(((k, n / replays, us / replays) for k, (n, us) in per.items()),
                  key=lambda r: -r[2])  # fmt: skip


def _table(rows) -> list[dict]:
    return [{"name": k[:120], "per_replay": round(n, 2), "us_per_replay": round(us, 2)}
            for k, n, us in rows]  # fmt: skip


def profile_decode(model: str, batch: int, replays: int = 50) -> dict:
    llm = LLM(model, device="cuda", num_pages=4096, cuda_graph_max_bs=batch,
              max_num_seqs=batch)  # fmt: skip
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    seqs = [llm.add_request(p, sp) for p in _prompts(batch, 512, seed=7, vocab=llm.vocab_size)]
    while any(s.num_output_tokens == 0 for s in seqs):
        llm.step()  # prefill: the decode graph then replays at a real context
    graph = llm.captured_graph(batch)
    wall_ms = median_replay_seconds(graph, 50) * 1e3
    rows = _kernels(graph, replays)
    ahead = None
    if llm.ahead is not None and llm.ahead.steps:
        bucket = min(b for b in llm.ahead.steps if b >= batch)
        step_graph = llm.ahead.steps[bucket][0]
        ahead_ms = median_replay_seconds(step_graph, 50) * 1e3
        forward = {k: (n, us) for k, n, us in rows}
        extra = [(k, n - forward.get(k, (0, 0))[0], us - forward.get(k, (0, 0))[1])
                 for k, n, us in _kernels(step_graph, replays)]  # fmt: skip
        extra = [r for r in extra if r[1] > 0.5 or r[2] > 0.5]
        ahead = {"replay_wall_ms": round(ahead_ms, 4),
                 "extra_us_per_replay": round(sum(r[2] for r in extra), 1),
                 "extra_kernels": _table(extra)}  # fmt: skip
    _free(llm)
    out = {
        "model": model, "batch": batch, "replay_wall_ms": round(wall_ms, 4),
        "kernel_us_per_replay": round(sum(r[2] for r in rows), 1),
        "launches_per_replay": round(sum(r[1] for r in rows), 1),
        "kernels": _table(rows),
        "step_launched_ahead": ahead,
    }  # fmt: skip
    print(
        f"--- {model} b={batch}: replay {wall_ms:.4f} ms wall, kernels "
        f"{out['kernel_us_per_replay']} us, {out['launches_per_replay']} launches"
    )
    for r in out["kernels"][:25]:
        print(f"   {r['us_per_replay']:8.2f} us  x{r['per_replay']:<6} {r['name'][:100]}")
    if ahead is not None:
        print(
            f"--- the step launched ahead: replay {ahead['replay_wall_ms']:.4f} ms wall, "
            f"{ahead['extra_us_per_replay']} us of kernels beyond the forward's:"
        )
        for r in ahead["extra_kernels"][:12]:
            print(f"   {r['us_per_replay']:8.2f} us  x{r['per_replay']:<6} {r['name'][:100]}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="random:mla-moe,random:llama-1b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    rows = [profile_decode(m, args.batch) for m in args.models.split(",")]
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "commit": _git_commit(),
            "command": " ".join(sys.argv)}  # fmt: skip
    args.json.write_text(json.dumps(meta | {"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
