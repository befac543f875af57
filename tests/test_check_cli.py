"""The command line: `treeverify check` end to end, its comparison, the subcommand registry, env."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from treeverify import check, cli, env

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "treeverify", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": path},
        cwd=ROOT,
    )


def test_check_quick_subprocess(tmp_path):
    report = tmp_path / "check.json"
    proc = run_cli("check", "--quick", "--backend", "torch", "--json", str(report))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:2] == ["case", "backend"] and "rel err" in lines[0]
    rows = [line for line in lines[2:] if line.rstrip().endswith(("ok", "FAIL"))]
    assert len(rows) == 5 and all(row.rstrip().endswith("ok") for row in rows)
    assert any("tree1025" in row for row in rows) and any("mla" in row for row in rows)
    assert lines[-1] == "all 5 cases passed"
    record = json.loads(report.read_text())
    assert record["passed"] and record["backend"] == "torch" and len(record["cases"]) == 5
    assert all(c["bad"] == 0 and c["returned_out"] for c in record["cases"])


def test_version_and_help():
    proc = run_cli("version")
    assert proc.returncode == 0 and proc.stdout.startswith("treeverify ")
    proc = run_cli("--help")
    assert proc.returncode == 0 and "check" in proc.stdout and "version" in proc.stdout


def test_no_command_prints_help():
    assert cli.main([]) == 2


# ---------------------------------------------------------------- the comparison


def reference_and_inputs(dtype=torch.bfloat16):
    inp = check.make_inputs(check.cases(True, "cpu")[0], dtype, "cpu", 3)
    return inp, check.dense_float64(inp)


def test_compare_accepts_correct_output():
    _, ref = reference_and_inputs()
    result = check.compare(ref.to(torch.bfloat16), ref, torch.bfloat16)
    assert result.passed and result.bad == 0 and result.rel_err < 5e-3


def test_compare_rejects_wrong_output():
    _, ref = reference_and_inputs()
    wrong = ref.clone()
    wrong[3, 1] *= 1.02  # one (row, head) vector 2% off
    result = check.compare(wrong.to(torch.bfloat16), ref, torch.bfloat16)
    assert result.rel_err < 5e-3  # too small to show overall ...
    assert result.row_err > 1e-2 and not result.passed  # ... caught per row


def test_compare_rejects_unwritten_output():
    _, ref = reference_and_inputs()
    out = ref.to(torch.bfloat16)
    out[-1, :, 7] = math.nan  # one column never written over the poison
    result = check.compare(out, ref, torch.bfloat16)
    assert result.bad == out.shape[1] and not result.passed


def test_compare_rejects_a_wrong_tree():
    """Attention where one deep node sees only the root and itself must fail the check."""
    inp, ref = reference_and_inputs(torch.float32)
    mask = inp["tree_mask"].clone()
    depth = [sum(bin(w & 0xFFFFFFFF).count("1") for w in row) for row in mask.tolist()]
    row = max(range(17, mask.shape[0]), key=lambda r: depth[r])  # request 2 starts at row 17
    assert depth[row] >= 3
    bits = np.zeros(64, dtype=bool)
    bits[[0, row - 17]] = True  # the root and itself only
    mask[row] = torch.from_numpy(np.packbits(bits, bitorder="little").view("<u4").view(np.int32))
    wrong = check.dense_float64(dict(inp, tree_mask=mask)).float()
    assert not check.compare(wrong, ref, torch.float32).passed


def test_broken_backend_makes_check_exit_1(monkeypatch, capsys):
    def broken(*args, out, **kwargs):
        out.zero_()
        return out

    monkeypatch.setattr(check.api, "tree_attention", broken)
    args = argparse.Namespace(
        backend="torch", device="cpu", dtype="bf16", seed=0, quick=True, json=None
    )
    assert check.run(args) == 1
    output = capsys.readouterr().out
    assert "FAIL" in output and "5 of 5 cases FAILED" in output


def test_unavailable_device_exits_2(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device exists here")
    args = argparse.Namespace(
        backend="torch", device="cuda", dtype="bf16", seed=0, quick=True, json=None
    )
    assert check.run(args) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_check_triton_backend_on_the_cpu_interpreter(tmp_path):
    """`treeverify check --backend triton --device cpu` runs Triton's interpreter, in its own
    process (TRITON_INTERPRET must be set before triton loads the kernels)."""
    pytest.importorskip("triton")
    proc = run_cli("check", "--backend", "triton", "--device", "cpu", "--dtype", "fp16",
                   "--quick", "--json", str(tmp_path / "t.json"), timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all 5 cases passed" in proc.stdout


def test_cases_cover_the_grid():
    full = check.cases(False, "cpu")
    assert {c.page_size for c in full} == {1, 16, 64}
    assert any(0 in c.prefix_lens for c in full)
    assert max(max(c.tree_sizes) for c in full) == 1025
    assert {c.mla for c in full} == {True, False}
    assert any(c.hq == c.hkv for c in full) and any(c.hq > c.hkv > 1 for c in full)
    assert len({c.name for c in full}) == len(full)


# ---------------------------------------------------------------- subcommand registry


def test_missing_command_module_is_left_out(monkeypatch):
    monkeypatch.setattr(cli, "COMMANDS", [("ghost", "treeverify.no_such_module.cli")])
    assert "ghost" not in cli.build_parser().format_help()


def test_command_with_missing_dependency_says_so(monkeypatch, tmp_path, capsys):
    (tmp_path / "tv_fake_cmd.py").write_text("import tv_dependency_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "COMMANDS", [("fake", "tv_fake_cmd")])
    assert "unavailable" in cli.build_parser().format_help()
    assert cli.main(["fake"]) == 2
    assert "tv_dependency_not_installed" in capsys.readouterr().err


def test_registered_command_runs(monkeypatch, tmp_path, capsys):
    (tmp_path / "tv_echo_cmd.py").write_text(
        "def add_parser(sub):\n"
        "    p = sub.add_parser('echo')\n"
        "    p.add_argument('word')\n"
        "    return p\n"
        "def run(args):\n"
        "    print(args.word)\n"
        "    return 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "COMMANDS", [("echo", "tv_echo_cmd")])
    assert cli.main(["echo", "hi"]) == 3
    assert capsys.readouterr().out == "hi\n"


# ---------------------------------------------------------------- environment


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("TREEVERIFY_CACHE_DIR", raising=False)
    assert env.cache_dir() == Path.home() / ".cache" / "treeverify"
    monkeypatch.setenv("TREEVERIFY_CACHE_DIR", str(tmp_path))
    assert env.cache_dir() == tmp_path


def test_log_level(monkeypatch):
    monkeypatch.delenv("TREEVERIFY_LOG_LEVEL", raising=False)
    assert env.log_level() == logging.WARNING
    monkeypatch.setenv("TREEVERIFY_LOG_LEVEL", "debug")
    assert env.log_level() == logging.DEBUG
    monkeypatch.setenv("TREEVERIFY_LOG_LEVEL", "15")
    assert env.log_level() == 15
    monkeypatch.setenv("TREEVERIFY_LOG_LEVEL", "chatty")
    with pytest.raises(ValueError, match="TREEVERIFY_LOG_LEVEL"):
        env.log_level()
    assert cli.main(["version"]) == 2  # said once, without a traceback


def test_cuda_home(monkeypatch, tmp_path):
    monkeypatch.delenv("CUDA_HOME", raising=False)
    assert env.cuda_home() is None
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert env.cuda_home() == tmp_path
    assert set(env.VARIABLES) == {
        "TREEVERIFY_CACHE_DIR",
        "TREEVERIFY_LOG_LEVEL",
        "CUDA_HOME",
        "TREEVERIFY_CUDA_PORTABLE",
        "TREEVERIFY_COMMIT",
        "NOTIFY_SOCKET",
        "TREEVERIFY_TEST_HOOKS",
        "TREEVERIFY_FAULT",
        "TREEVERIFY_API_KEY",
        "TREEVERIFY_SGLANG_FALLBACK",
        "TREEVERIFY_SGLANG_KERNEL",
        "TREEVERIFY_CUDA_SPLIT_MERGE",
        "TREEVERIFY_CUDA_SPLIT_BALANCE",
        "TREEVERIFY_CUDA_SPLIT_ORDER",
        "TREEVERIFY_CUDA_PDL",
        "TREEVERIFY_DECODE_GEMV_PDL",
        "TREEVERIFY_SKINNY_GEMM",
        "TREEVERIFY_SKINNY_MAX_ROWS",
        "TREEVERIFY_CUDA_MAX_SPLITS",
        "TREEVERIFY_CUDA_SPLIT_SHARE",
        "TREEVERIFY_DECODE_GEMV",
        "TREEVERIFY_ROPE_TABLE",
        "TREEVERIFY_FUSED_ACCEPT",
        "TREEVERIFY_DDTREE_WARP_HEAP",
        "TREEVERIFY_FUSED_SILU_DOWN",
        "TREEVERIFY_MOE_GEMV_SHARED",
        "TREEVERIFY_TRITON_PDL",
        "TREEVERIFY_DECODE_LOOKAHEAD",
        "TREEVERIFY_FUSED_DECODE_STEP",
        "TREEVERIFY_FEED_RING",
        "TREEVERIFY_RING_IN_GRAPH",
        "TREEVERIFY_STAGE_UNPACK",
        "TREEVERIFY_NORM_LINEAR",
        "TREEVERIFY_DDTREE_WARP_TOPK",
        "TREEVERIFY_ROUND_GLUE",
        "TREEVERIFY_RING_PROJECTION",
        "TREEVERIFY_AHEAD_HOLES",
        "TREEVERIFY_CONTEXT_LAZY",
        "TREEVERIFY_MAPPED_READBACK",
        "TREEVERIFY_COST_WHOLE_STEP",
        "TREEVERIFY_CALIBRATE_RUN_BATCH",
        "TREEVERIFY_PREFILL_REPLAYS",
        "TREEVERIFY_CUDA_MERGE_MAX_CTAS",
        "TREEVERIFY_CUDA_GQA_SCHEDULE",
        "TREEVERIFY_CUDA_TMA_MIN_PAGE",
        "TREEVERIFY_CUDA_GQA_Q_REGS",
        "TREEVERIFY_CUDA_GQA_256",
        "TREEVERIFY_CUDA_MERGE_ILP",
        "TREEVERIFY_CUDA_MERGE_WIDE",
        "TREEVERIFY_CUDA_FUSED_MERGE_ILP",
        "TREEVERIFY_CUDA_MERGE_SPLIT_LANES",
        "TREEVERIFY_CUDA_MLA_SCHEDULE",
        "TREEVERIFY_FUSED_ROUTING",
        "TREEVERIFY_FUSED_MLA_ROPE",
        "TREEVERIFY_FUSED_MOE_DISPATCH",
        "TREEVERIFY_MOE_GEMV",
        "TREEVERIFY_MOE_GEMV_TILE",
    }


def test_cuda_split_merge_mode(monkeypatch):
    """TREEVERIFY_CUDA_SPLIT_MERGE: auto unless set; an unknown mode is an error naming it."""
    from treeverify.kernels.splits import fused_merge_limit

    monkeypatch.delenv("TREEVERIFY_CUDA_SPLIT_MERGE", raising=False)
    assert env.cuda_split_merge() == "auto"
    monkeypatch.setenv("TREEVERIFY_CUDA_SPLIT_MERGE", " Kernel ")
    assert env.cuda_split_merge() == "kernel" and fused_merge_limit(env.cuda_split_merge()) == 0
    monkeypatch.setenv("TREEVERIFY_CUDA_SPLIT_MERGE", "fused")
    with pytest.raises(ValueError, match="TREEVERIFY_CUDA_SPLIT_MERGE"):
        fused_merge_limit(env.cuda_split_merge())


def test_cuda_split_balance(monkeypatch):
    """TREEVERIFY_CUDA_SPLIT_BALANCE: the caller's default unless set (2); out of range is an
    error naming it."""
    monkeypatch.delenv("TREEVERIFY_CUDA_SPLIT_BALANCE", raising=False)
    assert env.cuda_split_balance() == 2 and env.cuda_split_balance(default=1) == 1
    monkeypatch.setenv("TREEVERIFY_CUDA_SPLIT_BALANCE", "2")
    assert env.cuda_split_balance(default=1) == 2
    for bad in ("0", "9", "two"):
        monkeypatch.setenv("TREEVERIFY_CUDA_SPLIT_BALANCE", bad)
        with pytest.raises(ValueError, match="TREEVERIFY_CUDA_SPLIT_BALANCE"):
            env.cuda_split_balance()


@pytest.mark.parametrize(
    "name,reader,default,value,expected",
    [
        ("TREEVERIFY_CUDA_MERGE_MAX_CTAS", env.cuda_merge_max_ctas, None, " 2048", 2048),
        ("TREEVERIFY_CUDA_GQA_SCHEDULE", env.cuda_gqa_schedule, "pingpong-auto", " Tile", "tile"),
        ("TREEVERIFY_CUDA_PDL", env.cuda_pdl, "auto", "yes", "1"),
        ("TREEVERIFY_CUDA_TMA_MIN_PAGE", env.cuda_tma_min_page, 8, " 16", 16),
        ("TREEVERIFY_CUDA_GQA_256", env.cuda_gqa_256, "auto", " 0", "0"),
        ("TREEVERIFY_CUDA_SPLIT_ORDER", env.cuda_split_order, "longest", "Request", "request"),
        ("TREEVERIFY_CUDA_FUSED_MERGE_ILP", env.cuda_fused_merge_ilp, True, " 0", False),
        ("TREEVERIFY_CUDA_MERGE_WIDE", env.cuda_merge_wide, False, "yes", True),
        ("TREEVERIFY_CUDA_MERGE_SPLIT_LANES", env.cuda_merge_split_lanes, "auto", " 0", "0"),
        ("TREEVERIFY_FUSED_MLA_ROPE", env.fused_mla_rope, True, " 0", False),
        ("TREEVERIFY_FUSED_MOE_DISPATCH", env.fused_moe_dispatch, "auto", "yes", "1"),
        ("TREEVERIFY_MOE_GEMV", env.moe_gemv, "auto", " 0", "0"),
        ("TREEVERIFY_DECODE_GEMV_PDL", env.decode_gemv_pdl, "auto", "no", "0"),
        ("TREEVERIFY_TRITON_PDL", env.triton_pdl, True, "no", False),
        ("TREEVERIFY_MOE_GEMV_SHARED", env.moe_gemv_shared, True, "false", False),
        ("TREEVERIFY_DECODE_LOOKAHEAD", env.decode_lookahead, True, " 0", False),
        ("TREEVERIFY_FUSED_DECODE_STEP", env.fused_decode_step, True, "0", False),
    ],
)
def test_kernel_flags_read_and_rejected_by_name(
    monkeypatch, name, reader, default, value, expected
):
    """The kernel flags: their default unset, a valid value read, a bad one an error naming
    the variable."""
    monkeypatch.delenv(name, raising=False)
    assert reader() == default
    monkeypatch.setenv(name, value)
    assert reader() == expected
    monkeypatch.setenv(name, "sideways")
    with pytest.raises(ValueError, match=name):
        reader()


def test_cuda_split_share(monkeypatch):
    """TREEVERIFY_CUDA_SPLIT_SHARE: None unless set (the policy's SINGLE_SPLIT_SHARE), a number
    in 1..4 when set (1: the v12 rule), anything else an error naming it."""
    monkeypatch.delenv("TREEVERIFY_CUDA_SPLIT_SHARE", raising=False)
    assert env.cuda_split_share() is None
    monkeypatch.setenv("TREEVERIFY_CUDA_SPLIT_SHARE", "1.142857")
    assert env.cuda_split_share() == pytest.approx(8 / 7, rel=1e-5)
    for bad in ("0.5", "5", "nan", "eight"):
        monkeypatch.setenv("TREEVERIFY_CUDA_SPLIT_SHARE", bad)
        with pytest.raises(ValueError, match="TREEVERIFY_CUDA_SPLIT_SHARE"):
            env.cuda_split_share()


def test_moe_gemv_tile(monkeypatch):
    """TREEVERIFY_MOE_GEMV_TILE: None unless set; three powers of two in range; anything else an
    error naming the variable."""
    monkeypatch.delenv("TREEVERIFY_MOE_GEMV_TILE", raising=False)
    assert env.moe_gemv_tile() is None
    monkeypatch.setenv("TREEVERIFY_MOE_GEMV_TILE", " 16,512,8")
    assert env.moe_gemv_tile() == (16, 512, 8)
    for bad in ("16,512", "16,500,8", "16,512,32", "a,b,c", "0,512,4"):
        monkeypatch.setenv("TREEVERIFY_MOE_GEMV_TILE", bad)
        with pytest.raises(ValueError, match="TREEVERIFY_MOE_GEMV_TILE"):
            env.moe_gemv_tile()


# ---------------------------------------------------------------- usage errors


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--seed", "-1"], "--seed"),
        (["--seed", str(2**70)], "--seed"),
        (["--json", "/nonexistent/dir/x.json"], "--json"),
        (["--json", "."], "--json"),  # a directory
        (["--backend", "cuda"], "--backend cuda"),
    ],
)
def test_check_usage_errors_are_one_line_before_the_run(argv, says):
    """Bad values fail with exit 2 and a line naming the flag, before any case runs."""
    proc = run_cli("check", "--quick", "--device", "cpu", *argv)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and says in proc.stderr.splitlines()[-1]
    assert "rel err" not in proc.stdout  # no case ran


def test_check_seed_range_fits_every_generator():
    """The largest --seed gives every case a seed numpy and torch both take."""
    parser = argparse.ArgumentParser(prog="treeverify")
    check.add_parser(parser.add_subparsers())
    assert parser.parse_args(["check", "--seed", str(check.SEED_MAX)]).seed == check.SEED_MAX
    last = len(check.cases(False, "cpu")) - 1
    check.make_inputs(
        check.cases(True, "cpu")[1], torch.float32, "cpu", check.SEED_MAX * 1000 + last
    )
