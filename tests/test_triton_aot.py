"""The Triton kernels compile for sm_90 on a CPU-only machine (kernels/triton/aot_check.py):
the forward and the merge of a GQA and an MLA family lower through Triton's pipeline and the
bundled ptxas, every constexpr the kernels declare given (v12 added BLOCK_B and the checker broke
unnoticed until the sixteenth session). Says nothing about speed; skipped without triton."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")

from treeverify.kernels.triton import aot_check  # noqa: E402


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter compiles nothing"
)
def test_forward_and_merge_compile_for_sm90():
    lines = aot_check.check(90, families=["gqa64", "mla-tp8"])
    assert len(lines) == 4, lines  # fwd + merge per family
    assert not [ln for ln in lines if "FAILED" in ln], lines
    for ln in lines:
        assert "regs=" in ln and "ptxas failed" not in ln, ln
    gqa_fwd = next(ln for ln in lines if ln.startswith("fwd   gqa64"))
    assert "spill_stores=0B" in gqa_fwd and "wgmma" in gqa_fwd, gqa_fwd
