"""When and where each CTA of the GQA ping-pong kernel ran (GPU, sm_90a): the forward compiled
with TV_CTA_TRACE (tree_attention_gqa_pp_sm90.cuh: each CTA writes its start and end
%globaltimer, its SM id and, in the 128-row kernel, when it passed each step: indptrs, barriers,
Q issued, producer chosen, tile 0's page, tile 0 issued, consumer registers, Q landed, tile 0
landed, tiles done, rows stored), launched on SGLang's harness batch (the prefixes of
scripts/sglang_backend_compare.py's timed draw, 8 requests x 64-node trees, llama8b's 32 / 8
heads), with or without balanced splits, or the persistent kernel (with
TREEVERIFY_CUDA_GQA_SCHEDULE=pingpong-persist: when each CTA started, finished its tiles and
ended after its merges). Asked so far: whether balanced plans' second splits start late or run
slow (twenty-first session: late), where a CTA's ~10 us of fixed cost goes (twenty-second:
~6 us before its first tile lands, ~2.5-3 us after its last), and whether that start is cold
code or a cold Q (twenty-third: not code, `--launches 2` lands tile 0 no sooner; a Q in L2,
`--hot-q`, 0.25-0.4 us sooner).

    PYTHONPATH=src python3 scripts/cta_trace.py [--page 16] [--balance 1] [--seed 2026]
        [--launches N] [--hot-q] [--define NAME=VALUE ...] [--json out.json]

Prints the kernel's span, when the later splits start, each request's critical CTA and its time
a 64-key tile, and the phase table (median time to each step, the tile loop's line); the JSON
keeps every CTA. `--launches 2`: the traced launch right after another of the same kernel;
`--hot-q`: Q rewritten just before it (in L2); `--define`: an experiment's #ifdef built into
the traced variant only (scripts/gpu-cta-phases runs the first two).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import importlib.util
import json
import math
import random
import sys
from pathlib import Path

import torch

HQ, HKV, D, N, BATCH, CTX = 32, 8, 128, 64, 8, 8192  # SGLang harness, llama8b per GPU
BN = 64  # keys a KV tile
WORDS = 16  # trace words a CTA (kTraceWords, tree_attention_gqa_pp_sm90.cuh)
# The phase marks in time order (name, trace word), the producer's first then consumer 0's.
PHASES = (
    ("indptrs loaded", 8), ("barriers ready", 9), ("Q issued", 10), ("producer chosen", 11),
    ("tile 0 page", 12), ("tile 0 issued", 4), ("consumer regs", 13), ("Q landed", 14),
    ("tile 0 landed", 5), ("tiles done", 6), ("rows stored", 7),
)  # fmt: skip
LANDED, DONE, STORED = 8, 9, 10  # indices into PHASES


def harness_prefixes(page: int, seed: int) -> list[int]:
    path = Path(__file__).resolve().parent / "sim_verify_schedule.py"
    spec = importlib.util.spec_from_file_location("_sim_verify_schedule", path)
    sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim)
    return sim.harness_prefixes(page, seed)


def traced_forward(extra_defines: tuple[str, ...] = ()):
    """Make the CUDA launcher build the GQA ping-pong forward with TV_CTA_TRACE defined (and
    `extra_defines`: an experiment's variant of the kernel, built for the trace only)."""
    from treeverify.kernels.cuda import runner
    from treeverify.kernels.cuda.variants import GqaSm90Variant

    plain = runner.fwd_variant

    def fwd_variant(*args, **kwargs):
        v = plain(*args, **kwargs)
        if not isinstance(v, GqaSm90Variant) or not v.pingpong or v.tma:
            raise SystemExit(f"cta_trace: the forward is {v.name}, not a traced ping-pong kernel")
        return dataclasses.replace(v, defines=(*v.defines, "TV_CTA_TRACE", *extra_defines))

    runner.fwd_variant = fwd_variant


def point_trace_at(loaded, buf: torch.Tensor) -> None:
    """Write buf's address into the module's tv_cta_trace pointer."""
    from cuda.bindings import driver as drv

    err, dptr, size = drv.cuModuleGetGlobal(loaded._module, b"tv_cta_trace")
    if err != drv.CUresult.CUDA_SUCCESS or size != 8:
        raise SystemExit(f"cta_trace: tv_cta_trace not found in {loaded.compiled.name} ({err})")
    addr = ctypes.c_uint64(buf.data_ptr())
    (err,) = drv.cuMemcpyHtoD(dptr, ctypes.addressof(addr), 8)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise SystemExit(f"cta_trace: cuMemcpyHtoD: {err}")


def run(args) -> dict:
    from treeverify.kernels.plan import TreeAttentionPlan
    from treeverify.spec import parents_to_tree_mask

    traced_forward(tuple(args.define))
    dev = torch.device("cuda")
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    prefix = harness_prefixes(args.page, args.seed)
    ps = args.page
    per_req = -(-(max(prefix) + N) // ps)
    num_pages = BATCH * per_req + 2
    plan = TreeAttentionPlan(
        num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D, page_size=ps, max_batch=BATCH,
        max_tree=N, max_pages_per_request=CTX // ps, max_kv_len=CTX, sm_scale=D**-0.5,
        split_balance=args.balance,
    )  # fmt: skip
    pages = list(range(1, num_pages))
    rng.shuffle(pages)
    table = torch.zeros(BATCH, CTX // ps, dtype=torch.int32)  # (B, pages)
    for b, p in enumerate(prefix):
        need = -(-(p + N) // ps)
        table[b, :need] = torch.tensor(pages[b * per_req : b * per_req + need])
    parents = torch.tensor([[-1] + [rng.randrange(i) for i in range(1, N)] for _ in prefix])
    mask = parents_to_tree_mask(parents)  # (B*N, W)
    qo = torch.arange(0, (BATCH + 1) * N, N, dtype=torch.int32)  # (B+1,)
    k_cache = torch.randn(num_pages, ps, HKV, D, device=dev).to(torch.bfloat16)
    v_cache = torch.randn(num_pages, ps, HKV, D, device=dev).to(torch.bfloat16)
    q = torch.randn(BATCH * N, HQ, D, device=dev).to(torch.bfloat16)
    out = torch.empty(BATCH * N, HQ, D, device=dev, dtype=torch.bfloat16)
    plan.plan(table, torch.tensor(prefix, dtype=torch.int32), qo, mask)
    trace = torch.zeros(WORDS * 65536, dtype=torch.int64, device=dev)  # WORDS a CTA
    point_trace_at(plan._launcher.fwd_kernel, trace)
    launcher = plan._launcher
    grid = launcher.grid
    if math.prod(grid) > 65536:
        raise SystemExit(f"cta_trace: grid {grid} has more CTAs than the trace buffer holds")
    for _ in range(3):  # warm: the last launch's trace is kept
        trace.zero_()
        # --launches N: N - 1 launches of the same forward right before the traced one (its
        # code and data fresh in the SMs' caches; every mark and the end are overwritten by
        # the last launch, the start too)
        for _ in range(args.launches - 1):
            plan.run(q, k_cache, v_cache, out)
        if args.hot_q:  # Q just written, as a model's QKV projection leaves it: in L2
            q.mul_(1.0)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        plan.run(q, k_cache, v_cache, out)
        end.record()
        torch.cuda.synchronize()
    rows = trace.view(-1, WORDS)[: math.prod(grid)].cpu().tolist()
    return analyse(rows, prefix, grid, args, start.elapsed_time(end) * 1e3, plan)


def analyse_persistent(rows, prefix, grid, args, event_us: float, plan) -> dict:
    """The persistent kernel (TREEVERIFY_CUDA_GQA_SCHEDULE=pingpong-persist): word 3 is when
    the CTA's tiles were done; what follows is its cut units' merges."""
    ctas = [{"cta": i, "sm": sm, "start_ns": a, "end_ns": e, "tiles_done_ns": d}
            for i, (a, e, sm, d, *_) in enumerate(rows) if a != 0]  # fmt: skip
    t0 = min(c["start_ns"] for c in ctas)
    for c in ctas:
        for k in ("start", "end", "tiles_done"):
            c[f"{k}_us"] = (c[f"{k}_ns"] - t0) / 1e3 if c[f"{k}_ns"] else None
    span = max(c["end_us"] for c in ctas)
    tiles = HKV * sum(-(-(p + N) // BN) for p in prefix)
    groups = grid[0] // plan._launcher.m_tiles
    print(f"page {args.page}, persistent, grid {grid}: {len(ctas)} CTAs (groups of "
          f"{plan._launcher.m_tiles}), {tiles} tiles, ~{tiles / groups:.1f} a group")  # fmt: skip
    print(f"  span {span:.1f} us (events around the launch {event_us:.1f} us)")
    print(f"  prefixes {prefix}")

    def dist(name, xs):
        xs = sorted(xs)
        print(f"  {name}: min {xs[0]:.1f}, median {xs[len(xs) // 2]:.1f}, max {xs[-1]:.1f} us")

    done = [c for c in ctas if c["tiles_done_us"] is not None]
    dist("start", [c["start_us"] for c in ctas])
    dist("tiles done", [c["tiles_done_us"] for c in done])
    dist("end", [c["end_us"] for c in ctas])
    dist("merges after the tiles", [c["end_us"] - c["tiles_done_us"] for c in done])
    return {"page_size": args.page, "persistent": True, "seed": args.seed, "grid": grid,
            "prefix": prefix, "span_us": span, "event_us": event_us, "ctas": ctas}  # fmt: skip


def analyse(rows, prefix, grid, args, event_us: float, plan) -> dict:
    from treeverify.kernels.splits import split_request

    if plan._launcher.persist:
        return analyse_persistent(rows, prefix, grid, args, event_us, plan)
    balanced = plan._launcher.splits.balance_div > 0  # grid (x, request x head, split)
    kv = [p + N for p in prefix] + [0] * (BATCH - len(prefix))
    longest = balanced and plan._launcher.split_longest_first
    ctas = []
    for start, end, sm, idx, *marks in rows:
        if start == 0:
            continue
        x, y, z = idx & 0xFFFFF, (idx >> 20) & 0xFFFFF, idx >> 40
        bh, split = (y, z) if balanced else (z, y)
        # v27: a balanced plan's later splits serve the requests longest first, not by row.
        b = split_request(kv, bh // HKV, split, longest_first=longest)
        ctas.append({"x": x, "request": b, "head": bh % HKV, "split": split, "sm": sm,
                     "start_ns": start, "end_ns": end, "marks_ns": marks})  # fmt: skip
    t0 = min(c["start_ns"] for c in ctas)
    for c in ctas:
        c["start_us"], c["end_us"] = (c["start_ns"] - t0) / 1e3, (c["end_ns"] - t0) / 1e3
        c["us"] = c["end_us"] - c["start_us"]
        # Each phase's mark (PHASES' order), us after the CTA's own start (None: not reached,
        # or not marked).
        marks = [c["marks_ns"][w - 4] for _, w in PHASES]
        c["phases_us"] = [(m - c["start_ns"]) / 1e3 if m else None for m in marks]
    span = max(c["end_us"] for c in ctas)
    sms = len({c["sm"] for c in ctas})
    defs = f", defines {' '.join(args.define)}" if args.define else ""
    launches = getattr(args, "launches", 1)
    defs += f", the last of {launches} launches back to back" if launches > 1 else ""
    defs += ", Q rewritten just before" if getattr(args, "hot_q", False) else ""
    print(f"page {args.page}, balance {args.balance}{defs}, grid {grid}: {len(ctas)} CTAs on "
          f"{sms} SMs;")  # fmt: skip
    print(f"  span {span:.1f} us (events around the launch {event_us:.1f} us)")
    print(f"  prefixes {prefix}")
    late = sorted(c["start_us"] for c in ctas if c["start_us"] > 1.0)
    if late:
        print(f"  {len(late)} CTAs started after 1 us: first {late[0]:.1f} us, "
              f"median {late[len(late) // 2]:.1f} us, last {late[-1]:.1f} us")  # fmt: skip
    for b, p in enumerate(prefix):
        mine = [c for c in ctas if c["request"] == b and c["us"] > 0.5]
        if not mine:
            continue
        starts, runs = [c["start_us"] for c in mine], [c["us"] for c in mine]
        splits = max(c["split"] for c in mine) + 1
        tiles = (p + N) / splits / BN  # a split's tiles, evenly (the first split may be longer)
        end = max(c["end_us"] for c in mine)
        print(f"  request {b}: {p + N} keys, {splits} split(s), ends {end:.1f} us; CTAs start "
              f"{min(starts):.1f}-{max(starts):.1f} us, run {min(runs):.1f}-{max(runs):.1f} us "
              f"(~{max(runs) / tiles:.2f} us a tile)")  # fmt: skip
    phase_table(ctas, prefix, plan)
    return {"page_size": args.page, "balance": args.balance, "seed": args.seed, "grid": grid,
            "defines": args.define, "prefix": prefix, "span_us": span, "event_us": event_us,
            "ctas": ctas}  # fmt: skip


def cta_tiles(c: dict, prefix: list[int], plan) -> int:
    """KV tiles 128-row CTA c walked (the device's split rule, kernels/splits.py, and the
    kernel's kv_stop: a row block's keys end at its last node)."""
    from treeverify.kernels.splits import split_chunk

    pol = plan._launcher.splits
    kv = [p + N for p in prefix]
    chunk = split_chunk(kv[c["request"]], pol.max_splits, pol.chunk, kv_batch=sum(kv),
                        balance_div=pol.balance_div)  # fmt: skip
    lo = c["split"] * chunk
    rows = BN * 2  # a 128-row CTA: its nodes end at node_hi (the kernel's kv_stop)
    node_hi = min(N, (c["x"] * rows + rows - 1) // (HQ // HKV) + 1)
    stop = min(prefix[c["request"]] + node_hi, lo + chunk)
    return max(0, -(-(stop - lo) // BN))


def phase_table(ctas: list[dict], prefix: list[int], plan) -> None:
    """Where a CTA's time goes: the median time from its start to each phase mark, the tile
    loop's cost a tile (a least-squares line over the CTAs' tile counts) and what is left
    after the rows are stored (the end: merge, exit)."""
    marked = [c for c in ctas if None not in [c["phases_us"][i] for i in (LANDED, DONE, STORED)]]
    if not marked:
        print("  no phase marks (a 256-row or TMA kernel: only the 128-row cp.async ones mark)")
        return

    def med(xs):
        xs = sorted(x for x in xs if x is not None)
        return xs[len(xs) // 2] if xs else float("nan")

    ph = [[c["phases_us"][i] for c in marked] for i in range(len(PHASES))]
    print(f"  phases, median over {len(marked)} CTAs (us after the CTA's start): " +
          ", ".join(f"{name} {med(xs):.2f}" for (name, _), xs in zip(PHASES, ph, strict=True)) +
          f", end {med([c['us'] for c in marked]):.2f}")  # fmt: skip
    tiles = [cta_tiles(c, prefix, plan) for c in marked]
    loop = [c["phases_us"][DONE] - c["phases_us"][LANDED] for c in marked]
    n = len(tiles)
    mt, ml = sum(tiles) / n, sum(loop) / n
    var = sum((t - mt) ** 2 for t in tiles)
    if var > 0:
        slope = sum((t - mt) * (y - ml) for t, y in zip(tiles, loop, strict=True)) / var
        stores = med([c["phases_us"][STORED] - c["phases_us"][DONE] for c in marked])
        after = med([c["us"] - c["phases_us"][STORED] for c in marked])
        print(
            f"  tile loop: {ml - slope * mt:.2f} us + {slope:.3f} us a tile "
            f"({min(tiles)}-{max(tiles)} tiles); outside it: start -> tile 0 landed "
            f"{med(ph[LANDED]):.2f} us, stores {stores:.2f} us, after them {after:.2f} us"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--balance", type=int, default=1)
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--json")
    p.add_argument("--hot-q", action="store_true",
                   help="rewrite Q right before the traced launch (in L2, as a model's QKV "
                   "projection leaves it; the batch's K/V, larger than L2, evicts it "
                   "otherwise)")  # fmt: skip
    p.add_argument("--launches", type=int, default=1,
                   help="trace the last of this many back-to-back launches: with the kernel's "
                   "code just run on every SM, is a CTA's start still ~6 us? (instruction "
                   "cache misses, or not)")  # fmt: skip
    p.add_argument("--define", action="append", default=[], metavar="NAME[=VALUE]",
                   help="also compile the traced kernel with this (an experiment's #ifdef: "
                   "e.g. the twenty-second session's TV_PP_FIRST_TILE=k, whose diff is in "
                   "bench_results/2026-12-03-h200-ae239d3-first_tile_trace.tgz)")  # fmt: skip
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("cta_trace: needs a CUDA GPU (sm_90a)", file=sys.stderr)
        return 3
    result = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
