"""What a DFlash context flush costs on the host: a request's 64 pending rows (one clone a plain
step, as a plain step launched ahead leaves them) projected by `DraftContextCache.project`, timed
alone (the device idle before each, synchronized after), then under cProfile (the C calls by own
time: torch.cat, pin_memory, copy_, the replay, index_copy_). Beside it, the per-step pieces of
the feed: a (b, F) clone after a replay, `split(1)` at b=8, one `observe`.

    PYTHONPATH=src python3 scripts/flush_profile.py [--reps 30] [--json P.json]

On the H100 (thirty-seventh session) every 64th plain step of a DFlash request took 0.7-0.9 ms,
nearly all host, against ~0.18 ms for the others.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from raw_json import write_rows  # noqa: E402

from treeverify.engine.llm import LLM  # noqa: E402
from treeverify.engine.sampling_params import SamplingParams  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM("tiny-code", device=dev, num_pages=512, max_num_seqs=8,
              speculative_algorithm="DDTREE", speculative_ddtree_budget=16)  # fmt: skip
    llm.generate(["def f(x):\n    return x\n"], SamplingParams(max_tokens=16, ignore_eos=True))
    ctx = llm.spec.source.context
    flush = ctx.flush_rows or ctx.MAX_PENDING
    feat = ctx.drafter.config.context_features
    dtype = ctx.drafter.fc.weight.dtype
    step_out = torch.randn(8, feat, dtype=dtype, device=dev)  # a replay's (b, F) tapped rows

    def fill(rid: str, start: int, rows: int) -> None:
        ctx.project([rid])  # nothing pending before the run (untimed)
        for i in range(rows):
            ctx.observe(rid, start + i, step_out[:1].clone())

    # a request's prompt, then runs of plain steps: every `flush`-th observe projects
    rid, pos = "flush-probe", 0
    ctx.observe(rid, 0, torch.randn(100, feat, dtype=dtype, device=dev))
    pos = 100
    times = []
    for _ in range(a.reps):
        fill(rid, pos, flush - 1)
        pos += flush - 1
        sync()
        t0 = time.perf_counter()
        ctx.observe(rid, pos, step_out[:1].clone())  # the flush
        times.append(time.perf_counter() - t0)
        pos += 1
        sync()
        if pos > ctx.width * 4:  # stay well inside positions the rings accept
            ctx.forget(rid)
            rid, pos = rid + "+", 0
            ctx.observe(rid, 0, torch.randn(100, feat, dtype=dtype, device=dev))
            pos = 100
    prof = cProfile.Profile()
    for _ in range(10):
        fill(rid, pos, flush - 1)
        pos += flush - 1
        sync()
        prof.enable()
        ctx.observe(rid, pos, step_out[:1].clone())
        prof.disable()
        pos += 1
        sync()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)

    def per_call(fn, n=2000) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        dt = (time.perf_counter() - t0) / n
        sync()
        return dt

    parts = {
        "clone (1, F)": per_call(lambda: step_out[:1].clone()),
        "clone (8, F)": per_call(lambda: step_out.clone()),
        "split(1) of (8, F)": per_call(lambda: step_out.split(1)),
    }
    ctx.forget(rid)
    n_obs, rid2 = flush - 8, "observe-probe"  # fewer rows than a flush takes
    ctx.observe(rid2, 0, torch.randn(4, feat, dtype=dtype, device=dev))
    row = step_out[:1].clone()
    sync()
    t0 = time.perf_counter()
    for i in range(n_obs):
        ctx.observe(rid2, 4 + i, row)
    parts["observe (1, F), no flush"] = (time.perf_counter() - t0) / n_obs
    us = [t * 1e6 for t in times]
    row_out = {
        "flush_rows": flush,
        "flush_us_median": round(statistics.median(us), 1),
        "flush_us_min": round(min(us), 1),
        "flush_us_all": [round(t, 1) for t in us],
        "parts_us": {k: round(v * 1e6, 2) for k, v in parts.items()},
        "cprofile_10_flushes": out.getvalue(),
    }
    print(f"flush of {flush} pending rows: median {row_out['flush_us_median']} us, "
          f"min {row_out['flush_us_min']} us over {len(us)}")  # fmt: skip
    for k, v in row_out["parts_us"].items():
        print(f"  {k:28s} {v:8.2f} us")
    print(out.getvalue())
    if a.json:
        write_rows(a.json, "flush_profile.py", argv, [row_out])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
