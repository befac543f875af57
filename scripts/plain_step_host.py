"""Where a plain step's host time goes at batch 8: plain decoding's engine against the adaptive
DDTree engine held at budget 0 and left to its controller (which sits at 0 on text its drafter
cannot predict). At b=8 on the H100 the adaptive engine's plain step took 0.265 ms against plain
decoding's 0.190 at the same GPU time (profile_round_gpu.py, 2026-12-07): host-bound, so its
extra host work is step time, and a slow stretch of the host machine doubled it (bench_pair's
b=8 queue on prose sampled at T=1: 0.18 ms a step in five passes, 0.35 in four).

Every engine call a plain step makes is timed by a wrapper (inclusive: a call's time holds the
calls inside it, e.g. `_plain_ahead` holds `ahead.step` and `_observe_ring`), and two torch
calls at class level: `CUDAGraph.replay` (the launch) and `Event.synchronize` (the wait for the
step launched before). Per config: the unprofiled wall a step, then each call's us a step and
calls a step, over `--steps` steps after a warm-up.

    PYTHONPATH=src python3 scripts/plain_step_host.py [--steps 300] [--batch 8] --json F
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import profile_round_gpu  # noqa: E402
from bench_pair import PROSE, prose_prompts  # noqa: E402
from call_timer import wrap  # noqa: E402
from profile_round_gpu import FREE, build, prompts, unprofiled  # noqa: E402
from raw_json import write_rows  # noqa: E402

from treeverify.engine.sampling_params import SamplingParams  # noqa: E402

# name: (algorithm, budget, pinned, text, temperature)
CONFIGS = {
    "none code T=0": (None, 0, None, "code", 0.0),
    "adaptive@0 code T=0": ("DDTREE", 64, 0, "code", 0.0),
    "none prose T=1": (None, 0, None, "prose", 1.0),
    "adaptive prose T=1": ("DDTREE", 64, FREE, "prose", 1.0),
}
ENGINE_CALLS = ("_speculative_step", "_plain_ahead", "_observe_ring", "_cost_path", "_forward")
CONTROLLER_CALLS = ("choose", "observe_step", "observe_wall", "observe_round", "forget")


def run_config(name: str, batch: int, steps: int, warm: int = 30,
               controller: tuple[str, ...] = ()) -> dict:  # fmt: skip
    algo, budget, pinned, text, temp = CONFIGS[name]
    llm = build(algo, batch, budget, pinned, controller)
    texts = prompts(batch) if text == "code" else prose_prompts(PROSE, batch)
    for p in texts:  # as long as the context allows: no request finishes inside the steps
        room = llm.model_config.max_position_embeddings - len(llm.tokenizer.encode(p)) - 64
        llm.add_request(p, SamplingParams(temperature=temp, max_tokens=room, ignore_eos=True,
                                          seed=2026 if temp else None))  # fmt: skip
    for _ in range(warm):  # prefill, warm steps
        llm.step()
    sync = torch.cuda.synchronize if profile_round_gpu.DEVICE == "cuda" else (lambda: None)
    wall_ms, _ = unprofiled(llm, steps, sync)
    wall_us = wall_ms * 1e3
    acc, calls, undo = collections.Counter(), collections.Counter(), []
    undo.append(wrap(llm, "step", "step (all)", acc, calls))
    for obj, names, prefix in ((llm, ENGINE_CALLS, "engine."),
                               (llm.scheduler, ("schedule", "postprocess"), "scheduler."),
                               (llm.processor, ("commit",), "processor."),
                               (llm.ahead, ("step",), "ahead."),
                               (llm.controller, CONTROLLER_CALLS, "controller."),
                               (llm.spec.source.context if llm.spec else None,
                                ("observe_ring",), "context.")):  # fmt: skip
        for n in names if obj is not None else ():
            if hasattr(obj, n):
                undo.append(wrap(obj, n, prefix + n, acc, calls))
    if profile_round_gpu.DEVICE == "cuda":
        undo.append(wrap(torch.cuda.CUDAGraph, "replay", "torch.CUDAGraph.replay", acc, calls))
        undo.append(wrap(torch.cuda.Event, "synchronize", "torch.Event.synchronize", acc, calls))
    sync()
    for _ in range(steps):
        llm.step()
    sync()
    for u in reversed(undo):
        u()
    budgets = None
    if llm.controller is not None:
        budgets = {b: c for b, c in llm.controller.steps_by_budget.items() if c}
    if controller and llm.controller is not None:
        name += " [" + ",".join(controller) + "]"
    out = {"config": name, "batch": batch, "steps": steps, "wall_us_per_step": round(wall_us, 1),
           "steps_by_budget": budgets,
           "calls": [{"call": k, "us_per_step": round(v * 1e6 / steps, 1),
                      "calls_per_step": round(calls[k] / steps, 2)}
                     for k, v in acc.most_common()]}  # fmt: skip
    del llm
    if profile_round_gpu.DEVICE == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument(
        "--configs", default=",".join(CONFIGS), help="comma list of " + ", ".join(CONFIGS)
    )
    ap.add_argument("--warm", type=int, default=30, help="steps before the timed ones")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KNOB=VALUE",
        help="ControllerConfig settings for the adaptive configs (repeatable)",
    )
    ap.add_argument(
        "--ab",
        action="store_true",
        help="with --set: every adaptive config also without them (in turns)",
    )
    ap.add_argument(
        "--cpu",
        action="store_true",
        help="the CPU engine (a smoke run: its forward is the step, no launches)",
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.cpu:
        profile_round_gpu.DEVICE = "cpu"
    elif not torch.cuda.is_available():
        raise SystemExit("plain_step_host.py: no GPU (--cpu: the CPU engine's smoke run)")
    rows = []
    for name in args.configs.split(","):
        if name not in CONFIGS:
            raise SystemExit(f"--configs: unknown {name!r}; known: {', '.join(CONFIGS)}")
        sets = [tuple(args.set)]
        if args.ab and args.set and CONFIGS[name][2] is not None:
            sets = [(), tuple(args.set)]
        for controller in sets:
            r = run_config(name, args.batch, args.steps, args.warm, controller)
            rows.append(r)
            print(f"--- {r['config']} b={args.batch}: {r['wall_us_per_step']} us a step "
                  f"unwrapped, budgets {r['steps_by_budget']}")  # fmt: skip
            for c in r["calls"]:
                print(f"    {c['call']:32s} {c['us_per_step']:8.1f} us a step  "
                      f"x{c['calls_per_step']}")  # fmt: skip
    if args.json:
        write_rows(args.json, "plain_step_host.py", None, rows)
    print(json.dumps([{k: r[k] for k in ("config", "wall_us_per_step")} for r in rows]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
