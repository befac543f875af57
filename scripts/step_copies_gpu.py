"""What the copies around a plain step launched ahead cost on the device (GPU machine): the
step's graph replayed back to back with, after each replay, what `DecodeAhead._launch` queues
beside it — the tokens' copy to pinned host memory, and in a DFlash engine the tapped rows'
copy into the feed ring — each variant timed between CUDA events (kernels plus the gaps between
them). A device-to-device `copy_` of a contiguous tensor is a DMA on a copy engine: between two
graph replays on the compute engine it adds two cross-engine waits; a copy kernel does not.

    PYTHONPATH=src python3 scripts/step_copies_gpu.py [--batch 8] --json F

The question it answers (forty-third session): a DFlash engine's plain step measured ~14 us
slower than a plain engine's at b=8 with the same GPU kernels (scripts/profile_budget0.py
--trace): is it the ring write's DMA between replays? (Yes: ~22 us at b=8 on the H100; since
the forty-fourth session the DFlash engine's step graph writes the ring itself,
TREEVERIFY_RING_IN_GRAPH, default 1. With it a DFlash engine's "replay" row includes that write
and its "+ ring write" rows write twice: each row says which (`ring_in_graph`); gpu-round runs
this script with the switch at 0, the question's form.)
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from treeverify.bench.kernel import back_to_back_seconds
from treeverify.engine.llm import LLM
from treeverify.engine.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from raw_json import write_rows  # noqa: E402

BUDGET0 = dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=16,
               speculative_cost_seconds={0: 1e-4, 4: 1.0, 8: 1.0, 16: 1.0})  # fmt: skip


def copies_in(body, reps: int = 50) -> dict[str, float]:
    """Per call of `body`: the copies the profiler sees on the device (name -> count)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            body()
        torch.cuda.synchronize()
    seen = defaultdict(float)
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and "emcpy" in e.key:
            seen[e.key[:60]] += e.count / reps
    return {k: round(v, 2) for k, v in seen.items()}


def measure(name: str, kw: dict, b: int) -> list[dict]:
    """Every variant's GPU time per step in one engine (bucket b's step launched ahead)."""
    sp = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=1)
    prompts = [f"def f{i}(x):\n    return x + {i}\n" for i in range(b)]
    llm = LLM("tiny-code", device="cuda", num_pages=512, max_num_seqs=b, **kw)
    llm.generate(prompts, sp)  # the step graphs captured and replayed at a real context
    graph, tokens, hidden = llm.ahead.steps[b]
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    if hidden is None:  # a plain engine taps nothing: a stand-in of the DFlash rows' shape
        hidden = torch.randn(b, 3 * 768, device="cuda", dtype=torch.bfloat16)
    ring = torch.zeros(4 * b, hidden.shape[1], device="cuda", dtype=hidden.dtype)

    def launch():  # what every launch queues: the replay and the tokens to the host
        graph.replay()
        host.copy_(tokens, non_blocking=True)

    def launch_dma():  # + the ring write as today (a DMA)
        launch()
        ring[:b].copy_(hidden)

    def launch_kernel():  # + the ring write as a copy kernel
        launch()
        torch.mul(hidden, 1, out=ring[:b])

    variants = {"replay": graph.replay, "replay + tokens to host": launch,
                "+ ring write (DMA copy_)": launch_dma,
                "+ ring write (copy kernel)": launch_kernel}  # fmt: skip
    rows = []
    for v, fn in variants.items():
        us = back_to_back_seconds(fn, 300) * 1e6  # (each queues its work back to back)
        r = {"engine": name, "variant": v, "us_per_step": round(us, 2),
             "copies": copies_in(fn), "ring_in_graph": llm.ahead.info["ring_in_graph"]}  # fmt: skip
        rows.append(r)
        print(f"{name:16s} {v:28s} {r['us_per_step']:8.2f} us  {r['copies']}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    rows = []
    for name, kw in (("plain", {}), ("dflash budget 0", BUDGET0)):
        rows += measure(name, kw, args.batch)
        torch.cuda.empty_cache()
    write_rows(args.json, "step_copies_gpu.py", None, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
