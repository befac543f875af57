"""The expert GEMV (models/moe_gemv.py) alone on a GPU, tile by tile, against the grouped GEMM it
replaces: GPU us a call and HBM GB/s (the routed experts' weight bytes), for the gate|up and the
down product of a decode-sized batch. Each call is timed inside a CUDA graph (20 calls a replay,
so a Triton launch's host cost is not what is measured). The tile the engine uses is
TREEVERIFY_MOE_GEMV_TILE (default moe_gemv.GATE_UP_TILE and DOWN_TILE).
Usage (repo root): PYTHONPATH=src python3 scripts/moe_gemv_bench.py [--pairs 6,16] --json F"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from treeverify.bench.kernel import _git_commit, back_to_back_replay_seconds
from treeverify.models import moe_gemv

SHAPES = {  # name: (experts, hidden, moe_intermediate, k)
    "mla-moe": (64, 2048, 1408, 6),  # random:mla-moe
    "kimi-like": (64, 7168, 2048, 8),  # Kimi K2 / DeepSeek-V3 expert shapes, 64 of the experts
}
TILES = [(bn, bk, w) for bn, bk, w in itertools.product((8, 16, 32), (128, 256, 512, 1024),
                                                         (4, 8)) if bn * bk <= 16384]  # fmt: skip


def graph_us(fn, calls: int = 20, replays: int = 10) -> float:
    """Microseconds a call of fn(): `calls` of them captured in one graph, replayed back to back
    (bench/kernel.py's timing, as the kernel grid's)."""
    fn()  # compile and warm outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return back_to_back_replay_seconds(g, replays) * 1e6 / calls


def bench_shape(name: str, pairs: int) -> list[dict]:
    e, hidden, inter, k = SHAPES[name]
    t = max(1, pairs // k)
    g = torch.Generator(device="cuda").manual_seed(pairs)
    bf = torch.bfloat16
    w_gu = (torch.randn(e, 2 * inter, hidden, device="cuda", generator=g) * 0.02).to(bf)
    w_d = (torch.randn(e, hidden, inter, device="cuda", generator=g) * 0.02).to(bf)
    x = torch.randn(t, hidden, device="cuda", generator=g).to(bf)
    # distinct experts per token (a router's top-k), random across tokens
    idx = torch.stack([torch.randperm(e, device="cuda", generator=g)[:k] for _ in range(t)])
    h = torch.randn(t * k, 2 * inter, device="cuda", generator=g).to(bf)
    rows = []
    for what, w, inp, act in (("gate_up", w_gu, x, False), ("down", w_d, h, True)):
        nbytes = t * k * w.shape[1] * w.shape[2] * 2
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.zeros(e, dtype=torch.int64, device="cuda").index_add_(
            0, flat, torch.ones_like(flat))  # fmt: skip
        offs = counts.cumsum(0).to(torch.int32)
        src = x[order // k] if not act else h[order][:, :inter].contiguous()
        us = graph_us(lambda src=src, w=w, offs=offs: torch._grouped_mm(
            src, w.transpose(1, 2), offs=offs))  # fmt: skip
        rows.append({"shape": name, "pairs": t * k, "gemm": what, "impl": "grouped_mm",
                     "us": round(us, 2), "gb_per_s": round(nbytes / us / 1e3, 1)})  # fmt: skip
        for tile in TILES:
            us = graph_us(lambda inp=inp, w=w, act=act, tile=tile: moe_gemv.expert_gemv(
                inp, idx, w, act=act, tiles=tile))  # fmt: skip
            rows.append({"shape": name, "pairs": t * k, "gemm": what, "impl": "gemv",
                         "tile": list(tile), "us": round(us, 2),
                         "gb_per_s": round(nbytes / us / 1e3, 1)})  # fmt: skip
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", default="6,16")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    rows = []
    for name in args.shapes.split(","):
        for pairs in (int(p) for p in args.pairs.split(",")):
            got = bench_shape(name, pairs)
            rows += got
            for gemm in ("gate_up", "down"):
                mine = [r for r in got if r["gemm"] == gemm]
                base = next(r for r in mine if r["impl"] == "grouped_mm")
                best = sorted((r for r in mine if r["impl"] == "gemv"), key=lambda r: r["us"])[:3]
                print(f"{name:9s} pairs {mine[0]['pairs']:3d} {gemm:7s} grouped_mm "
                      f"{base['us']:7.2f} us {base['gb_per_s']:7.1f} GB/s | best GEMV tiles "
                      + ", ".join(f"{r['tile']} {r['us']:.2f} us {r['gb_per_s']:.0f} GB/s"
                                  for r in best))  # fmt: skip
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "commit": _git_commit(),
            "command": " ".join(sys.argv), "default_tile": {"gate_up": list(moe_gemv.tile(False)),
                                                    "down": list(moe_gemv.tile(True))}}  # fmt: skip
    args.json.write_text(json.dumps(meta | {"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
