"""Paper cost model for Kimi K2.6 + DDTree verify on 8 H200s (docs/sglang.md): per-GPU verify
attention time from OUR MEASURED kernel grid, against a roofline of the step's MoE/GEMM work.

Attention: per layer t = t0 + FLOPs / R, fitted (least squares on time) to the grid's measured
Kimi MLA rows (bench_results/2026-12-04-h200-af07f17-grid_page16_best_of_2.json, kernels v28;
v10's was 2026-12-02-h200-e0290e3-bench_cuda.json; TP8 = 8 heads, TP1 = 64 heads,
B {1,8,32} x L {1k,8k,32k} x N {16,64}); budgets above N=64 and contexts above 32k are
EXTRAPOLATED along that fit. MoE/GEMM: a lower bound, max(weight
bytes / 4.24 TB/s, FLOPs / 701 TFLOP/s) per step (the grid's measured H200 ceilings), under
the assumptions printed.

    python scripts/sglang_cost_model.py [--grid FILE] [--batch 1]
"""

from __future__ import annotations

import argparse
import json

BW, PEAK = 4.24e12, 701e12  # H200 ceilings measured here (cases.json)
# Kimi K2 text architecture (K2.6 assumed the same): 61 layers (1 dense + 60 MoE), hidden 7168,
# 64 heads, MLA q_lora 1536, kv_lora 512, rope 64, nope 128, v 128; 384 routed experts top-8 +
# 1 shared, expert intermediate 2048; dense intermediate 18432; vocab 163840.
LAYERS, MOE_LAYERS, HIDDEN, HEADS, VOCAB = 61, 60, 7168, 64, 163840
EXPERTS, TOPK, EXPERT_PARAMS = 384, 8, 3 * 7168 * 2048
ATTN_REPLICATED = 7168 * 1536 + 7168 * 576  # q_a, kv_a (every TP rank holds them)
ATTN_SPLIT = 1536 * HEADS * 192 + 512 * HEADS * 256 + HEADS * 128 * HIDDEN  # q_b, kv_b, o_proj
DENSE_MLP = 3 * HIDDEN * 18432
KV_ROW_BYTES = 576 * 2  # bf16 latent + rope per token per layer
DEFAULT_GRID = "bench_results/2026-12-04-h200-af07f17-grid_page16_best_of_2.json"  # kernels v28


def fit(rows, heads):
    """(t0 seconds, R FLOP/s) from measured MLA rows of `heads` query heads."""
    pts = []
    for r in rows:
        if r.get("mla") and r["hq"] == heads and "us" in r:
            flops = 2 * r["B"] * r["N"] * heads * r["L"] * (576 + 512)
            pts.append((flops, r["us"] * 1e-6))
    n = len(pts)
    # Least squares on the relative error: minimise sum(((t0 + s*f - t) / t)^2).
    w = [1 / t**2 for _, t in pts]
    sw = sum(w)
    swf = sum(wi * f for wi, (f, _) in zip(w, pts, strict=True))
    swt = sum(wi * t for wi, (_, t) in zip(w, pts, strict=True))
    swff = sum(wi * f * f for wi, (f, _) in zip(w, pts, strict=True))
    swft = sum(wi * f * t for wi, (f, t) in zip(w, pts, strict=True))
    slope = (sw * swft - swf * swt) / (sw * swff - swf**2)
    t0 = (swt - slope * swf) / sw
    worst = max(abs(t0 + slope * f - t) / t for f, t in pts)
    return t0, 1 / slope, worst, n


def attention_step(t0, rate, batch, n, ctx, heads):
    flops = 2 * batch * n * heads * ctx * (576 + 512)
    return LAYERS * (t0 + flops / rate)


def moe_gemm_step(tokens, tp, expert_bytes, dense_bytes=2):
    """Roofline lower bound (seconds) of one step's non-attention work on one GPU."""
    touched = EXPERTS * (1 - (1 - TOPK / EXPERTS) ** tokens)  # uniform routing (estimate)
    attn_params = ATTN_REPLICATED + ATTN_SPLIT / tp
    weight_bytes = (
        LAYERS * attn_params * dense_bytes
        + MOE_LAYERS
        * (EXPERT_PARAMS / tp * dense_bytes + touched * EXPERT_PARAMS / tp * expert_bytes)
        + DENSE_MLP / tp * dense_bytes
        + HIDDEN * VOCAB / tp * dense_bytes
    )
    flops = 2 * tokens * (
        LAYERS * attn_params + MOE_LAYERS * (TOPK + 1) * EXPERT_PARAMS / tp + DENSE_MLP / tp
        + HIDDEN * VOCAB / tp
    )  # fmt: skip
    return max(weight_bytes / BW, flops / PEAK), weight_bytes, flops


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", default=DEFAULT_GRID)
    p.add_argument("--batch", type=int, default=1, help="requests verified together per GPU")
    p.add_argument(
        "--expert-bytes", type=float, default=0.5, help="routed expert weight bytes/param"
    )
    args = p.parse_args()
    with open(args.grid) as f:
        data = json.load(f)
    t0, rate, worst, n = fit(data["rows"], 8)
    t1, rate1, worst1, n1 = fit(data["rows"], 64)
    print(f"grid {args.grid} (commit {data['commit']}, {data['date']}, {data['gpu']})")
    print(f"TP8 fit (8 heads, {n} rows): t0 {t0 * 1e6:.1f} us, R {rate / 1e12:.0f} TFLOP/s, "
          f"worst row {worst:.0%}; TP1 fit (64 heads, {n1} rows): t0 {t1 * 1e6:.1f} us, "
          f"R {rate1 / 1e12:.0f} TFLOP/s, worst row {worst1:.0%}")  # fmt: skip
    budgets = [16, 32, 64, 128, 256, 512, 1024]
    ctxs = [4096, 16384, 32768, 65536, 131072]
    b = args.batch
    print(f"\nPer GPU, one verify step, B={b} request(s) per GPU, TP8 attention (8 heads/GPU).")
    print("Attention ms per step (61 layers) | MoE+GEMM lower bound ms | attention share")
    print(
        "| budget (N=budget+1) | " + " | ".join(f"{c // 1024}k" for c in ctxs) + " | MoE+GEMM ms |"
    )
    print("| --- " * (len(ctxs) + 2) + "|")
    for bud in budgets:
        n_nodes = bud + 1
        moe, _, _ = moe_gemm_step(b * n_nodes, 8, args.expert_bytes)
        cells = []
        for c in ctxs:
            att = attention_step(t0, rate, b, n_nodes, c, 8)
            cells.append(f"{att * 1e3:.1f} ({att / (att + moe):.0%})")
        print(f"| {bud} ({n_nodes}) | " + " | ".join(cells) + f" | {moe * 1e3:.1f} |")
    print("\nKV bytes per GPU per request (TP8 replicates MLA's single latent head on every GPU;"
          " read once per step by the verify kernel):")  # fmt: skip
    print("| context | " + " | ".join(f"{c // 1024}k" for c in ctxs) + " |")
    print("| --- " * (len(ctxs) + 1) + "|")
    print("| GB | " + " | ".join(f"{c * KV_ROW_BYTES * LAYERS / 1e9:.2f}" for c in ctxs) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
