"""Does scaling the drafter's logits by a temperature before `build_tree` choose better DDTree
trees? Offline, on the CPU, from the acceptance traces of scripts/record_accept_traces.py.

Per prompt: `trace_prompt` (record_accept_traces.py) generates `--tokens` greedy tokens with
DDTREE at budget 64 and, for every position p, drafts with DFlash from the engine's own context
rows, builds the tree and walks it along the known greedy continuation; its `keep` hands back
the drafter logits (N, L, V), the roots and the token ids. Then, for every temperature setting
(a vector T_k, one per depth position k), the trees are rebuilt from `logits / T_k` at budget 64
and walked with the same `walk`; a budget-B round accepts the path cut at its first node index >
B (`cut` in sim_adaptive.py: the budget-B tree is the first B nodes of the budget-64 one;
checked here on the first chunk of every setting). Speculation stays lossless for any tree, so
only the accept length changes: the mean committed tokens per round (mean len(path), over all
positions).

Settings: single T in --temps; then T_k = T0 * (1 + s*k/(L-1)) for s in --slopes with T0 the
best single T on set A (mean over texts and budgets 8/16/32/64); and T_k fitted per depth to
minimise the true token's NLL on set A ("fit_nll"). Set A (prompts 0..n_a-1) picks, set B
(prompts skip_b..skip_b+n_b-1) reports. Calibration per depth k: the drafter's mean top-1
probability vs the top-1 accuracy against the greedy continuation (argmax logits[k] ==
ids[p+1+k]), also restricted to positions whose depths < k were all top-1 correct.

Identical prompt strings (bench_pair's prose list cycles over its paragraphs) are traced once.

    PYTHONPATH=src python scripts/sweep_draft_temperature.py --json out.json
        [--n-a 8 --skip-b 8 --n-b 16 --tokens 128]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pair import DATA, PROSE, code_prompts, prose_prompts  # noqa: E402
from record_accept_traces import trace_prompt, walk  # noqa: E402
from sim_adaptive import cut  # noqa: E402

from treeverify.bench.kernel import _git_commit  # noqa: E402
from treeverify.engine.llm import LLM  # noqa: E402
from treeverify.spec.tree import build_tree  # noqa: E402

BUDGETS = (8, 16, 32, 64)
CHUNK = 32  # trees built per call, as trace_prompt does


def record(llm: LLM, prompt: str, tokens: int, budget: int) -> dict:
    """One prompt's trace plus what a re-build needs: logits (N, L, V), roots (N,), conts (N, L)."""
    keep: dict = {}
    t = trace_prompt(llm, prompt, tokens, budget, chunk=CHUNK, keep=keep)
    ids, depth, start = keep["ids"], llm.spec.depth, t["prompt_tokens"]
    logits, roots = keep["logits"], keep["roots"]  # (N, L, V) fp32, (N,)
    assert logits.shape[0] == tokens and roots.tolist() == ids[start : start + tokens]
    conts = torch.tensor([ids[p + 1 : p + 1 + depth] for p in range(start, start + tokens)])
    return {"logits": logits, "roots": roots, "conts": conts, "paths": t["paths"],
            "checked": t["checked"], "mismatches": len(t["check_mismatches"])}  # fmt: skip


def paths_at(rec: dict, temps: torch.Tensor, budget: int = 64) -> list[list[int]]:
    """Walks of the trees built from logits / temps (temps (L,)) at `budget`."""
    out = []
    n = rec["logits"].shape[0]
    for lo in range(0, n, CHUNK):
        lg = rec["logits"][lo : lo + CHUNK] / temps[None, :, None]
        tree = build_tree(lg, budget, rec["roots"][lo : lo + CHUNK])
        for i in range(lg.shape[0]):
            cont = rec["conts"][lo + i].tolist()
            out.append(walk(tree.tokens[i].tolist(), tree.parents[i].tolist(), cont))
    return out


def check_cut(rec: dict, temps: torch.Tensor) -> bool:
    """The budget-B tree's walk is the budget-64 walk cut at node B (first chunk)."""
    sub = {k: v[:CHUNK] for k, v in rec.items() if k in ("logits", "roots", "conts")}
    big = paths_at(sub, temps, 64)
    return all(paths_at(sub, temps, b) == [cut(p, b) for p in big] for b in BUDGETS[:-1])


def mean_committed(paths: list[list[int]]) -> dict[str, float]:
    return {str(b): sum(len(cut(p, b)) for p in paths) / len(paths) for b in BUDGETS}


