"""The adaptive controller replayed through bursts of slow host steps: on every recorded trace
set (scripts/sim_adaptive_suite.py's) and the synthetic unpredictable text, at the H100's step
costs (the controller calibrated on them, steady steps fed back), with and without bursts of
`length` steps at `factor` times the cost every `every` steps (every policy pays them; the
controller also observes them). Adaptive / best fixed budget per text (unpredictable: / plain),
so the controller's recovery from a burst is judged apart from the burst's own cost.

    PYTHONPATH=src python scripts/sim_bursts.py [--every 400] [--length 20] [--factor 8]
        [--json out.json]

Run with another checkout's src on PYTHONPATH to compare controllers (this script and
sim_adaptive.py from this one): the thirty-seventh session's before / after.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_adaptive import controller, replay, unpredictable  # noqa: E402
from sim_adaptive_suite import COSTS, RESULTS, SWITCH_SECONDS, TOKENS, TRACE_SETS  # noqa: E402

import treeverify  # noqa: E402
from treeverify.bench.kernel import _git_commit  # noqa: E402
from treeverify.engine.budget_controller import ControllerConfig, budget_buckets  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=int, default=400)
    ap.add_argument("--length", type=int, default=20)
    ap.add_argument("--factor", type=float, default=8.0)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    costs, switch = COSTS["h100"], SWITCH_SECONDS["h100"]
    buckets = budget_buckets(max(costs))
    texts = {}
    for name, file in TRACE_SETS.items():
        data = json.loads((RESULTS / file).read_text())["texts"]
        for text, traces in data.items():
            texts[f"{name} {text}"] = traces
    texts["unpredictable"] = unpredictable(TOKENS)
    src = str(Path(treeverify.__file__).parent)  # the checkout whose controller runs
    command = "scripts/sim_bursts.py " + " ".join(sys.argv[1:] if argv is None else argv)
    out = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "controller_commit": _git_commit(src), "command": command,
           "costs": costs, "switch_seconds": switch,
           "bursts": [a.every, a.length, a.factor], "rows": {}}  # fmt: skip
    for label, bursts in (("no bursts", None), ("bursts", (a.every, a.length, a.factor))):
        rows = {}
        for text, traces in texts.items():
            fixed = {b: replay(traces, TOKENS, costs, b, switch_seconds=switch, bursts=bursts)
                     for b in buckets}  # fmt: skip
            ctl = controller(buckets, dict(costs), ControllerConfig())
            got = replay(traces, TOKENS, costs, ctl, feedback=True, switch_seconds=switch,
                         bursts=bursts)  # fmt: skip
            best = max(r["tokens_per_s"] for r in fixed.values())
            ref = fixed[0]["tokens_per_s"] if text == "unpredictable" else best
            rows[text] = {"ratio": round(got["tokens_per_s"] / ref, 3),
                          "steps_by_budget": got["steps_by_budget"]}  # fmt: skip
        ratios = [r["ratio"] for t, r in rows.items() if t != "unpredictable"]
        summary = {"mean": round(sum(ratios) / len(ratios), 3), "min": min(ratios),
                   "unpredictable": rows["unpredictable"]["ratio"]}  # fmt: skip
        out["rows"][label] = {"texts": rows, "summary": summary}
        print(f"{label:10s} adaptive / best fixed: mean {summary['mean']}, min {summary['min']}; "
              f"unpredictable / plain {summary['unpredictable']}")  # fmt: skip
        for text, r in rows.items():
            print(f"    {text:18s} {r['ratio']:6.3f}  {r['steps_by_budget']}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
