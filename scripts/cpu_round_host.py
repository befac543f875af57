"""Host time of a DDTREE round on the CPU, greedy vs sampled (T=1), on the general path and as a
whole round (engine/round_graphs.py's eager body), with the target's forward replaced by a
near no-op (scripts/null_model.py): what is left is the host's part and the drafter's forward.
tiny-code + its DFlash drafter, fixed budget 16, best of 3 passes of 20 steps.

    PYTHONPATH=src python3 scripts/cpu_round_host.py [--batch 8] --json P.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pair import PROSE, prose_prompts  # noqa: E402
from null_model import make_null  # noqa: E402
from raw_json import write_rows  # noqa: E402

from treeverify.engine.llm import LLM  # noqa: E402
from treeverify.engine.sampling_params import SamplingParams  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    b, rows = args.batch, []
    for general in (True, False):
        for temp in (0.0, 1.0):
            llm = LLM("tiny-code", device="cpu", num_pages=2048, max_num_seqs=b,
                      speculative_algorithm="DDTREE", speculative_ddtree_budget=16,
                      speculative_adaptive=False, disable_round_graphs=general)  # fmt: skip
            make_null(llm)
            for p in prose_prompts(PROSE, b):
                llm.add_request(p, SamplingParams(temperature=temp, max_tokens=800,
                                                  ignore_eos=True, seed=1))  # fmt: skip
            for _ in range(5):  # past the prefill and the first rounds
                llm.step()
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                for _ in range(20):
                    llm.step()
                best = min(best, (time.perf_counter() - t0) / 20)
            path = "general" if general else "whole"
            rows.append({"batch": b, "path": path, "temperature": temp,
                         "ms_per_round": round(best * 1e3, 2)})  # fmt: skip
            print(f"b={b} {path:8s} T={temp}: {best * 1e3:.2f} ms a round", flush=True)
    write_rows(args.json, "cpu_round_host.py", None, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
