"""The decode GEMV (models/gemv.py) against cuBLAS (F.linear) on the linear layers of tiny-code
and the 1B and 8B Llama shapes, at every row count the GEMV takes, whatever the size cap:
microseconds per call and HBM TB/s, each timed as the engine runs it (20 calls captured in one
CUDA graph, median of 20 replays). Then the few-row kernel (skinny_gemm.cu) against cuBLAS at
2-32 rows on the shapes up to --skinny-max-mb (rows "kernel": "skinny"). GPU only.

    PYTHONPATH=src python scripts/gemv_bench.py [--json out.json] [--skinny-only]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

from treeverify.bench.kernel import median_replay_seconds
from treeverify.models import gemv as gemv_mod

SHAPES = {  # name: (N, K)
    "tiny qkv": (512, 256), "tiny o": (256, 256), "tiny gate_up": (1280, 256),
    "tiny down": (256, 640), "tiny lm_head": (8192, 256),
    "1b qkv": (3072, 2048), "1b o": (2048, 2048), "1b gate_up": (16384, 2048),
    "1b down": (2048, 8192), "1b lm_head": (128256, 2048),
    "8b qkv": (6144, 4096), "8b o": (4096, 4096), "8b gate_up": (28672, 4096),
    "8b down": (4096, 14336),
}  # fmt: skip
DRAFTER_SHAPES = {"dflash fc": (256, 768), "dflash qkv": (512, 256)}  # tiny-code-dflash's
SKINNY_ROWS = (2, 5, 9, 16, 17, 24, 25, 32)  # 24 | 25: the three- | four-tile instance
CALLS, REPLAYS = 20, 20


def timed(fn) -> float:
    """Median seconds per call of fn() replayed from a graph of CALLS calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    return median_replay_seconds(graph, REPLAYS) / CALLS


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--skinny-only", action="store_true", help="skip the one-row GEMV's table")
    ap.add_argument("--skinny-max-mb", type=float, default=70.0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gemv_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    print(f"{'layer':<12} {'M':>2} {'MB':>7} {'cublas us':>10} {'TB/s':>6} {'gemv us':>8} "
          f"{'TB/s':>6} {'speedup':>8}")  # fmt: skip
    for name, (n, k) in ({} if args.skinny_only else SHAPES).items():
        w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
        for m in range(1, gemv_mod.GEMV_MAX_ROWS + 1):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            mb = n * k * 2 / 1e6
            cub = timed(lambda x=x, w=w: F.linear(x, w))
            gem = timed(lambda x=x, w=w: gemv_mod.gemv(x, w))
            rows.append({"layer": name, "m": m, "n": n, "k": k, "weight_mb": mb,
                         "cublas_us": cub * 1e6, "gemv_us": gem * 1e6})  # fmt: skip
            print(f"{name:<12} {m:>2} {mb:7.1f} {cub * 1e6:10.2f} {mb / 1e6 / cub:6.2f} "
                  f"{gem * 1e6:8.2f} {mb / 1e6 / gem:6.2f} {cub / gem:7.2f}x")  # fmt: skip
        del w
    print(f"{'layer':<12} {'M':>2} {'MB':>7} {'cublas us':>10} {'skinny us':>10} {'speedup':>8}")
    for name, (n, k) in (SHAPES | DRAFTER_SHAPES).items():
        mb = n * k * 2 / 1e6
        if mb > args.skinny_max_mb:
            continue
        w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
        for m in SKINNY_ROWS:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            cub = timed(lambda x=x, w=w: F.linear(x, w))
            few = timed(lambda x=x, w=w: gemv_mod.skinny(x, w))
            rows.append({"kernel": "skinny", "layer": name, "m": m, "n": n, "k": k,
                         "weight_mb": mb, "cublas_us": cub * 1e6,
                         "skinny_us": few * 1e6})  # fmt: skip
            print(f"{name:<12} {m:>2} {mb:7.1f} {cub * 1e6:10.2f} {few * 1e6:10.2f} "
                  f"{cub / few:7.2f}x")  # fmt: skip
        del w
    if args.json:
        meta = {"gpu": torch.cuda.get_device_name(), "commit": os.environ.get("TREEVERIFY_COMMIT"),
                "command": " ".join(sys.argv)}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(meta | {"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
