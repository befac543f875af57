"""The GPU machine's one-call scripts (scripts/gpu-*, ncu-cases, device-wheels) cannot run in CI,
so CI checks what it can: each parses as bash (`bash -n`) and documents its usage. A syntax
error found on the GPU machine costs a lease's start-up and a call of device time."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
BASH = sorted(
    p for p in SCRIPTS.iterdir() if p.is_file() and p.read_text().startswith("#!/usr/bin/env bash")
)


def test_the_gpu_scripts_are_found():
    names = {p.name for p in BASH}
    assert {"gpu-check", "gpu-round", "gpu-engine", "gpu-sglang", "ncu-cases"} <= names


@pytest.mark.parametrize("script", BASH, ids=[p.name for p in BASH])
def test_script_parses_and_documents_its_usage(script: Path):
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    header = script.read_text().split("\nset ", 1)[0]  # the comment block before `set -uo ...`
    assert "Usage" in header, f"{script.name}: no Usage line in its header"