def score(res: dict) -> float:
    """One number to pick a setting: the mean over texts and budgets."""
    vals = [v for per_text in res.values() for v in per_text.values()]
    return sum(vals) / len(vals)


@torch.inference_mode()
def calibration(recs: list[dict], temps: torch.Tensor) -> list[dict]:
    """Per depth k: mean top-1 prob, top-1 accuracy vs the continuation, the same on positions
    whose depths < k were all top-1 correct, and the true token's mean NLL."""
    logits = torch.cat([r["logits"] for r in recs])  # (N, L, V)
    conts = torch.cat([r["conts"] for r in recs])  # (N, L)
    lp = torch.log_softmax(logits / temps[None, :, None], dim=-1)
    top_lp, top_id = lp.max(dim=-1)  # (N, L)
    hit = top_id == conts
    prefix_ok = torch.cumprod(torch.cat([torch.ones_like(hit[:, :1]), hit[:, :-1]], 1), 1).bool()
    nll = -lp.gather(-1, conts[..., None])[..., 0]
    rows = []
    for k in range(logits.shape[1]):
        m = prefix_ok[:, k]
        rows.append({"k": k, "n": int(hit.shape[0]),
                     "mean_top1_prob": top_lp[:, k].exp().mean().item(),
                     "top1_acc": hit[:, k].float().mean().item(),
                     "n_prefix_ok": int(m.sum()),
                     "mean_top1_prob_prefix_ok": top_lp[m, k].exp().mean().item(),
                     "top1_acc_prefix_ok": hit[m, k].float().mean().item(),
                     "nll_true": nll[:, k].mean().item()})  # fmt: skip
    return rows


