"""The Triton kernels compile for sm_90 on a CPU-only machine (kernels/triton/aot_check.py):
the forward and the merge of a GQA and an MLA family lower through Triton's pipeline and the
bundled ptxas, every constexpr the kernels declare given (v12 added BLOCK_B and the checker broke
unnoticed until the sixteenth session), for plans that balance and plans that do not. Run as
its own process: in this one the interpreter tests may have decorated the kernels for
TRITON_INTERPRET, which compiles nothing. Says nothing about speed; skipped without triton."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)


def _aot(*args: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    argv = [sys.executable, "-m", "treeverify.kernels.triton.aot_check", *args]
    res = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(("fwd", "merge"))]
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return lines


@pytest.mark.parametrize("balanced", [False, True], ids=["plain", "balanced"])
def test_forward_and_merge_compile_for_sm90(balanced):
    args = ["--family", "gqa64", "--family", "mla-tp8"] + (["--balanced"] if balanced else [])
    lines = _aot(*args)
    assert len(lines) == 4, lines  # fwd + merge per family
    assert not [ln for ln in lines if "FAILED" in ln or "ptxas failed" in ln], lines
    assert all("regs=" in ln for ln in lines), lines
    gqa_fwd = next(ln for ln in lines if ln.startswith("fwd   gqa64"))
    assert "spill_stores=0B" in gqa_fwd and "wgmma" in gqa_fwd, gqa_fwd
