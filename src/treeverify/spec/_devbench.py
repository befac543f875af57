# TEMPORARY device benchmark (deleted before hand-off).
import json
import statistics
import sys

sys.path.insert(0, "src")
import torch

import treeverify.spec as spec
from treeverify.spec.tree_oracle import build_tree_host_from_topk

dev = torch.device("cuda")
print(torch.__version__, torch.cuda.get_device_name())
res = {}
# correctness vs host heap on GPU tables
g = torch.Generator().manual_seed(0)
bad = 0
for t in range(30):
    B = 2
    L = int(torch.randint(1, 16, (1,), generator=g))
    V = int(torch.randint(2, 3000, (1,), generator=g))
    budget = int(torch.randint(1, 400, (1,), generator=g))
    kind = t % 3
    x = (
        torch.randint(0, 3, (B, L, V), generator=g).float()
        if kind == 0
        else torch.randn(B, L, V, generator=g) * (3 if kind == 1 else 0.01)
    )
    x = x.to(dev)
    lp, ids = spec.draft_topk(x, min(budget, V))
    roots = torch.zeros(B, dtype=torch.long, device=dev)
    a = spec.build_tree_from_topk(lp, ids, budget, roots)
    b = build_tree_host_from_topk(lp, ids, budget, roots)
    ok = all(
        torch.equal(getattr(a, f), getattr(b, f))
        for f in ("tokens", "parents", "depths", "num_nodes", "scores")
    )
    bad += not ok
print("gpu vs heap mismatches:", bad, "/ 30", flush=True)
res["mismatch"] = bad


def timeit(fn, n=5):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)


def graph_time(fn, n=10):
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        fn()
    torch.cuda.current_stream().wait_stream(st)
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        fn()
    return timeit(gr.replay, n)


L, V = 15, 151936
for B in (1, 8, 32):
    for budget in (16, 64, 256, 1024):
        logits = torch.randn(B, L, V, device=dev)
        roots = torch.zeros(B, dtype=torch.long, device=dev)
        lp, ids = spec.draft_topk(logits, min(budget, V))
        t_topk = graph_time(lambda: spec.draft_topk(logits, min(budget, V)))
        t_tree = timeit(
            lambda: spec.build_tree_from_topk(lp, ids, budget, roots, backend="triton"), 3
        )
        t_tree_g = graph_time(
            lambda: spec.build_tree_from_topk(lp, ids, budget, roots, backend="triton"), 5
        )
        t_tree_torch_g = (
            graph_time(
                lambda: spec.build_tree_from_topk(lp, ids, budget, roots, backend="torch"), 3
            )
            if budget <= 64
            else float("nan")
        )
        tree = spec.build_tree_from_topk(lp, ids, budget, roots)
        t_mask = graph_time(lambda: spec.parents_to_tree_mask(tree.parents, max_depth=L))
        post = torch.randint(0, 5, tree.tokens.shape, device=dev)
        t_acc = graph_time(lambda: spec.accept_greedy(tree.tokens, tree.parents, post, L))
        key = f"B{B}_n{budget}"
        res[key] = dict(
            topk_graph_ms=t_topk,
            tree_triton_eager_ms=t_tree,
            tree_triton_graph_ms=t_tree_g,
            tree_torch_graph_ms=t_tree_torch_g,
            mask_graph_ms=t_mask,
            accept_greedy_graph_ms=t_acc,
        )
        print(key, {k: round(v, 3) for k, v in res[key].items()}, flush=True)
# profile of one graph-less call: top kernels
logits = torch.randn(8, L, V, device=dev)
roots = torch.zeros(8, dtype=torch.long, device=dev)
lp, ids = spec.draft_topk(logits, 64)
from torch.profiler import ProfilerActivity, profile

spec.build_tree_from_topk(lp, ids, 64, roots)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    spec.build_tree_from_topk(lp, ids, 64, roots)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
import os

out = os.environ.get("OUT", "/tmp")
json.dump(res, open(f"{out}/spec_bench.json", "w"), indent=1)