@torch.inference_mode()
def fit_nll_temps(recs: list[dict], grid: list[float]) -> list[float]:
    """Per depth, the T on `grid` minimising the true token's mean NLL."""
    logits = torch.cat([r["logits"] for r in recs])
    conts = torch.cat([r["conts"] for r in recs])
    true = logits.gather(-1, conts[..., None])[..., 0]  # (N, L)
    best = []
    nlls = []
    for t in grid:
        nlls.append((torch.logsumexp(logits / t, dim=-1) - true / t).mean(0))  # (L,)
    nlls = torch.stack(nlls)  # (G, L)
    for k in range(logits.shape[1]):
        best.append(grid[int(nlls[:, k].argmin())])
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--n-a", type=int, default=8, help="set A: prompts 0..n_a-1 (tuning)")
    ap.add_argument("--skip-b", type=int, default=8, help="set B starts at this prompt")
    ap.add_argument("--n-b", type=int, default=16, help="set B size (reporting)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--temps", default="0.5,0.7,0.85,1.0,1.2,1.5,2.0")
    ap.add_argument("--slopes", default="-0.5,-0.25,0.25,0.5,1.0")
    ap.add_argument("--reference", type=Path,
                    default=Path("bench_results/2026-12-01-cpu-accept_traces-tiny-code.json"),
                    help="record_accept_traces output for set A, to check T=1 against")  # fmt: skip
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    t_start = time.perf_counter()
    llm = LLM("tiny-code", device="cpu", num_pages=1024, max_num_seqs=1,
              speculative_algorithm="DDTREE", speculative_ddtree_budget=64,
              speculative_adaptive=False)  # fmt: skip
    depth = llm.spec.depth
    n_all = max(args.n_a, args.skip_b + args.n_b)
    all_prompts = {"code": code_prompts(DATA / "tiny-code" / "heldout.json", n_all),
                   "prose": prose_prompts(PROSE, n_all)}  # fmt: skip
    sets = {"A": (0, args.n_a), "B": (args.skip_b, args.skip_b + args.n_b)}
    cache: dict[str, dict] = {}  # prompt string -> record (greedy: the same trace every time)
    recs: dict[str, dict[str, list[dict]]] = {}
    for s, (lo, hi) in sets.items():
        recs[s] = {}
        for text, prompts in all_prompts.items():
            recs[s][text] = []
            for prompt in prompts[lo:hi]:
                if prompt not in cache:
                    cache[prompt] = record(llm, prompt, args.tokens, 64)
                    r = cache[prompt]
                    print(f"{s} {text}: traced ({r['checked']} engine rounds checked, "
                          f"{r['mismatches']} mismatches) {time.perf_counter() - t_start:.0f}s",
                          flush=True)  # fmt: skip
                recs[s][text].append(cache[prompt])
    t_traced = time.perf_counter()
    unique = {s: {t: len({id(r) for r in v}) for t, v in d.items()} for s, d in recs.items()}

    def evaluate(temps: list[float]) -> tuple[dict, dict]:
        tt = torch.tensor(temps, dtype=torch.float32)
        memo: dict[int, list] = {}  # per record: its walks (records are shared across sets)
        out: dict = {"per_prompt": {}}
        for s in sets:
            out[s], out["per_prompt"][s] = {}, {}
            for text, rs in recs[s].items():
                paths = []
                for r in rs:
                    if id(r) not in memo:
                        memo[id(r)] = paths_at(r, tt)
                    paths += memo[id(r)]
                out[s][text] = mean_committed(paths)
                out["per_prompt"][s][text] = [mean_committed(memo[id(r)]) for r in rs]
        out["cut_check"] = check_cut(recs["A"]["code"][0], tt)
        return out, memo

    settings: dict[str, dict] = {}

    def run(name: str, temps: list[float]) -> None:
        t0 = time.perf_counter()
        res, memo = evaluate(temps)
        settings[name] = {"temps": [round(t, 6) for t in temps], **res}
        a = res["A"]
        print(f"{name}: A code {a['code']} prose {a['prose']} cut_check {res['cut_check']} "
              f"({time.perf_counter() - t0:.0f}s)", flush=True)  # fmt: skip
        if name == "T=1":  # the walks must be trace_prompt's own, and the recorded ones
            same = all(memo[id(r)] == r["paths"] for r in cache.values())
            settings[name]["equals_trace_prompt_paths"] = same

    for t in [float(x) for x in args.temps.split(",")]:
        run(f"T={t:g}", [t] * depth)
    singles = [k for k in settings if k.startswith("T=")]
    best_single = max(singles, key=lambda k: score(settings[k]["A"]))
    t0 = settings[best_single]["temps"][0]
    for s in [float(x) for x in args.slopes.split(",")]:
        run(f"T0={t0:g},s={s:g}", [t0 * (1 + s * k / (depth - 1)) for k in range(depth)])
    grid = [round(0.3 + 0.05 * i, 2) for i in range(55)]  # 0.30 .. 3.00
    fitted = fit_nll_temps(recs["A"]["code"] + recs["A"]["prose"], grid)
    run("fit_nll", fitted)
    schedules = [k for k in settings if k.startswith("T0=")]
    best_schedule = max(schedules, key=lambda k: score(settings[k]["A"]))
    best = max(settings, key=lambda k: score(settings[k]["A"]))

    ref = {}
    if args.reference.exists():
        rj = json.loads(args.reference.read_text())
        for text, items in rj["texts"].items():
            paths = [p for it in items for p in it["paths"]]
            ref[text] = mean_committed(paths)
        ref_paths_equal = {
            text: [p for it in items for p in it["paths"]]
            == [p for r in recs["A"][text] for p in r["paths"]]
            for text, items in rj["texts"].items()
        }
    cal = {s: {text: calibration(rs, torch.ones(depth)) for text, rs in recs[s].items()}
           for s in sets}  # fmt: skip
    best_t = torch.tensor(settings[best]["temps"])
    cal_best = {s: {text: calibration(rs, best_t) for text, rs in recs[s].items()} for s in sets}
    out = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": _git_commit(),
        "command": " ".join(sys.argv),
        "target": "tiny-code",
        "drafter": "tiny-code-dflash",
        "depth": depth,
        "tokens": args.tokens,
        "budgets": list(BUDGETS),
        "sets": {
            s: {"prompts": list(range(lo, hi)), "unique_prompts": unique[s]}
            for s, (lo, hi) in sets.items()
        },  # fmt: skip
        "metric": "mean committed tokens per round = mean len(path) over all positions",
        "settings": settings,
        "best_single_on_A": best_single,
        "best_schedule_on_A": best_schedule,
        "best_on_A": best,
        "selection": "max over settings of the mean over code/prose and budgets 8/16/32/64 on A",
        "reference_T1_set_A": {
            "file": str(args.reference),
            "mean_committed": ref,
            "paths_equal": ref_paths_equal if ref else None,
        },  # fmt: skip
        "engine_check_mismatches": sum(r["mismatches"] for r in cache.values()),
        "calibration_T1": cal,
        "calibration_best": {"setting": best, "table": cal_best},
        "seconds": {
            "trace": round(t_traced - t_start, 1),
            "sweep": round(time.perf_counter() - t_traced, 1),
        },  # fmt: skip
    }
    args.json.write_text(json.dumps(out, indent=1))
    print(
        f"best single {best_single}, best schedule {best_schedule}, best {best}; "
        f"trace {out['seconds']['trace']}s sweep {out['seconds']['sweep']}s",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
