"""Where one request's wall time goes at batch 1 (tiny-code by default): the prefill steps (up to
the first generated token), the steady steps after it, and what a request costs beyond
`tokens x per-token step time`. bench_pair's tokens/s includes all of it; this splits it.

    PYTHONPATH=src python3 scripts/request_phases_gpu.py [--n 8] [--tokens 128] --json P.json

Configs: plain decoding, and DDTREE(dflash) at budget 16 (whole rounds, launched ahead). Host
clock at each step boundary, no sync inside a request (a sync would undo the overlap); the
device is synchronized before each request starts and after it ends.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pair import DATA, code_prompts, free  # noqa: E402
from raw_json import write_rows  # noqa: E402

from treeverify.engine.llm import LLM  # noqa: E402
from treeverify.engine.sampling_params import SamplingParams  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def phases(llm: LLM, prompt: str, tokens: int) -> dict:
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    sync()
    t0 = time.perf_counter()
    seq = llm.add_request(prompt, sp)
    marks = []  # (seconds since t0, tokens generated) after each step
    while not seq.is_finished:
        llm.step()
        marks.append((time.perf_counter() - t0, len(seq.output_token_ids)))
    sync()
    total = time.perf_counter() - t0
    llm.output(seq)  # releases the request's state
    first = next(i for i, (_, n) in enumerate(marks) if n > 0)
    ttft = marks[first][0]
    steady = total - ttft
    return {
        "prompt_tokens": len(seq.prompt_token_ids),
        "prefill_steps": first + 1,
        "ttft_ms": 1e3 * ttft,
        "steady_steps": len(marks) - first - 1,
        "steady_ms": 1e3 * steady,
        "steady_ms_per_token": 1e3 * steady / max(1, tokens - marks[first][1]),
        "total_ms": 1e3 * total,
    }


def profile_prefill(llm: LLM, prompt: str) -> dict:
    """torch.profiler around one warm prefill step: kernels, GPU time, the top host ops."""
    from torch.profiler import ProfilerActivity, profile

    seq = llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        llm.step()
        sync()
    while not seq.is_finished:
        llm.step()
    llm.output(seq)
    # The same step's host side by Python function (cProfile): where the host time goes.
    import cProfile
    import pstats

    t0 = time.perf_counter()
    seq = llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    add_ms = 1e3 * (time.perf_counter() - t0)
    sync()
    pr = cProfile.Profile()
    pr.enable()
    llm.step()
    sync()
    pr.disable()
    while not seq.is_finished:
        llm.step()
    llm.output(seq)
    st = pstats.Stats(pr)
    funcs = sorted(st.stats.items(), key=lambda kv: kv[1][3], reverse=True)[:25]  # cumulative
    python = [(f"{Path(f[0]).name}:{f[1]}({f[2]})", round(v[3] * 1e3, 3), round(v[2] * 1e3, 3))
              for f, v in funcs]  # fmt: skip
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type.name == "CUDA"]
    host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    return {
        "kernels": sum(e.count for e in kernels),
        "gpu_ms": round(sum(e.self_device_time_total for e in kernels) / 1e3, 4),
        "host_top_ms": [(e.key[:80], e.count, round(e.self_cpu_time_total / 1e3, 4)) for e in host],
        "add_request_ms": round(add_ms, 3),
        "python_cumulative_ms": python,  # (function, cumulative ms, own ms)
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="tiny-code")
    ap.add_argument("--code-prompts", type=Path, default=DATA / "tiny-code" / "heldout.json")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    prompts = code_prompts(args.code_prompts, args.n)
    configs = [("none", {}), ("DDTREE(dflash) b=16", dict(
        speculative_algorithm="DDTREE", speculative_ddtree_budget=16,
        speculative_adaptive=False))]  # fmt: skip
    rows = []
    for name, kw in configs:
        dev = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a smoke run
        llm = LLM(args.target, device=dev, max_num_seqs=1, cuda_graph_max_bs=1, num_pages=256, **kw)
        for p in prompts:  # warm-up: every prompt length once (JIT, cuBLAS heuristics)
            phases(llm, p, 8)
        per = [phases(llm, p, args.tokens) for p in prompts]
        row = {"config": name} | {k: round(statistics.mean(r[k] for r in per), 4) for k in per[0]}
        row["prefill_profile"] = profile_prefill(llm, prompts[0])
        rows.append(row)
        flat = {k: v for k, v in row.items() if k not in ("config", "prefill_profile")}
        print(f"--- {name}: " + ", ".join(f"{k} {v}" for k, v in flat.items()))
        pp = row["prefill_profile"]
        print(f"--- {name} prefill step: {pp['kernels']} kernels, {pp['gpu_ms']} ms GPU; host:")
        for key, n, ms in pp["host_top_ms"]:
            print(f"      {ms:8.3f} ms {n:5d}x {key}")
        print(f"--- {name} add_request {pp['add_request_ms']} ms; prefill step, Python (cum, own):")
        for fn, cum, own in pp["python_cumulative_ms"]:
            print(f"      {cum:8.3f} {own:8.3f} ms {fn}")
        free(llm)  # its KV pool took most of the GPU
    if args.json:
        write_rows(args.json, "request_phases_gpu.py", argv, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
