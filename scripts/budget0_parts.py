"""What a budget-0 step (speculation configured, the adaptive budget at plain decoding) costs
beyond plain decoding's, part by part, on the CPU with the target's forward a near no-op
(scripts/null_model.py: the host's work alone, as a GPU's plain step is host-bound).

Rows: plain decoding; the DFlash engine at budget 0; the same with the controller's decision
replaced by a constant 0; and with the drafter's feed (the hidden rows handed to its context)
off too; the n-gram engine at budget 0, and with the constant decision. Each row is the best of
`--passes` generations (the least disturbed), in us per step. The cost table is given (budget 0
always wins), so only plain steps run but for the controller's probes (a probe's round costs
milliseconds on the CPU: the engine rows carry them). A last row times the controller's
decision alone at plain decoding, on the same given costs (no engine, no probes' rounds).

    PYTHONPATH=src python3 scripts/budget0_parts.py [--batch 1] [--temperature 0] --json P.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from null_model import make_null  # noqa: E402
from raw_json import write_rows  # noqa: E402

from treeverify.engine.llm import LLM  # noqa: E402
from treeverify.engine.sampling_params import SamplingParams  # noqa: E402

COSTS = {0: 1e-4, 4: 1.0, 8: 1.0, 16: 1.0}  # budget 0 always wins


def constant_choice(llm: LLM) -> None:
    llm.controller.choose = lambda ids, path="fast": 0


def no_feed(llm: LLM) -> None:
    constant_choice(llm)
    llm._observe_ahead = lambda chunks, hidden: None


def choose_alone(batch: int, decisions: int = 20000) -> float:
    """us per `choose` of a controller at plain decoding (costs as above, nothing accepted),
    its probes' rounds observed as accepting nothing, best of 3."""
    from treeverify.engine.budget_controller import BudgetController, budget_buckets
    from treeverify.engine.budget_costs import CostModel

    ids = [f"r{i}" for i in range(batch)]
    best = float("inf")
    for _ in range(3):
        ctl = BudgetController(budget_buckets(64), CostModel.given({**COSTS, 32: 1.0, 64: 1.0}))
        for k in range(decisions + 50):
            if k == 50:  # settled at plain decoding
                t0 = time.perf_counter()
            b = ctl.choose(ids)
            if b:
                for rid in ids:
                    ctl.observe_round(rid, b, [0])
        best = min(best, time.perf_counter() - t0)
    return round(best / decisions * 1e6, 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-code")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    sp = SamplingParams(temperature=a.temperature, max_tokens=a.tokens, ignore_eos=True, seed=0)
    prompts = [f"def f{i}(x):\n    return x + {i}\n" for i in range(a.batch)]
    spec = dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=16,
                speculative_adaptive=True, speculative_cost_seconds=COSTS)  # fmt: skip
    ngram = {**spec, "speculative_draft_model_path": "ngram"}
    configs = [
        ("plain", {}, None),
        ("DFlash, budget 0", spec, None),
        ("DFlash, budget 0, decision a constant", spec, constant_choice),
        ("DFlash, budget 0, decision a constant, no feed", spec, no_feed),
        ("n-gram, budget 0", ngram, None),
        ("n-gram, budget 0, decision a constant", ngram, constant_choice),
    ]
    rows = []
    for name, kw, patch in configs:
        llm = LLM(a.model, device="cpu", num_pages=512, max_num_seqs=a.batch,
                  decode_lookahead=True, **kw)  # fmt: skip
        make_null(llm)
        if patch is not None:
            patch(llm)
        llm.generate(prompts, sp)  # warm
        best = float("inf")
        for _ in range(a.passes):
            t0 = time.perf_counter()
            llm.generate(prompts, sp)
            best = min(best, time.perf_counter() - t0)
        us = best / a.tokens * 1e6
        rows.append({"config": name, "us_per_step": round(us, 1), "batch": a.batch,
                     "temperature": a.temperature})  # fmt: skip
        print(f"{name:48s} {us:7.1f} us/step", flush=True)
    us = choose_alone(a.batch)
    rows.append({"config": "controller.choose alone, at plain decoding", "us_per_step": us,
                 "batch": a.batch})  # fmt: skip
    print(f"{'controller.choose alone, at plain decoding':48s} {us:7.1f} us/step")
    if a.json:
        write_rows(a.json, "budget0_parts.py", argv, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
