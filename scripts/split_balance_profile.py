"""Where a verify step's time goes with and without balanced splits (v12): SGLang's batch-path
shapes (8 requests of 1..4096 prefix keys drawn per seed, N=64, a plan sized for 8192 keys),
each kernel of one captured plan.run timed by the profiler over replays (its device time a
replay), per balance setting.

    python scripts/split_balance_profile.py [--json out.json] [--seeds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random

import torch

from treeverify.bench.cases import Case, make_inputs
from treeverify.bench.kernel import back_to_back_replay_seconds, replay_kernel_times
from treeverify.kernels.plan import TreeAttentionPlan
from treeverify.kernels.splits import policy_splits

SHAPES = {"llama8b": (32, 8, 128, 128, False), "kimi_tp8": (8, 1, 576, 512, True)}


def profile(shape_name: str, balance: str, prefixes: list[int], replays: int = 20) -> dict:
    os.environ["TREEVERIFY_CUDA_SPLIT_BALANCE"] = balance
    hq, hkv, dqk, dv, mla = SHAPES[shape_name]
    case = Case(shape_name, len(prefixes), max(prefixes), 64, hq, hkv, dqk, dv, mla)
    inp = make_inputs(case, page_size=16, device="cuda", seed=sum(prefixes),
                      prefix_lens=prefixes)  # fmt: skip
    plan = TreeAttentionPlan(
        num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=dqk, head_dim_v=dv, mla=mla, page_size=16,
        max_batch=len(prefixes), max_tree=64, max_pages_per_request=inp["block_table"].shape[1],
        max_kv_len=8192 + 64, sm_scale=inp["sm_scale"], dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip
    plan.plan(inp["block_table"], inp["prefix_lens"], inp["qo_indptr"], inp["tree_mask"])
    q, kc, vc = inp["q"], inp["k_cache"], inp["v_cache"]
    out = torch.empty(q.shape[0], hq, dv, dtype=q.dtype, device="cuda")
    plan.run(q, kc, vc, out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(q, kc, vc, out)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    kernels = replay_kernel_times(graph, replays)
    pol = plan.split_policy
    return {
        "shape": shape_name, "balance": balance, "prefixes": prefixes,
        "policy": pol.__dict__, "splits": policy_splits(pol, [p + 64 for p in prefixes]),
        "replay_us": back_to_back_replay_seconds(graph, replays, passes=1) * 1e6,
        "kernels_us": {k["kernel"][:60]: k["us_per_replay"] for k in kernels},
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for seed in range(args.seeds):
        rng = random.Random(seed)
        prefixes = [rng.randint(1, 4096) for _ in range(8)]
        for shape in SHAPES:
            for balance in ("1", "2"):
                r = profile(shape, balance, prefixes)
                rows.append(r)
                ks = ", ".join(f"{k.split('<')[0].split('(')[0]} {v:.1f}"
                               for k, v in r["kernels_us"].items())  # fmt: skip
                print(f"seed {seed} {shape:<8} balance {balance}: replay {r['replay_us']:6.1f} us"
                      f" splits {r['splits']} max_splits {r['policy']['max_splits']} | {ks}",
                      flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
