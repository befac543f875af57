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


def test_ncu_top_ranks_sass_lines_by_samples(tmp_path):
    """scripts/ncu_top.py on a table shaped like ncu's source page: the lines by share of all
    samples, each with its two main stall reasons (zero reasons left out)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ncu_top", SCRIPTS / "ncu_top.py")
    ncu_top = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ncu_top)
    table = tmp_path / "sass.csv"
    table.write_text(
        '"Kernel Name","void k(Params)",\n'
        '"Address","Source","Warp Stall Sampling (All Samples)","stall_barrier",'
        '"stall_long_sb","stall_math","stall_barrier (Not Issued)"\n'
        '"0x10","BAR.SYNC 0x1","30","28","0","2","28"\n'
        '"0x20","@!P0 BRA 0x10","60","0","55","5","0"\n'
        '"0x30","FFMA R1, R2, R3, R4","10","0","0","0","0"\n'
        '"0x40","NOP","","","","",""\n'
    )
    lines = ncu_top.top_lines(table, top=3)
    assert [addr for addr, *_ in lines] == ["0x20", "0x10", "0x30"]
    assert [round(share, 2) for _, share, *_ in lines] == [0.6, 0.3, 0.1]
    assert lines[0][3] == ["long_sb", "math"] and lines[1][3] == ["barrier", "math"]
    assert lines[2][3] == []
