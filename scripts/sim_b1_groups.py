"""Groups of single requests in turns (greedy code, then sampled text at the DFlash drafter's
T=1 accept length ~1.3), one adaptive controller throughout, at batch 1: each group as x plain
decoding, at the b=1 cost tables before and after the forty-eighth session's round glue and
one-kernel unpack (H100, bench_pair's calibrated medians: rounds ~8% cheaper, plain ~4%), with a
plain <-> rounds switch charged 0.4 or 0.8 ms. Asks whether cheaper rounds alone make the
controller probe more on sampled text (bench_pair b=1: 0.91-0.92x with them, 0.97x without).

    PYTHONPATH=src python scripts/sim_b1_groups.py ['{"knob": value}' ...]  (ControllerConfig)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_adaptive import controller, replay_batch, table, unpredictable  # noqa: E402
from sim_adaptive_suite import texts  # noqa: E402

from treeverify.engine.budget_controller import ControllerConfig, budget_buckets  # noqa: E402

# bench_results/2026-12-07-h100-6e3af31-pair_pick_{base,on}.json, the adaptive engine's
# calibrated b=1 step costs (seconds) with the glue and the unpack off / on
COSTS = {
    "off": {1: {0: 0.000137, 4: 0.000304, 8: 0.000302, 16: 0.000312, 32: 0.000405, 64: 0.000526}},
    "on": {1: {0: 0.000132, 4: 0.000266, 8: 0.000266, 16: 0.000281, 32: 0.000389, 64: 0.000487}},
}
TOKENS = 128


def main(argv: list[str]) -> int:
    all_texts = texts()
    seq = [("code", all_texts["set1 code"][:8], "greedy"),
           ("sampled1.3", unpredictable(TOKENS, 8, 0.3), "sampled"),
           ("code", all_texts["set3 code"][:8], "greedy"),
           ("sampled1.3", unpredictable(TOKENS, 16, 0.3)[8:], "sampled"),
           ("sampled1.3", unpredictable(TOKENS, 24, 0.3)[16:], "sampled")]  # fmt: skip
    for knobs in [{}, *(json.loads(a) for a in argv)]:
        cfg = ControllerConfig(**knobs)
        for name, costs in COSTS.items():
            model = table(costs)
            plain = [replay_batch(tr, TOKENS, model, 0, 1)["tokens_per_s"] for _, tr, _ in seq]
            for switch in (0.4e-3, 0.8e-3):
                ctl = controller(budget_buckets(64), costs, cfg)
                cells = []
                for i, (text, traces, cls) in enumerate(seq):
                    got = replay_batch(traces, TOKENS, model, ctl, 1, cls, switch, 1)
                    cells.append(f"{text} {got['tokens_per_s'] / plain[i]:.3f}")
                print(f"{knobs or 'defaults'} costs {name}, switch {switch * 1e3:.1f} ms: "
                      + " | ".join(cells))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
