"""The L2 prefetch's CPU side (models/l2_prefetch.py, kernels/cuda/l2_prefetch.cu): the kernel
compiles with NVRTC for every arch the build covers, the ranges it is given are aligned and cut
to the budget, its arguments match its signature, the switch is checked, and nothing happens
off a graph capture. tests/test_l2_prefetch_gpu.py captures it beside real forwards."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest
import torch

from treeverify.models import l2_prefetch


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a", "sm_120"])
def test_the_kernel_compiles_for_each_arch(arch):
    pytest.importorskip("cuda.bindings.nvrtc")
    from treeverify.kernels.cuda.jit import compile_variant
    from treeverify.kernels.cuda.variants import L2PrefetchVariant, all_variants

    v = L2PrefetchVariant()
    assert v in all_variants(arch)  # `treeverify kernels build` prebuilds it
    compiled = compile_variant(v, arch)
    assert compiled.spill_bytes == 0 and compiled.smem_bytes == 0


def test_ranges_are_aligned_in_order_and_cut_to_the_budget():
    base = torch.empty(4096, dtype=torch.bfloat16)  # 8 KB, 16-byte aligned by the allocator
    a, b, c, d = base[:1024], base[1024:2048], base[2048:3072], base[3072:]
    assert base.data_ptr() % 16 == 0
    spans = l2_prefetch.ranges((a, b, c, d), budget=1 << 20)
    # at most three (the kernel's arguments), in the order given, each whole here
    assert spans == [(a.data_ptr(), 2048), (b.data_ptr(), 2048), (c.data_ptr(), 2048)]
    # the budget cuts the last range taken (to a multiple of 16) and stops there
    assert l2_prefetch.ranges((a, b), budget=3000) == [(a.data_ptr(), 2048), (b.data_ptr(), 944)]
    # an unaligned view is trimmed inwards to 16-byte boundaries on both ends
    odd = base[3:1003]  # starts 6 bytes in, 2000 bytes long
    ((first, n),) = l2_prefetch.ranges((odd,), budget=1 << 20)
    assert first % 16 == 0 and n % 16 == 0
    assert odd.data_ptr() <= first and first + n <= odd.data_ptr() + 2000
    assert first - odd.data_ptr() < 16 and odd.data_ptr() + 2000 - (first + n) < 16
    # non-contiguous weights are skipped, not read as if contiguous
    strided = base.view(64, 64)[:, :32]
    assert l2_prefetch.ranges((strided, a), budget=1 << 20) == [(a.data_ptr(), 2048)]
    assert l2_prefetch.ranges((a,), budget=8) == []


def test_launch_arguments_match_the_kernel_signature():
    """Three (pointer, bytes) pairs, unused ones null: a missing argument is
    CUDA_ERROR_INVALID_VALUE or a crash on the GPU."""
    src = Path(l2_prefetch.__file__).parents[1] / "kernels" / "cuda" / "l2_prefetch.cu"
    params = re.search(r"l2_prefetch\(([^)]*)\)", src.read_text()).group(1).split(",")
    args = l2_prefetch.launch_args([(4096, 160)])
    assert len(args) == len(params) == 6
    for a, p in zip(args, params, strict=True):
        assert isinstance(a, ctypes.c_void_p if "*" in p else ctypes.c_longlong), p
    assert [args[0].value, args[1].value] == [4096, 160]
    assert [a.value for a in args[2:]] == [None, 0, None, 0]


def test_the_switch_is_read_and_checked(monkeypatch):
    from treeverify import env

    monkeypatch.delenv("TREEVERIFY_L2_PREFETCH", raising=False)
    assert env.l2_prefetch_mb() == 0
    monkeypatch.setenv("TREEVERIFY_L2_PREFETCH", "24")
    assert env.l2_prefetch_mb() == 24
    for bad in ("-1", "lots", "2048"):
        monkeypatch.setenv("TREEVERIFY_L2_PREFETCH", bad)
        with pytest.raises(ValueError, match="TREEVERIFY_L2_PREFETCH"):
            env.l2_prefetch_mb()


def test_off_a_capture_nothing_is_forked(monkeypatch):
    """On the CPU (and eagerly anywhere) issue and join do nothing, with a budget set."""
    monkeypatch.setattr(l2_prefetch, "budget_bytes", lambda: 24 << 20)
    x = torch.randn(1, 64)
    assert not l2_prefetch.active(x)
    l2_prefetch.issue(x, (torch.randn(64, 64),))
    assert not l2_prefetch._pending
    l2_prefetch.join(x)


def test_the_llama_layers_name_what_they_read_next():
    """fuse_for_inference hands each attention the o, gate|up and down weights, in the order
    the layer reads them; a model loaded unfused names none (nothing to prefetch)."""
    from treeverify.models.tiny import build_tiny

    _, model, _ = build_tiny("tiny-llama")
    assert all(layer.self_attn.l2_next == () for layer in model.model.layers)
    model.fuse_for_inference()
    for layer in model.model.layers:
        o, gate_up, down = layer.self_attn.l2_next
        assert o is layer.self_attn.o_proj.weight and down is layer.mlp.down_proj.weight
        assert gate_up is layer.mlp.gate_up[0] and gate_up.is_contiguous()


def test_the_mla_layers_name_what_they_read_next():
    """DeepSeek-V3 layers: kv_b (the absorbed einsums) and o after attention, then a dense
    layer's gate|up; a MoE layer's routed experts are not known before routing."""
    from treeverify.models.tiny import build_tiny

    _, model, _ = build_tiny("tiny-kimi")
    model.fuse_for_inference()
    assert any(layer.is_moe for layer in model.model.layers)
    for layer in model.model.layers:
        attn = layer.self_attn
        want = [attn.kv_b_proj.weight, attn.o_proj.weight]
        if not layer.is_moe:
            want.append(layer.mlp.gate_up[0])
        assert len(attn.l2_next) == len(want)
        assert all(a is b for a, b in zip(attn.l2_next, want, strict=True))
