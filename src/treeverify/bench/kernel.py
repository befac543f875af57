"""`treeverify bench kernel`: the 54-case grid, timed by CUDA-graph replay, against the floor.

For each case and backend: build inputs (random bf16 data, random trees, shuffled pages), check
the output against the reference (rel err, NaN-poisoned output first), then time. The cuda
backend is timed as it runs in production: a TreeAttentionPlan captured in a CUDA graph with
`reps` launches, replayed; median over replays. The torch backend (the reference, eager) is
timed with events. Efficiency = floor / measured time (shared/bench/cases.json's formula).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from treeverify.bench.cases import Case, case_bytes_flops, floor_seconds, load_grid, make_inputs
from treeverify.kernels.reference import tree_attention_reference
from treeverify.progress import progress

LENGTHS = ("equal", "mixed")


def mixed_prefix_lens(case: Case, seed: int) -> list[int]:
    """B prefix lengths drawn uniformly from 1..L (seeded): a batch of mixed lengths."""
    rng = random.Random(seed)
    return [rng.randint(1, case.L) for _ in range(case.B)]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    o, r = out.double(), ref.double()
    if not torch.isfinite(o).all():
        return float("inf")
    return float((o - r).norm() / r.norm().clamp_min(1e-30))


def _plan_for(case: Case, inp: dict, page_size: int, backend: str = "cuda"):
    from treeverify.kernels.plan import TreeAttentionPlan

    plan = TreeAttentionPlan(
        num_qo_heads=case.hq, num_kv_heads=case.hkv, head_dim_qk=case.dqk, head_dim_v=case.dv,
        mla=case.mla, page_size=page_size, max_batch=case.B, max_tree=case.N,
        max_pages_per_request=inp["block_table"].shape[1], max_kv_len=case.L + case.N,
        sm_scale=inp["sm_scale"], dtype=inp["q"].dtype, device=inp["q"].device, backend=backend,
    )  # fmt: skip
    plan.plan(inp["block_table"], inp["prefix_lens"], inp["qo_indptr"], inp["tree_mask"])
    return plan


def capture_plan(case: Case, inp: dict, page_size: int, reps: int, backend: str = "cuda") -> tuple:
    """(plan, graph of `reps` launches, output of one replay) for a cuda/triton plan."""
    plan = _plan_for(case, inp, page_size, backend)
    q, k, v = inp["q"], inp["k_cache"], inp["v_cache"]
    out = torch.full((q.shape[0], case.hq, case.dv), float("nan"), dtype=q.dtype, device=q.device)
    plan.run(q, k, v, out)  # warm up outside capture
    torch.cuda.synchronize()
    graph = _capture_runs(plan, inp, out, reps)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return plan, graph, out.clone()


def time_plan(
    case: Case, inp: dict, page_size: int, reps: int, replays: int, backend: str = "cuda"
) -> tuple:
    """(median seconds per launch, output of the captured run, plan) for a cuda/triton plan."""
    plan, graph, result = capture_plan(case, inp, page_size, reps, backend)
    return median_replay_seconds(graph, replays) / reps, result, plan


def _capture_runs(plan, inp: dict, out: torch.Tensor, reps: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `reps` plan.run launches into `out`, captured on a side stream."""
    q, k, v = inp["q"], inp["k_cache"], inp["v_cache"]
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(reps):
            plan.run(q, k, v, out)
    torch.cuda.current_stream().wait_stream(stream)
    return graph


def step_graph(plan, inp: dict) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """(graph, its output) of one plan.run (the timing graph holds `reps` of them): what a
    verify step launches, for its host time; keep the output alive while the graph is."""
    q = inp["q"]
    out = torch.empty(q.shape[0], plan.hq, plan.dv, dtype=q.dtype, device=q.device)
    return _capture_runs(plan, inp, out, 1), out


def host_step_seconds(
    plan, inp: dict, graph: torch.cuda.CUDAGraph, steps: int = 20, *, on_host: bool = True
) -> tuple[float, float]:
    """(median, fastest) host time of one verify step over `steps`: re-plan with the step's
    metadata (written into the captured buffers in place) and launch `graph` (one step:
    step_graph); the GPU idle at the start, the time to return, not the kernels' (the target:
    <= 50 us a step). The fastest is the code's own cost with the least of the host's other load
    (the median moved 1.5x between runs of one lease on the GPU machine's shared CPUs).
    `on_host`: the metadata as host tensors, the path plan() is built for (copies queued through
    pinned memory, no sync); else the device-resident tensors, whose capacity checks read them
    back (a sync)."""
    names = ("block_table", "prefix_lens", "qo_indptr", "tree_mask")
    meta = [inp[k].cpu() if on_host else inp[k] for k in names]
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        plan.plan(*meta)
        graph.replay()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times), min(times)


