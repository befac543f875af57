"""The decode GEMV's CPU side (models/gemv.py, kernels/cuda/decode_gemv.cu): every instance
compiles with NVRTC for sm_80 and sm_90a without spills (what a GPU would load), the dispatch
falls back to F.linear off the GPU, and bad operands name the argument. tests/test_gemv_gpu.py
runs the kernel against an fp32 reference, eager and in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from kernel_signature import assert_matches_signature
from treeverify.models import gemv as gemv_mod

PROLOGUES = ((False, False), (True, False), (False, True))  # (act, norm): plain, silu, norm


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_every_instance_compiles_without_spills(arch):
    pytest.importorskip("cuda.bindings.nvrtc")
    from treeverify.kernels.cuda.jit import compile_variant
    from treeverify.kernels.cuda.variants import DTYPES, DecodeGemvVariant, all_variants

    for dtype in DTYPES:
        for m, (act, norm) in [(m, p) for m in range(1, gemv_mod.GEMV_MAX_ROWS + 1)
                               for p in PROLOGUES]:  # fmt: skip
            v = DecodeGemvVariant(m, dtype, act, norm)
            assert v in all_variants(arch)  # `treeverify kernels build` prebuilds it
            compiled = compile_variant(v, arch)
            assert compiled.spill_bytes == 0 and 0 < compiled.registers <= 128, v.name


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_every_few_row_instance_compiles_without_spills(arch):
    """skinny_gemm.cu's built row-tile counts, both dtypes and their act and norm instances:
    prebuilt by `treeverify kernels build`, no spills, at most 128 registers (the first
    version's 92 at 32 rows halved the CTAs an SM held: the 1024-CTA lm_head ran two waves)."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from treeverify.kernels.cuda.jit import compile_variant
    from treeverify.kernels.cuda.variants import (
        DTYPES,
        SKINNY_TILE_COUNTS,
        SkinnyGemmVariant,
        all_variants,
    )

    for dtype in DTYPES:
        for nt, (act, norm) in [(nt, p) for nt in SKINNY_TILE_COUNTS for p in PROLOGUES]:
            v = SkinnyGemmVariant(nt, dtype, act, norm)
            assert v in all_variants(arch)
            compiled = compile_variant(v, arch)
            assert compiled.spill_bytes == 0 and 0 < compiled.registers <= 128, v.name


def _cuobjdump() -> str | None:
    import shutil
    from pathlib import Path

    found = shutil.which("cuobjdump")
    if found:
        return found
    try:  # triton ships one with its NVIDIA backend
        import triton

        bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        return str(bundled) if bundled.exists() else None
    except ImportError:
        return None


def test_weight_loads_go_out_before_the_programmatic_launch_wait():
    """Both linear kernels load their first weight vectors before griddepcontrol.wait (SASS
    ACQBULK), so under programmatic dependent launch the loads overlap the kernel before them;
    and call no subroutine (the act instances' division inline).
    ptxas may hoist the wait above plain predicated loads: the few-row kernel's first version
    waited first in every variant (found in its SASS) until its loads were put under a branch."""
    pytest.importorskip("cuda.bindings.nvrtc")
    import subprocess
    import tempfile
    from pathlib import Path

    from treeverify.kernels.cuda.jit import compile_variant
    from treeverify.kernels.cuda.variants import (
        SKINNY_TILE_COUNTS,
        DecodeGemvVariant,
        SkinnyGemmVariant,
    )

    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (CUDA toolkit or triton's bundled one)")
    variants = [DecodeGemvVariant(1, "bf16", *p) for p in PROLOGUES] + [
        SkinnyGemmVariant(nt, "bf16", *p) for nt in SKINNY_TILE_COUNTS for p in PROLOGUES
    ]
    for v in variants:
        with tempfile.TemporaryDirectory() as tmp:
            cubin = Path(tmp) / f"{v.name}.cubin"
            cubin.write_bytes(compile_variant(v, "sm_90a").cubin)
            sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True,
                                  check=True).stdout  # fmt: skip
        lines = sass.splitlines()
        wait = next(i for i, line in enumerate(lines) if "ACQBULK" in line)
        first_stream_load = next(i for i, line in enumerate(lines) if "LDG.E.NA" in line)
        assert first_stream_load < wait, v.name
        # The act instances' silu divides with div.full.f32 (Triton's, linear_common.cuh): an
        # IEEE division compiles to a slow-path subroutine call per element, which serialised
        # the activations (the few-row act instance ~4x slower than the plain one, H100).
        assert not any(" CALL." in line for line in lines), v.name


def test_off_the_gpu_linear_is_f_linear_and_layers_keep_their_state_dict():
    w = torch.randn(8, 64).to(torch.bfloat16)
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert not gemv_mod.uses_gemv(x, w)
    torch.testing.assert_close(gemv_mod.linear(x, w), torch.nn.functional.linear(x, w))
    lin = gemv_mod.Linear(64, 8, bias=True)
    assert set(lin.state_dict()) == {"weight", "bias"}  # checkpoints load as into nn.Linear
    torch.testing.assert_close(lin(x.float()), torch.nn.functional.linear(x.float(), lin.weight,
                                                                           lin.bias))  # fmt: skip


def test_launch_arguments_match_the_kernel_signature():
    """One argument per parameter of decode_gemv, in order (a missing one is
    CUDA_ERROR_INVALID_VALUE or a crash on the GPU: f06ab93 launched 9 of 10)."""
    x = torch.randn(1, 64).to(torch.bfloat16)
    w = torch.randn(8, 64).to(torch.bfloat16)
    args = gemv_mod.launch_args(x, w, None, torch.empty(1, 8, dtype=torch.bfloat16))
    assert_matches_signature("decode_gemv.cu", "decode_gemv", args)
    assert [a.value for a in args[7:9]] == [8, 64]  # n, k
    assert [a.value for a in args[9:]] == [None, None, None, 0, None, 0.0]  # no norm operands
    norm = _norm_operands(1, 64)
    args = gemv_mod.launch_args(x, w, None, torch.empty(1, 8, dtype=torch.bfloat16), norm)
    assert_matches_signature("decode_gemv.cu", "decode_gemv", args)
    _assert_norm_args(args[9:], norm)


def _norm_operands(m: int, k: int) -> gemv_mod.NormOperands:
    t = torch.randn(m, 3 * k).to(torch.bfloat16)
    return gemv_mod.NormOperands(torch.randn(m, k).to(torch.bfloat16),
                                 torch.empty(m, k, dtype=torch.bfloat16), t[:, k : 2 * k],
                                 torch.randn(k).to(torch.bfloat16), 1e-5)  # fmt: skip


def _assert_norm_args(args: list, norm: gemv_mod.NormOperands) -> None:
    """residual, r_out, tap, tap's row stride, gamma, eps: the kernels' six trailing params."""
    want = [norm.residual.data_ptr(), norm.r_out.data_ptr(), norm.tap.data_ptr(),
            norm.tap.stride(0), norm.gamma.data_ptr()]  # fmt: skip
    assert [a.value for a in args[:5]] == want
    assert args[5].value == pytest.approx(norm.eps)


def test_few_row_launch_arguments_match_the_kernel_signature():
    x = torch.randn(5, 64).to(torch.bfloat16)
    w = torch.randn(16, 64).to(torch.bfloat16)
    args = gemv_mod.skinny_launch_args(x, w, None, torch.empty(5, 16, dtype=torch.bfloat16))
    assert_matches_signature("skinny_gemm.cu", "skinny_gemm", args)
    assert [args[2].value, args[8].value, args[9].value] == [5, 16, 64]  # m, n, k
    norm = _norm_operands(5, 64)
    args = gemv_mod.skinny_launch_args(x, w, None, torch.empty(5, 16, dtype=torch.bfloat16), norm)
    assert_matches_signature("skinny_gemm.cu", "skinny_gemm", args)
    _assert_norm_args(args[10:], norm)


def test_few_row_dispatch_off_the_gpu_and_its_bad_operands():
    x = torch.randn(17, 256).to(torch.bfloat16)
    w = torch.randn(512, 256).to(torch.bfloat16)
    assert not gemv_mod.uses_skinny(x, w)  # the CPU: F.linear
    torch.testing.assert_close(gemv_mod.linear(x, w), torch.nn.functional.linear(x, w))
    with pytest.raises(ValueError, match="x: expected"):
        gemv_mod.skinny(torch.randn(1, 256).to(torch.bfloat16), w)  # one row: the GEMV's
    with pytest.raises(ValueError, match="x: expected"):
        gemv_mod.skinny(torch.randn(33, 256).to(torch.bfloat16), w)
    with pytest.raises(ValueError, match="x: expected"):
        gemv_mod.skinny(torch.randn(4, 48).to(torch.bfloat16), torch.randn(16, 48).bfloat16())
    with pytest.raises(ValueError, match="weight: expected"):
        gemv_mod.skinny(torch.randn(4, 64).to(torch.bfloat16), torch.randn(24, 64).bfloat16())
    with pytest.raises(ValueError, match="bias: expected"):
        gemv_mod.skinny(x, w, torch.randn(4).to(torch.bfloat16))
    with pytest.raises(ValueError, match="x: expected 16-byte"):
        gemv_mod.skinny(torch.randn(17, 264).to(torch.bfloat16)[:, 4:260], w)
    with pytest.raises(ValueError, match="x: expected a 2-D bf16 or fp16"):
        gemv_mod.skinny(x.float(), w)  # fp32 would be read as 16-bit elements
    with pytest.raises(ValueError, match="weight: expected 2-D torch.bfloat16"):
        gemv_mod.skinny(x, w.half())
    with pytest.raises(ValueError, match="bias: expected torch.bfloat16"):
        gemv_mod.skinny(x, w, torch.randn(512))
    with pytest.raises(ValueError, match="weight: expected N a positive multiple"):
        gemv_mod.skinny(x, w[:0])
    with pytest.raises(ValueError, match="x: expected a CUDA tensor"):
        gemv_mod.skinny(x, w)  # every other rule met: the CPU


def test_down_of_silu_off_the_gpu_is_silu_mul_then_linear():
    """The CPU (and anything the kernels do not take): fused_ops.silu_mul, then F.linear."""
    from treeverify.models.fused_ops import silu_mul

    gu = torch.randn(3, 128).to(torch.bfloat16)
    w = torch.randn(16, 64).to(torch.bfloat16)
    b = torch.randn(16).to(torch.bfloat16)
    torch.testing.assert_close(gemv_mod.down_of_silu(gu, w, b),
                               torch.nn.functional.linear(silu_mul(gu), w, b))  # fmt: skip
    with pytest.raises(ValueError, match=r"x: expected \(M in 1..1, 128\)"):
        gemv_mod.gemv(torch.randn(1, 64).to(torch.bfloat16), w, act=True)  # not a gate|up
    with pytest.raises(ValueError, match=r"x: expected \(M in 2..32, 128\)"):
        gemv_mod.skinny(torch.randn(4, 64).to(torch.bfloat16), w, act=True)


def test_skinny_max_rows_is_read_checked_and_caps_the_route(monkeypatch):
    """TREEVERIFY_SKINNY_MAX_ROWS: 32 by default, 24 / 16 / 8 accepted, anything else an error
    naming it; the route's cap follows it (read once a process: the cache cleared here)."""
    from treeverify import env

    monkeypatch.delenv("TREEVERIFY_SKINNY_MAX_ROWS", raising=False)
    assert env.skinny_max_rows() == 32
    for value in ("24", "16", "8"):
        monkeypatch.setenv("TREEVERIFY_SKINNY_MAX_ROWS", value)
        assert env.skinny_max_rows() == int(value)
        gemv_mod.skinny_max_rows.cache_clear()
        assert gemv_mod.skinny_max_rows() == int(value)
    for bad in ("25", "64", "all"):
        monkeypatch.setenv("TREEVERIFY_SKINNY_MAX_ROWS", bad)
        with pytest.raises(ValueError, match="TREEVERIFY_SKINNY_MAX_ROWS"):
            env.skinny_max_rows()
    monkeypatch.delenv("TREEVERIFY_SKINNY_MAX_ROWS")
    gemv_mod.skinny_max_rows.cache_clear()
    assert gemv_mod.skinny_max_rows() == gemv_mod.SKINNY_MAX_ROWS


@pytest.mark.parametrize("name,read,default",
                         [("TREEVERIFY_FUSED_SILU_DOWN", "fused_silu_down", False),
                          ("TREEVERIFY_SKINNY_GEMM", "skinny_gemm", True)])  # fmt: skip
def test_the_new_kernel_switches_are_read_and_checked(monkeypatch, name, read, default):
    """The few-row kernel on by default (measured on the H100), the fused activation off until
    it wins there; 1 on, 0 off, anything else an error naming the variable."""
    from treeverify import env

    monkeypatch.delenv(name, raising=False)
    assert getattr(env, read)() is default
    monkeypatch.setenv(name, "0")
    assert getattr(env, read)() is False
    monkeypatch.setenv(name, "1")
    assert getattr(env, read)() is True
    monkeypatch.setenv(name, "sometimes")
    with pytest.raises(ValueError, match=name):
        getattr(env, read)()


def test_bad_operands_name_the_argument():
    w = torch.randn(8, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="x: expected a 2-D bf16 or fp16"):
        gemv_mod.gemv(torch.randn(1, 64), w)  # fp32 would be read as 16-bit elements
    with pytest.raises(ValueError, match="weight: expected 2-D torch.bfloat16"):
        gemv_mod.gemv(torch.randn(1, 64).to(torch.bfloat16), w.half())
    with pytest.raises(ValueError, match="x: expected a CUDA tensor"):
        gemv_mod.gemv(torch.randn(1, 64).to(torch.bfloat16), w)  # every other rule met
    with pytest.raises(ValueError, match="x: expected"):
        gemv_mod.gemv(torch.randn(gemv_mod.GEMV_MAX_ROWS + 1, 64).to(torch.bfloat16), w)
    with pytest.raises(ValueError, match="x: expected"):
        gemv_mod.gemv(torch.randn(1, 32).to(torch.bfloat16), w)
    with pytest.raises(ValueError, match="bias: expected"):
        gemv_mod.gemv(torch.randn(1, 64).to(torch.bfloat16), w, torch.randn(4).to(torch.bfloat16))


def test_the_switch_is_read_and_checked(monkeypatch):
    from treeverify import env

    monkeypatch.setenv("TREEVERIFY_DECODE_GEMV", "0")
    assert env.decode_gemv() is False
    monkeypatch.setenv("TREEVERIFY_DECODE_GEMV", "maybe")
    with pytest.raises(ValueError, match="TREEVERIFY_DECODE_GEMV"):
        env.decode_gemv()
    monkeypatch.delenv("TREEVERIFY_DECODE_GEMV")
    assert env.decode_gemv() is True


def test_describe_says_which_path_decode_rows_take(monkeypatch):
    """The startup log and /server_info line (engine startup["decode_gemv"] on a GPU)."""
    gemv_mod.enabled.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("TREEVERIFY_DECODE_GEMV", "0")
    assert gemv_mod.describe().startswith("decode GEMV off")
    gemv_mod.enabled.cache_clear()
    monkeypatch.setenv("TREEVERIFY_DECODE_GEMV", "1")
    from treeverify.kernels.api import cuda_backend_available

    want = (
        "decode GEMV on: 1 row x weights <= 16 MB"
        if cuda_backend_available()
        else "decode GEMV off"
    )
    assert gemv_mod.describe().startswith(want)
    gemv_mod.enabled.cache_clear()


def test_few_row_instances_by_row_count():
    """1-8 rows one n8 tile, 9-24 three (two tiles measured slower than three on the H100),
    25-32 four; nothing outside 1..32."""
    assert [gemv_mod.skinny_tiles(m) for m in (1, 2, 8, 9, 16, 17, 24, 25, 32)] == [
        1, 1, 1, 3, 3, 3, 3, 4, 4,
    ]  # fmt: skip
    for m in (0, 33):
        with pytest.raises(ValueError, match="m: expected 1..32"):
            gemv_mod.skinny_tiles(m)


def test_norm_shared_memory_sizes_and_cap():
    """A norm instance's staged rows: the GEMV's m K 2 bytes, the few-row kernel's m rows of
    K/8 vectors padded to 4 mod 8 (skinny_gemm.cu norm_pitch); past the cap a direct call names
    `norm` (the dispatch, models/norm_linear.py, takes the two steps there instead)."""
    assert gemv_mod.norm_smem_bytes(1, 2048) == 4096
    assert gemv_mod.norm_smem_bytes(17, 256) == 17 * 36 * 16  # 32 vectors -> pitch 36
    assert gemv_mod.norm_smem_bytes(17, 288) == 17 * 36 * 16  # 36 is 4 mod 8 already
    assert gemv_mod.norm_smem_bytes(32, 512) <= gemv_mod.NORM_SMEM_MAX_BYTES
    assert gemv_mod._norm_smem(5, 64, None) == 0
    with pytest.raises(ValueError, match="norm"):
        gemv_mod._norm_smem(32, 1024, _norm_operands(32, 1024))
