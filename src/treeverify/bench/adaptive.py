"""Adaptive vs fixed tree budgets vs plain decoding, end to end, on any device (the CPU included).

Per workload (a prompt and a temperature) and configuration (plain; DDTREE at each fixed budget;
DDTREE adaptive up to the largest), tokens/s of one request's generation after a warm-up request,
with the adaptive controller's budgets and the accept length. Greedy outputs are compared to the
plain run's. Used by scripts/bench_adaptive.py (docs/performance.md, "Adaptive budget").
"""

from __future__ import annotations

import time

from treeverify.engine.budget_controller import CLOCKS
from treeverify.engine.llm import LLM
from treeverify.engine.sampling_params import SamplingParams

WORKLOADS = {
    "code": ('def merge_sorted(a, b):\n    """Merge two sorted lists."""\n    out = []\n', 0.0),
    "prose": ("The old lighthouse keeper had not spoken to anyone in weeks. One morning,", 0.0),
    "list": (
        "Colors: red, green, blue, yellow, red, green, blue, yellow, red, green, blue, "
        "yellow, red, green,",
        0.0,
    ),  # fmt: skip
    "prose-sampled": ("Tell me a story about a fox who learned to sail.", 1.0),
}


def _configs(budgets: tuple[int, ...]) -> list[tuple[str, dict]]:
    out = [("plain", {})]
    for b in budgets:
        out.append((f"fixed-{b}", dict(speculative_algorithm="DDTREE",
                                       speculative_ddtree_budget=b,
                                       speculative_adaptive=False)))  # fmt: skip
    out.append(("adaptive", dict(speculative_algorithm="DDTREE",
                                 speculative_ddtree_budget=max(budgets))))  # fmt: skip
    return out


def adaptive_vs_fixed(
    model: str,
    *,
    workloads: list[str] | None = None,
    max_tokens: int = 48,
    budgets: tuple[int, ...] = (4, 8, 16),
    depth: int = 4,
    device: str = "cpu",
    chat: bool = False,
    repeat: int = 2,
    clock: str = "wall",
) -> list[dict]:
    """Rows per (workload, configuration). Per workload the controller starts cold (acceptance
    forgotten, costs kept) and serves the same request `repeat` times: `cold_tokens_per_s` is
    the first run, `tokens_per_s` the best later (warm) run, as in serving, where a request
    starts from the engine-wide curve (a shared machine's noise only ever slows a run down).
    `chat`: wrap prompts in the model's chat template.
    `clock` "process": CPU seconds of this process time the runs and the controller's costs
    (a CPU shared with other work; run with one torch thread); wall seconds are kept too."""
    tick = CLOCKS[clock]
    rows = []
    for name, kw in _configs(budgets):
        if kw:
            kw = dict(kw, speculative_num_draft_tokens=depth, speculative_cost_clock=clock)
        t0 = time.perf_counter()
        llm = LLM(model, device=device, num_pages=256, **kw)
        startup = time.perf_counter() - t0
        for wl in workloads or list(WORKLOADS):
            text, temp = WORKLOADS[wl]
            if chat:
                text = llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])
            sp = SamplingParams(temperature=temp, max_tokens=max_tokens, ignore_eos=True, seed=7)
            llm.generate([text], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
            llm.reset_stats(forget_acceptance=True)  # cold: the cost curve kept
            runs = []  # (clock seconds, wall seconds) per run: the first cold, the rest warm
            for _ in range(repeat):
                llm.reset_stats()  # counters (and steps per budget) of this run only
                t0, w0 = tick(), time.perf_counter()
                out = llm.generate([text], sp)[0]
                runs.append((tick() - t0, time.perf_counter() - w0))
            secs, wall = min(runs[1:] or runs)
            n = len(out.token_ids)
            row = {"model": model, "workload": wl, "config": name, "temperature": temp,
                   "tokens": n, "clock": clock, "seconds": round(secs, 3),
                   "wall_seconds": round(wall, 3), "tokens_per_s": round(n / secs, 3),
                   "cold_tokens_per_s": round(n / runs[0][0], 3),
                   "startup_seconds": round(startup, 2), "token_ids": out.token_ids}  # fmt: skip
            st = llm.spec_stats
            if st is not None:  # the last run's
                row["avg_accept_length"] = st["avg_spec_accept_length"]
                row["rounds"] = st["rounds"]
                if st["adaptive"] is not None:
                    row["steps_by_budget"] = dict(st["adaptive"]["steps_by_budget"])
                    row["cost_seconds_batch1"] = st["adaptive"]["cost_seconds_batch1"]
            rows.append(row)
            print(f"[bench adaptive] {model} {wl} {name}: {row['tokens_per_s']} tok/s",
                  flush=True)  # fmt: skip
        del llm
    _compare(rows)
    return rows


def _compare(rows: list[dict]) -> None:
    """Speed ratios to plain and to the best fixed budget; greedy identity to plain."""
    for wl in {r["workload"] for r in rows}:
        group = [r for r in rows if r["workload"] == wl]
        plain = next(r for r in group if r["config"] == "plain")
        fixed = [r for r in group if r["config"].startswith("fixed-")]
        best = max(fixed, key=lambda r: r["tokens_per_s"]) if fixed else None
        for r in group:
            r["vs_plain"] = round(r["tokens_per_s"] / plain["tokens_per_s"], 3)
            if best is not None:
                r["vs_best_fixed"] = round(r["tokens_per_s"] / best["tokens_per_s"], 3)
            if plain["temperature"] == 0:
                r["identical_to_plain"] = r["token_ids"] == plain["token_ids"]
    for r in rows:
        r.pop("token_ids")
