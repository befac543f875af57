"""Does a plain decode step with a hole cost more on the GPU than the compact step? (GPU
machine; the forty-second session's open question: with TREEVERIFY_AHEAD_HOLES=1 the 1B shape's
staggered batch ran ~2.6% slower, ~100 us a step while a hole was present.)
Two engines (holes 0 and 1) run the same 8 greedy requests, the second finishing first, until
it has finished and two more steps ran: the holes engine's bucket-8 step then carries one hole,
the other engine's the compact batch of 7 and one padding row. Then, per engine, the captured
step launched ahead (engine/decode_ahead.py: forward, pick, advance) replayed alone, its median
device time (CUDA events; replaying it alone advances its positions, so this is a profile: the
engine is dropped after), and the same under torch.profiler by kernel.
Usage (repo root):
    PYTHONPATH=src python3 scripts/hole_step_cost.py [--model random:llama-1b] --json F"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from treeverify.bench.kernel import _git_commit, median_replay_seconds
from treeverify.engine.llm import LLM
from treeverify.engine.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_decode_gpu import _kernels, _table  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:llama-1b")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    prompts = [[(11 * i + 5 * j) % 900 + 3 for j in range(300 + 17 * i)] for i in range(8)]
    lens = [200, 12, 200, 200, 200, 200, 200, 200]
    rows = []
    for holes in ("0", "1"):
        os.environ["TREEVERIFY_AHEAD_HOLES"] = holes
        llm = LLM(args.model, device="cuda", num_pages=2048, max_num_seqs=8, cuda_graph_max_bs=8)
        seqs = [llm.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
                for p, n in zip(prompts, lens, strict=True)]  # fmt: skip
        while not seqs[1].is_finished:
            llm.step()
        for _ in range(2):
            llm.step()
        torch.cuda.synchronize()
        fl = llm.ahead.in_flight
        layout = None if fl is None else ["hole" if s is None else "live" for s in fl.seqs]
        graph = llm.ahead.steps[8][0]
        ms = median_replay_seconds(graph, 50) * 1e3
        kernels = _table(_kernels(graph, 20))
        rows.append({"holes": holes, "rows_in_flight": layout, "step_ms": round(ms, 4),
                     "holed_rows": llm.ahead.holed_rows, "kernels": kernels[:20]})  # fmt: skip
        print(f"holes={holes}: rows {layout}, step launched ahead {ms:.4f} ms a replay")
        for k in kernels[:10]:
            print(f"   {k['us_per_replay']:8.2f} us  x{k['per_replay']:<5} {k['name'][:90]}")
        del llm, seqs, graph
        torch.cuda.empty_cache()
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "commit": _git_commit(),
            "command": " ".join(sys.argv), "model": args.model}  # fmt: skip
    args.json.write_text(json.dumps(meta | {"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
