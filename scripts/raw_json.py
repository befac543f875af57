"""The raw JSON a GPU script leaves under bench_results/: date, device, commit, command, rows."""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from treeverify.bench.kernel import _git_commit


def write_rows(path: Path, script: str, argv: list[str] | None, rows: list[dict]) -> None:
    """`rows` with the date, the device, the commit and the command that ran (`script` and its
    arguments: argv, else the process's)."""
    path.write_text(json.dumps({
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "commit": _git_commit(),
        "command": f"scripts/{script} " + " ".join(argv or sys.argv[1:]),
        "rows": rows}, indent=1))  # fmt: skip
