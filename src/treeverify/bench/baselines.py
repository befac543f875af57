"""Other projects' tree-verify kernels, timed in the same process as ours on the same inputs.

- `flashinfer`: flashinfer-python's paged prefill wrapper with a custom mask (what SGLang's
  FlashInfer backend runs for GQA trees; MLA through the same generic wrapper with 576/512 heads,
  since its MLA wrapper takes no mask). Its host-side `plan()` time is reported too.
- `sglang-triton`: SGLang's own Triton `extend_attention_fwd` from the installed sglang package,
  on the grid case re-expressed in SGLang's layout (sglang_inputs.py).

Both are optional imports, installed beside treeverify and never copied into it; `unavailable()`
says in one line why one cannot run. Timing as for ours: the call captured `reps` times in a CUDA
graph, the median replay per call (a call that cannot be captured is timed eagerly with events,
and the row says so).
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from treeverify.bench.sglang_inputs import (
    call_extend_attention,
    load_sglang_extend_attention,
    sglang_layout,
)

BASELINES = ("flashinfer", "sglang-triton")


def unavailable(name: str) -> str | None:
    """None when baseline `name` can run here, else one line saying why not."""
    if name == "flashinfer":
        try:
            import flashinfer  # noqa: F401
        except ImportError as exc:
            return f"flashinfer-python is not installed ({exc})"
        return None
    if name == "sglang-triton":
        try:
            load_sglang_extend_attention()
        except ImportError as exc:
            return str(exc)
        return None
    raise ValueError(f"name: unknown baseline {name!r}; known: {BASELINES}")


def time_captured(launch, out: torch.Tensor, reps: int, replays: int) -> tuple[float, dict]:
    """(median seconds per launch, notes) of `launch()` (which writes `out`), graph-captured."""
    from treeverify.bench.kernel import median_replay_seconds

    launch()  # compile, workspaces: outside capture
    torch.cuda.synchronize()
    try:
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            for _ in range(reps):
                launch()
        torch.cuda.current_stream().wait_stream(stream)
    except Exception as exc:  # not capturable: time it eagerly, and say so
        torch.cuda.synchronize()
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            launch()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times), {"timing": f"eager ({type(exc).__name__}: {exc})"}
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return median_replay_seconds(graph, replays) / reps, {"timing": "graph replay"}


def _out_like(inp: dict, hq: int, dv: int) -> torch.Tensor:
    q = inp["q"]
    return torch.full((q.shape[0], hq, dv), float("nan"), dtype=q.dtype, device=q.device)


def time_sglang_triton(case, inp: dict, page_size: int, reps: int, replays: int):
    fn, where = load_sglang_extend_attention()
    lay = sglang_layout(inp, page_size)
    out = _out_like(inp, case.hq, case.dv)
    secs, notes = time_captured(
        lambda: call_extend_attention(fn, lay, out, page_size), out, reps, replays
    )
    return secs, out.clone(), {**notes, "module": where}


def time_flashinfer(case, inp: dict, page_size: int, reps: int, replays: int):
    import flashinfer

    q, k_cache = inp["q"], inp["k_cache"]
    dev = q.device
    lay = sglang_layout(inp, page_size)  # its [N, P+N] row-major mask is FlashInfer's layout too
    n = lay["max_len_extend"]
    prefix = inp["prefix_lens"].to("cpu", torch.int64)
    kv_lens = prefix + n
    pages = (kv_lens + page_size - 1) // page_size
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), pages.cumsum(0)]).to(torch.int32)
    table = inp["block_table"].cpu()
    indices = torch.cat([table[b, : int(pages[b])] for b in range(len(pages))]).to(torch.int32)
    last = (kv_lens - (pages - 1) * page_size).to(torch.int32)
    v = k_cache[..., : case.dv] if case.mla else inp["v_cache"]
    workspace = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    start = time.perf_counter()
    wrapper.plan(
        lay["qo_indptr"], indptr.to(dev), indices.to(dev), last.to(dev), case.hq, case.hkv,
        case.dqk, page_size, head_dim_vo=case.dv, custom_mask=lay["custom_mask"].bool(),
        sm_scale=inp["sm_scale"], q_data_type=q.dtype, kv_data_type=k_cache.dtype,
    )  # fmt: skip
    torch.cuda.synchronize()
    plan_us = (time.perf_counter() - start) * 1e6
    out = _out_like(inp, case.hq, case.dv)
    secs, notes = time_captured(lambda: wrapper.run(q, (k_cache, v), out=out), out, reps, replays)
    return secs, out.clone(), {**notes, "host_plan_us": plan_us}


def time_baseline(name: str, case, inp: dict, page_size: int, reps: int, replays: int):
    """(seconds per call, output, notes) of baseline `name` on one grid case."""
    if name == "flashinfer":
        return time_flashinfer(case, inp, page_size, reps, replays)
    if name == "sglang-triton":
        return time_sglang_triton(case, inp, page_size, reps, replays)
    raise ValueError(f"name: unknown baseline {name!r}; known: {BASELINES}")


def geomean(values: list[float]) -> float | None:
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else None
