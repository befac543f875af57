"""How long a full garbage collection takes over an engine's startup objects, before and after
`gc.freeze()` (what `treeverify serve` does once the engine is built: server/main.py).

    PYTHONPATH=src python3 scripts/gc_pause.py [--model tiny-code] --json P.json
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from raw_json import write_rows  # noqa: E402

from treeverify.engine.llm import LLM  # noqa: E402


def full_collection_ms() -> float:
    t0 = time.perf_counter()
    gc.collect(2)
    return round((time.perf_counter() - t0) * 1e3, 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-code")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    llm = LLM(a.model, device="cpu", num_pages=512, max_num_seqs=8,
              speculative_algorithm="DDTREE", speculative_ddtree_budget=16)  # fmt: skip
    rows = [{"config": "not frozen", "tracked_objects": len(gc.get_objects()),
             "full_collection_ms": [full_collection_ms() for _ in range(3)]}]  # fmt: skip
    gc.freeze()
    rows.append({"config": "frozen", "tracked_objects": len(gc.get_objects()),
                 "frozen_objects": gc.get_freeze_count(),
                 "full_collection_ms": [full_collection_ms() for _ in range(3)]})  # fmt: skip
    for r in rows:
        print(r)
    del llm
    if a.json:
        write_rows(a.json, "gc_pause.py", argv, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
