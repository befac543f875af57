"""Plain decoding of a batch whose requests finish one by one (GPU machine): the case
TREEVERIFY_AHEAD_HOLES is for (engine/decode_ahead.py). `--batch` requests of held-out code, the
k-th generating `--min-tokens` + k * step tokens (so each finishes at its own step, as EOS does
in real traffic), greedy, plain engine, graphs on; two engines in one process built with the
switch 0 and 1 (it is read when an engine is built), timed in alternating passes after one
untimed warm-up each. Reports per engine the median wall per pass, tokens/s, and the steps
launched ahead and holes made, and the ratio holes / read-first.
Usage (repo root): PYTHONPATH=src python3 scripts/staggered_finish.py [--model tiny-code] \
    [--batch 8] [--passes 7] --json F"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from treeverify.bench.kernel import _git_commit
from treeverify.engine.llm import LLM
from treeverify.engine.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def prompts(n: int) -> list[str]:
    """Held-out code prompts (bench_pair's)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_pair import DATA, code_prompts

    return code_prompts(DATA / "tiny-code" / "heldout.json", n)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-code")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--min-tokens", type=int, default=24)
    ap.add_argument("--step", type=int, default=12)
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--first", choices=("0", "1"), default="0",
                    help="the engine built (and timed in each pass) first: two engines differ in "
                         "where their weights and pools live, so run both orders")  # fmt: skip
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (nothing overlaps there)")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    texts = prompts(args.batch)
    params = [SamplingParams(temperature=0, max_tokens=args.min_tokens + k * args.step,
                             ignore_eos=True) for k in range(args.batch)]  # fmt: skip
    engines = {}
    for holes in (args.first, "1" if args.first == "0" else "0"):
        os.environ["TREEVERIFY_AHEAD_HOLES"] = holes
        llm = LLM(args.model, device=args.device, num_pages=2048, max_num_seqs=args.batch,
                  cuda_graph_max_bs=args.batch, decode_lookahead=True)  # fmt: skip
        llm.generate(texts, params)  # warm-up
        engines[holes] = llm
    walls: dict[str, list[float]] = {h: [] for h in engines}
    outs = {}
    for _ in range(args.passes):
        for h, llm in engines.items():
            sync()
            t0 = time.perf_counter()
            outs[h] = [o.token_ids for o in llm.generate(texts, params)]
            sync()
            walls[h].append(time.perf_counter() - t0)
    tokens = sum(p.max_tokens for p in params)
    rows = []
    for h, llm in engines.items():
        wall = statistics.median(walls[h])
        info = llm.ahead.info if llm.ahead is not None else {}
        rows.append({"holes": h, "median_wall_ms": round(wall * 1e3, 3),
                     "tokens_per_s": round(tokens / wall, 1),
                     "walls_ms": [round(w * 1e3, 3) for w in walls[h]],
                     "ahead_used": info.get("ahead_used"), "holed_rows": info.get("holed_rows"),
                     "ahead_partial": info.get("ahead_partial")})  # fmt: skip
        print(f"holes={h}: {wall * 1e3:.3f} ms a pass (median of {args.passes}), "
              f"{tokens / wall:.0f} tok/s, steps ahead {info.get('ahead_used')}, "
              f"holes made {info.get('holed_rows')}")  # fmt: skip
    rows.sort(key=lambda r: r["holes"])
    ratio = rows[0]["median_wall_ms"] / rows[1]["median_wall_ms"]
    same = outs["0"] == outs["1"]
    print(f"holes / read first: {ratio:.3f}x; same tokens: {same}")
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name() if cuda else "cpu", "commit": _git_commit(),
            "command": " ".join(sys.argv), "model": args.model, "batch": args.batch,
            "max_tokens": [p.max_tokens for p in params], "built_first": args.first}  # fmt: skip
    args.json.write_text(json.dumps(meta | {"rows": rows, "speedup": round(ratio, 4),
                                            "same_tokens": same}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
