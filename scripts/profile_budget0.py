"""Host time of plain decode steps with speculation configured but the adaptive budget at 0, next
to a plain engine (cProfile, one GPU or the CPU): what a budget-0 step pays beyond plain decoding.

    PYTHONPATH=src python3 scripts/profile_budget0.py [--model tiny-code] [--batch 8]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from null_model import make_null  # noqa: E402

from treeverify.engine.llm import LLM  # noqa: E402
from treeverify.engine.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny-code")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ngram", action="store_true", help="the n-gram drafter, not the model's own")
    p.add_argument(
        "--lookahead",
        action="store_true",
        help="decode steps launched ahead on the CPU too (eager; a GPU's default)",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="torch.profiler (host ops and GPU kernels) instead of cProfile",
    )
    p.add_argument("--top", type=int, default=18, help="functions shown, by own time")
    p.add_argument(
        "--sort",
        choices=("tottime", "cumulative"),
        default="tottime",
        help="cProfile's order (cumulative: a function with its callees)",
    )
    p.add_argument(
        "--filter",
        default=None,
        help="only functions whose file:line(name) matches this regex (cProfile)",
    )
    p.add_argument(
        "--null-model",
        action="store_true",
        help="the target's forward replaced by a near no-op (scripts/null_model.py; CPU): the "
        "step's host work alone",
    )
    a = p.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    costs = {0: 1e-4, 4: 1.0, 8: 1.0, 16: 1.0}  # budget 0 always wins: only plain steps run
    spec = dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=16,
                speculative_adaptive=True, speculative_cost_seconds=costs)  # fmt: skip
    if a.ngram:
        spec["speculative_draft_model_path"] = "ngram"
    sp = SamplingParams(temperature=a.temperature, max_tokens=a.tokens, ignore_eos=True, seed=0)
    prompts = [f"def f{i}(x):\n    return x + {i}\n" for i in range(a.batch)]
    for name, kw in (("plain", {}), ("budget0", spec)):
        if a.lookahead:
            kw = {**kw, "decode_lookahead": True}
        llm = LLM(a.model, device=dev, num_pages=512, max_num_seqs=a.batch, **kw)
        if a.null_model:
            make_null(llm)
        llm.generate(prompts, sp)
        t0 = time.perf_counter()
        llm.generate(prompts, sp)  # timed alone: no profiler
        dt = time.perf_counter() - t0
        print(f"== {name}: {dt:.3f} s, {a.batch * a.tokens / dt:.0f} tok/s")
        if a.trace:
            trace(llm, prompts, sp, a.top, a.tokens)
        else:
            prof = cProfile.Profile()
            prof.enable()
            llm.generate(prompts, sp)
            prof.disable()
            stats = pstats.Stats(prof).sort_stats(a.sort)
            if a.filter:  # the matching functions, then what each calls (torch's C calls too)
                stats.print_stats(a.filter, a.top)
                stats.print_callees(a.filter, a.top)
            else:
                stats.print_stats(a.top)
        del llm


def trace(llm: LLM, prompts: list[str], sp: SamplingParams, top: int, steps: int) -> None:
    """torch.profiler over one more pass: host ops by own time, GPU kernels by time, per step."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        llm.generate(prompts, sp)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    ev = prof.key_averages()
    print(f"  host ops by own time, per step ({steps} steps):")
    for e in sorted(ev, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]:
        print(f"    {e.self_cpu_time_total / steps:9.1f} us {e.count / steps:6.2f}x {e.key[:90]}")
    gpu = [e for e in ev if e.device_type.name == "CUDA"]
    print(
        f"  GPU kernels, per step: {sum(e.count for e in gpu) / steps:.1f} launches, "
        f"{sum(e.self_device_time_total for e in gpu) / steps:.1f} us"
    )
    for e in sorted(gpu, key=lambda e: e.self_device_time_total, reverse=True)[:top]:
        us, n = e.self_device_time_total / steps, e.count / steps
        print(f"    {us:9.1f} us {n:6.2f}x {e.key[:88]}")


if __name__ == "__main__":
    main()
