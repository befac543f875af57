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


def test_cta_trace_phase_table_recovers_a_known_tile_cost(capsys):
    """scripts/cta_trace.py's analysis on trace rows shaped like the kernel's (16 words a CTA,
    SGLang's harness grid unbalanced: x = row block, z = request x KV head): each CTA's tiles
    follow the device's split rule and kv_stop (a row block's keys end at its last node), and a
    tile loop made to cost 1.0 us + 1.3 us a tile is read back as such, with the fixed phases'
    medians."""
    import argparse
    import importlib.util
    import types

    from treeverify.kernels.splits import SplitPolicy

    spec = importlib.util.spec_from_file_location("cta_trace", SCRIPTS / "cta_trace.py")
    ct = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ct)
    prefix = [1000, 300]  # request 0: 1064 keys (17 tiles), request 1: 364 (6)
    plan = types.SimpleNamespace(
        _launcher=types.SimpleNamespace(persist=False, splits=SplitPolicy(1, 64))
    )
    t0 = 10**12  # ns
    rows = []
    for b in range(len(prefix)):
        for head in range(ct.HKV):
            for x in range(2):
                c = {"x": x, "request": b, "split": 0}
                tiles = ct.cta_tiles(c, prefix, plan)
                assert tiles == (17 if b == 0 else 6)  # (P + node_hi) / 64, rounded up
                start = t0 + 1000 * (head % 3)  # starts spread over 2 us
                landed = start + 6000
                done = landed + 1000 + 1300 * tiles
                marks = [0] * (ct.WORDS - 4)  # words 4.. of the kernel's trace
                marks[4 - 4], marks[5 - 4], marks[6 - 4] = start + 5000, landed, done
                marks[7 - 4], marks[14 - 4] = done + 2000, start + 5500
                for w in (8, 9, 10, 11, 12, 13):
                    marks[w - 4] = start + 100 * w
                idx = x | (b * ct.HKV + head) << 40
                rows.append([start, done + 2700, 7, idx, *marks])
    args = argparse.Namespace(page=16, balance=1, define=[], seed=2026)
    result = ct.analyse(rows, prefix, (2, 1, len(prefix) * ct.HKV), args, 0.0, plan)
    out = capsys.readouterr().out
    assert "tile loop: 1.00 us + 1.300 us a tile (6-17 tiles)" in out
    assert "tile 0 issued 5.00, consumer regs 1.30, Q landed 5.50, tile 0 landed 6.00" in out
    assert "start -> tile 0 landed 6.00 us, stores 2.00 us, after them 0.70 us" in out
    assert len(result["ctas"]) == 2 * ct.HKV * len(prefix)
    assert max(c["end_us"] for c in result["ctas"]) == result["span_us"]


def test_engine_flag_table_compares_each_value_with_the_baseline(tmp_path):
    """scripts/engine_flag_table.py (engine_flag_ab's table): per row (engine step, captured
    forward, verify forward) each value's best time over the passes and its ratio to the first
    value's; rows missing in a value show '-'; no
    baseline files is an error naming the directory."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("eft", SCRIPTS / "engine_flag_table.py")
    eft = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(eft)
    rows = {0: (2.10, 2.04, 2.30), 1: (1.72, 1.75, None)}  # decode passes 1, 2; verify
    for i, (d1, d2, v) in rows.items():
        for p, d in ((1, d1), (2, d2)):
            verify = [] if v is None else [
                {"model": "m", "batch": 1, "budget": 16, "verify_forward_ms": v}]  # fmt: skip
            decode = [{"model": "m", "batch": 1, "step_ms": d, "forward_ms": d - 0.1}]
            data = {"decode": decode, "verify": verify}
            (tmp_path / f"engine_v{i}_pass{p}.json").write_text(json.dumps(data))
    lines = eft.table(str(tmp_path), ["A=0", "A=1"])
    assert lines[0] == "row | A=0 | A=1"
    assert "decode m 1 | 2.040 ms | 1.720 ms (x1.186)" in lines
    assert "decode forward m 1 | 1.940 ms | 1.620 ms (x1.198)" in lines  # the captured forward
    assert "verify m 1 16 | 2.300 ms | -" in lines
    with pytest.raises(ValueError, match="out_dir"):
        eft.table(str(tmp_path / "none"), ["A=0"])


def test_plain_step_host_times_each_call_of_a_plain_step(tmp_path):
    """scripts/plain_step_host.py on the CPU engine (--cpu; its GPU run times launches and
    waits too): plain decoding and the adaptive engine held at 0 each time their steps, every
    wrapped call's time within the step's, the controller's calls only in the adaptive one, and
    the wrappers taken off again (the engine steps unwrapped afterwards)."""
    import json
    import os
    import sys

    out = tmp_path / "psh.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "plain_step_host.py"), "--cpu", "--steps", "3",
         "--warm", "2", "--configs", "none code T=0,adaptive@0 code T=0", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
        env=os.environ | {"PYTHONPATH": str(SCRIPTS.parent / "src")},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"none code T=0", "adaptive@0 code T=0"}
    for name, r in rows.items():
        calls = {c["call"]: c for c in r["calls"]}
        step = calls["step (all)"]["us_per_step"]
        assert r["wall_us_per_step"] > 0 and step > 0
        assert calls["step (all)"]["calls_per_step"] == 1.0
        assert all(c["us_per_step"] <= step for c in r["calls"]), name
        has_controller = any(k.startswith("controller.") for k in calls)
        assert has_controller == name.startswith("adaptive"), (name, sorted(calls))
    assert set(rows["adaptive@0 code T=0"]["steps_by_budget"]) == {"0"}  # held at plain