def median_replay_seconds(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Median device time of one replay of a captured graph (CUDA events around each)."""
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def back_to_back_replay_seconds(
    graph: torch.cuda.CUDAGraph, replays: int, passes: int = 5
) -> float:
    """Device time a replay when `replays` are queued back to back (the best of `passes`): the
    host's graph launch overlaps the previous replay, as one layer among a model's captured
    forward; median_replay_seconds (each replay alone, synchronised) also counts the GPU's
    wait for the launch."""
    return back_to_back_seconds(graph.replay, replays, passes)


def back_to_back_seconds(queue: Callable[[], object], calls: int, passes: int = 5) -> float:
    """Device time a call of `queue` (work it queues on the current stream: a replay, or a
    replay and the copies beside it) when `calls` are queued back to back, the best of
    `passes`."""
    best = float("inf")
    for _ in range(passes):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        queue()  # the queue is busy before the start event
        start.record()
        for _ in range(calls):
            queue()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / calls)
    return best


def interleaved_replay_us(
    graphs: dict[str, torch.cuda.CUDAGraph], rounds: int = 5, replays: int = 10
) -> dict[str, dict[str, list[float]]]:
    """Captured graphs timed in turns (A, B, A, B, ...), `rounds` times: per graph, each
    round's median replay alone and its back-to-back time a replay, in us. Timed one after the
    other instead, a drift of the GPU between them (clocks, a neighbour on the machine: SGLang's
    own replay moved 393 -> 429 us between two runs a minute apart on one lease) lands on one
    side of a ratio only; in turns it moves both sides of each round's ratio
    (`median_round_ratio`)."""
    out = {name: {"alone": [], "back_to_back": []} for name in graphs}
    for _ in range(rounds):
        for name, graph in graphs.items():
            out[name]["alone"].append(median_replay_seconds(graph, replays) * 1e6)
            b2b = back_to_back_replay_seconds(graph, 2 * replays, passes=2)
            out[name]["back_to_back"].append(b2b * 1e6)
    return out


def median_round_ratio(base: list[float], other: list[float]) -> float:
    """The median over rounds of base[i] / other[i] (interleaved_replay_us's rounds)."""
    if not base or len(base) != len(other):
        raise ValueError(
            f"base, other: expected equal non-empty lists, got {len(base)}, {len(other)}"
        )
    return statistics.median(b / o for b, o in zip(base, other, strict=True))


def replay_kernel_times(graph: torch.cuda.CUDAGraph, replays: int = 10) -> list[dict]:
    """Each kernel of a captured graph, its device time and launches per replay, longest first
    (torch.profiler / CUPTI sees the kernels inside a graph launch): what a replay is made of."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0:
            totals.setdefault(ev.name[:96], []).append(ev.device_time)  # us
    rows = [{"kernel": k, "launches_per_replay": len(v) / replays,
             "us_per_replay": sum(v) / replays} for k, v in totals.items()]  # fmt: skip
    return sorted(rows, key=lambda r: -r["us_per_replay"])


def time_torch(inp: dict, replays: int) -> tuple[float, torch.Tensor]:
    args = _ref_args(inp)
    out = tree_attention_reference(*args, v_head_dim=inp["v_head_dim"], check_data=False)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        tree_attention_reference(*args, v_head_dim=inp["v_head_dim"], check_data=False)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times), out


def _ref_args(inp: dict) -> tuple:
    return (
        inp["q"], inp["k_cache"], inp["v_cache"], inp["block_table"], inp["prefix_lens"],
        inp["qo_indptr"], inp["tree_mask"], inp["sm_scale"],
    )  # fmt: skip


def short_error(exc: BaseException, head: int = 300, tail: int = 1500) -> str:
    """`Type: message`, its middle elided when long: a failed JIT build's message is the whole
    compiler log (tens of KB per row), whose cause is at its end."""
    text = f"{type(exc).__name__}: {exc}"
    if len(text) <= head + tail + 40:
        return text
    return f"{text[:head]} [... {len(text) - head - tail} characters elided ...] {text[-tail:]}"


def run_grid(
    backends: list[str],
    *,
    page_size: int = 16,
    reps: int = 10,
    replays: int = 20,
    only: str | None = None,
    verify: bool = True,
    torch_max_flops: float = 2e12,
    lengths: str = "equal",
) -> dict:
    """`lengths`: "equal" (the grid: every request of a case has L prefix keys) or "mixed"
    (the B > 1 cases only: prefix lengths drawn uniformly from 1..L per request, seeded; the
    plan still sized for L, as a serving bucket is; floor and bandwidth from the drawn keys)."""
    from treeverify.bench.baselines import BASELINES, geomean, time_baseline, unavailable

    if lengths not in LENGTHS:
        raise ValueError(f"lengths: expected one of {LENGTHS}, got {lengths!r}")
    cases, ceilings = load_grid()
    if only:
        cases = [c for c in cases if only in c.name]
    if lengths == "mixed":
        cases = [c for c in cases if c.B > 1]
    skipped = {b: why for b in backends if b in BASELINES and (why := unavailable(b))}
    for b, why in skipped.items():  # an optional baseline that cannot run: one line, not a crash
        print(f"{b}: skipped: {why}", file=sys.stderr)
    backends = [b for b in backends if b not in skipped]
    rows = []
    for i, case in enumerate(progress(cases, "kernel grid", unit="case")):
        prefix = mixed_prefix_lens(case, seed=1000 + i) if lengths == "mixed" else None
        inp = make_inputs(case, page_size=page_size, device="cuda", seed=1000 + i,
                          prefix_lens=prefix)  # fmt: skip
        ref = None
        if verify:
            ref = tree_attention_reference(
                *_ref_args(inp), v_head_dim=inp["v_head_dim"], check_data=False
            )
        # The floor's terms are linear in the batch's keys: a mixed batch's floor is the equal
        # batch's at the mean prefix length.
        drawn = case if prefix is None else dataclasses.replace(case, L=sum(prefix) / case.B)
        floor = floor_seconds(drawn, ceilings)
        kv_bytes, flops = case_bytes_flops(drawn)
        for backend in backends:
            row = {"case": case.name, "backend": backend, **case.__dict__,
                   "floor_us": floor * 1e6}  # fmt: skip
            if prefix is not None:
                row["prefix_lens"] = prefix
            try:
                if backend in ("cuda", "triton"):
                    plan, graph, out = capture_plan(case, inp, page_size, reps, backend)
                    secs = median_replay_seconds(graph, replays) / reps
                    row["splits"] = plan.split_policy.max_splits
                    row["chunk"] = plan.split_policy.chunk
                    one, _one_out = step_graph(plan, inp)
                    median, fastest = host_step_seconds(plan, inp, one)
                    row["host_step_us"], row["host_step_min_us"] = median * 1e6, fastest * 1e6
                    row["host_step_device_meta_us"] = (
                        host_step_seconds(plan, inp, one, on_host=False)[0] * 1e6
                    )
                    del one, _one_out
                    if backend == "triton":
                        row["triton_config"] = plan._triton.config.__dict__
                elif backend in BASELINES:
                    secs, out, notes = time_baseline(backend, case, inp, page_size, reps, replays)
                    row.update(notes)
                elif backend == "torch":
                    if flops > torch_max_flops:
                        row["skipped"] = "reference too slow at this size"
                        rows.append(row)
                        continue
                    secs, out = time_torch(inp, max(3, replays // 4))
            except Exception as exc:  # a failing backend is a row, not a crash of the sweep
                row["error"] = short_error(exc)
                rows.append(row)
                print(f"{case.name:<34} {backend:<6} ERROR {row['error']}", file=sys.stderr)
                continue
            row.update(
                us=secs * 1e6,
                tb_per_s=kv_bytes / secs / 1e12,
                tflop_per_s=flops / secs / 1e12,
                efficiency=floor / secs,
            )
            if ref is not None:
                row["rel_err"] = _rel_err(out, ref)
            rows.append(row)
            print(
                f"{case.name:<34} {backend:<6} {row['us']:9.1f} us  eff {row['efficiency']:6.1%}"
                f"  err {row.get('rel_err', float('nan')):.1e}",
                flush=True,
            )
        ours = next((r for r in rows if r["case"] == case.name and r["backend"] == "cuda"), None)
        for r in rows:  # our ratio: how many times faster the cuda backend is on this case
            if r["case"] == case.name and r["backend"] != "cuda" and "us" in r and ours:
                r["ours_ratio"] = r["us"] / ours["us"] if "us" in ours else None
        del inp, ref
        torch.cuda.empty_cache()
    summary = {}
    for backend in backends:
        effs = [r["efficiency"] for r in rows if r["backend"] == backend and "efficiency" in r]
        errs = [r["rel_err"] for r in rows if r["backend"] == backend and "rel_err" in r]
        summary[backend] = {
            "cases": len(effs),
            "geomean_efficiency": math.exp(statistics.fmean(math.log(e) for e in effs))
            if effs
            else None,
            "min_efficiency": min(effs) if effs else None,
            "max_efficiency": max(effs) if effs else None,
            "max_rel_err": max(errs) if errs else None,
            "ours_ratio_geomean": geomean(
                [r["ours_ratio"] for r in rows if r["backend"] == backend and r.get("ours_ratio")]
            ),
            "host_us_median": _median_of(rows, backend, ("host_step_us", "host_plan_us")),
            "host_min_us_median": _median_of(rows, backend, ("host_step_min_us",)),
            "host_device_meta_us_median": _median_of(rows, backend, ("host_step_device_meta_us",)),
        }
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "commit": _git_commit(),
        "command": " ".join(sys.argv),
        "page_size": page_size,
        "lengths": lengths,
        "reps_per_graph": reps,
        "replays": replays,
        "ceilings": ceilings,
        "summary": summary,
        "skipped_backends": skipped,
        "rows": rows,
    }


def _git_commit(where: str | None = None) -> str:
    """The short commit of the working directory's checkout (TREEVERIFY_COMMIT overrides it),
    or of the checkout holding `where`."""
    from treeverify import env

    if where is None and env.commit_override():
        return env.commit_override()
    at = [] if where is None else ["-C", where]
    try:
        return subprocess.run(["git", *at, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _median_of(rows: list[dict], backend: str, keys: tuple[str, ...]) -> float | None:
    """Median over a backend's rows of the first of `keys` each row has (host times: ours per
    step, plan + launch; FlashInfer's plan() alone), or None."""
    vals = [next(r[k] for k in keys if k in r) for r in rows
            if r["backend"] == backend and any(k in r for k in keys)]  # fmt: skip
    return statistics.median(vals) if vals else None


def print_table(result: dict) -> None:
    backends = list(result["summary"])
    print(
        f"\n{'case':<34} {'floor us':>9} "
        + " ".join(f"{b + ' us':>10} {'eff':>6}" for b in backends)
    )
    by_case: dict[str, dict] = {}
    for r in result["rows"]:
        by_case.setdefault(r["case"], {})[r["backend"]] = r
    for name, per in by_case.items():
        first = next(iter(per.values()))
        cells = []
        for b in backends:
            r = per.get(b, {})
            if "us" in r:
                cells.append(f"{r['us']:>10.1f} {r['efficiency']:>6.1%}")
            else:
                cells.append(f"{'-':>10} {'-':>6}")
        print(f"{name:<34} {first['floor_us']:>9.1f} " + " ".join(cells))
    for b, s in result["summary"].items():
        if s["geomean_efficiency"] is not None:
            print(
                f"{b}: geomean {s['geomean_efficiency']:.1%} of floor over {s['cases']} cases, "
                f"min {s['min_efficiency']:.1%}, max {s['max_efficiency']:.1%}, "
                f"max rel err {s['max_rel_err']}"
                + (f", ours {s['ours_ratio_geomean']:.2f}x faster" if s.get("ours_ratio_geomean")
                   else "")
                + (f", host {s['host_us_median']:.0f} us a step (median)"
                   if s.get("host_us_median") is not None else "")
                + (f" / {s['host_min_us_median']:.0f} (fastest of 20)"
                   if s.get("host_min_us_median") is not None else "")
                + (f" ({s['host_device_meta_us_median']:.0f} with device metadata)"
                   if s.get("host_device_meta_us_median") is not None else "")
            )  # fmt: skip


def plot_roofline(result: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = result["ceilings"]
    fig, ax = plt.subplots(figsize=(7, 5))
    xs = [2**i for i in range(3, 14)]
    ax.plot(
        xs,
        [min(c["peak_flops"], x * c["bw_bytes_per_s"]) / 1e12 for x in xs],
        "k-",
        label="roofline (H200 measured ceilings)",
    )
    markers = {"cuda": "o", "torch": "x", "triton": "s", "flashinfer": "^", "sglang-triton": "v"}
    for b in result["summary"]:
        pts = [
            (r["tflop_per_s"] * 1e12 / (r["tb_per_s"] * 1e12), r["tflop_per_s"])
            for r in result["rows"]
            if r["backend"] == b and "tflop_per_s" in r
        ]
        if pts:
            ax.scatter(*zip(*pts, strict=True), marker=markers.get(b, "."), label=b)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / prefix KV byte)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"tree-verify attention, {result['gpu']}, {result['date'][:10]}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_json(result: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(result, indent=1))
