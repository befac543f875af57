"""Linear layers for decode-sized batches: a GEMV where cuBLAS leaves HBM bandwidth unused.

A batch-1 decode step reads every weight once for a handful of rows, so each linear
layer is a matrix-vector product bound by HBM bandwidth. On the H200 (scripts/gemv_bench.py,
2026-12-02) cuBLAS ran the 1B shape's 8 MB `o` projection at 1.6 TB/s and the 12.6 MB `qkv` at
2.4 (64 outputs per CTA: 32-48 CTAs on 132 SMs), `down` through split-K plus a reduce kernel at
3.1, against 4.3 for the 525 MB lm_head.

`linear(x, weight, bias)` is F.linear except that a CUDA bf16/fp16 input of GEMV_MAX_ROWS row
against a weight of at most GEMV_MAX_BYTES runs kernels/cuda/decode_gemv.cu: one warp per
weight row, 16-byte streaming loads, fp32 sums reduced once per row, no atomics (one
deterministic order per shape, the same eager and inside a CUDA graph). Anything else (the CPU,
more rows, a larger weight, fp32, an unaligned or strided operand, no cuda-python) is F.linear,
as before; TREEVERIFY_DECODE_GEMV=0 turns it off.

Rows 2..SKINNY_MAX_ROWS (32) against a weight of at most SKINNY_MAX_BYTES run
kernels/cuda/skinny_gemm.cu instead (TREEVERIFY_SKINNY_GEMM, default on since the H100 measured
it in the forty-sixth session: the b=1 round's GPU time -6.5%, DDTREE b=16 1.525x -> 1.619x
plain at b=1 on code; =0 turns it off): a batch-1 verify forward (a budget-16 tree is 17 rows) and a
DFlash drafter's block (16 rows) multiply a few rows by small weights, where cuBLAS takes
~2.7-3.2 us a call on tiny-code's 0.1-4 MB weights against the one-row GEMV's ~1.7-2.2 (H200,
173907b's bench): launch and latency, not bytes. One CTA per sixteen outputs, its four warps
splitting K over tensor-core MMAs (x's rows the MMA's n dimension, in tiles of 8), fp32 sums
added in a fixed order.

On sm_90+ the kernel goes out by programmatic dependent launch (models/pdl.py `decode_gemv`,
TREEVERIFY_DECODE_GEMV_PDL): its weights depend on no earlier kernel, so it loads its first
weight tile while the kernel in front of it (a Triton norm or activation, which signals its
dependents as it starts) still runs, then waits for that kernel before reading x. Measured on the
H200 (d56fa35): decode forward 1.014x (random:mla-moe) and 1.021x (random:llama-1b) at b=1.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from treeverify.models import pdl

# Where the GEMV beat cuBLAS on the H200 (scripts/gemv_bench.py, 0a04373 / 38c900d): one row
# and weights up to 16 MB (1B qkv 1.15x, o 1.28x); at 2-4 rows, and on the 34-525 MB weights
# (gate|up, down, lm_head, the 8B shape), it measured 0.5-1.05x: those stay on cuBLAS.
# More rows were tried too: 8 rows of x per CTA on tiny-code's 0.1-0.7 MB weights (its verify
# forward's 17 rows, the drafter's 16) ran 0.4-0.7x cuBLAS and slowed DDTREE rounds (173907b).
GEMV_MAX_ROWS = 1
GEMV_MAX_BYTES = 16 << 20
ROWS_PER_CTA = 8  # kGemvWarps in decode_gemv.cu: one warp per weight row
# The few-row kernel (skinny_gemm.cu): up to four n8 tiles of rows; one CTA per 16 outputs.
# Its first version beat cuBLAS on tiny-code's <= 0.7 MB weights at 2-16 rows and lost on the
# 4.2 MB lm_head (0.6-0.99x) and on the 1B / 8B shapes (0.27-0.88x; H100, e3f2922).
SKINNY_MAX_ROWS = 32
SKINNY_MAX_BYTES = 2 << 20
SKINNY_OUTPUTS_PER_CTA = 16
SKINNY_K_MULTIPLE = 32  # a lane's 16-byte vector of each 32-column chunk


@functools.cache
def enabled() -> bool:
    """TREEVERIFY_DECODE_GEMV on, a GPU, and cuda-python to launch with (read once a process)."""
    from treeverify import env
    from treeverify.kernels.api import cuda_backend_available

    return env.decode_gemv() and torch.cuda.is_available() and cuda_backend_available()


@functools.cache
def skinny_enabled() -> bool:
    """TREEVERIFY_SKINNY_GEMM on, a GPU, and cuda-python (read once a process)."""
    from treeverify import env
    from treeverify.kernels.api import cuda_backend_available

    return env.skinny_gemm() and torch.cuda.is_available() and cuda_backend_available()


@functools.cache
def skinny_max_rows() -> int:
    """The most rows `linear` sends to the few-row kernel: TREEVERIFY_SKINNY_MAX_ROWS (at most
    SKINNY_MAX_ROWS, the kernel's own limit; read once a process)."""
    from treeverify import env

    return min(env.skinny_max_rows(), SKINNY_MAX_ROWS)


@functools.cache
def fused_silu_enabled() -> bool:
    """TREEVERIFY_FUSED_SILU_DOWN on (read once a process; `down_of_silu`)."""
    from treeverify import env

    return env.fused_silu_down()


@functools.cache
def _skinny_kernel(device_index: int, nt: int, dtype: torch.dtype, act: bool = False,
                   norm: bool = False):  # fmt: skip
    from treeverify.kernels.cuda.launch import load
    from treeverify.kernels.cuda.variants import SkinnyGemmVariant

    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    return load(SkinnyGemmVariant(nt, name, act, norm), torch.device("cuda", device_index))


@functools.cache
def _kernel(device_index: int, m: int, dtype: torch.dtype, act: bool = False,
            norm: bool = False):  # fmt: skip
    from treeverify.kernels.cuda.launch import load
    from treeverify.kernels.cuda.variants import DecodeGemvVariant

    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    return load(DecodeGemvVariant(m, name, act, norm), torch.device("cuda", device_index))


def _aligned(t: torch.Tensor) -> bool:
    """Rows start on 16 bytes and columns are contiguous (the kernel's vector loads)."""
    return t.stride(-1) == 1 and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0


def _kernel_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """What both kernels need besides their size rules: 2-D CUDA operands on one device, bf16
    or fp16 alike, rows 16-byte aligned; a bias (N,) contiguous of the same dtype and device;
    and no autograd to record (the kernels have no backward: under grad mode with an operand
    that requires grad, F.linear)."""
    if not (x.is_cuda and x.dim() == 2 and weight.dim() == 2 and weight.device == x.device):
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        return False
    if bias is not None and not (bias.dtype == x.dtype and bias.device == x.device
                                 and bias.shape == (weight.shape[0],)
                                 and bias.stride(0) == 1):  # fmt: skip
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):  # fmt: skip
        return False
    return weight.shape[0] > 0 and _aligned(x) and _aligned(weight)


def _route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """The kernel `linear` runs for x (M, K) against weight (N, K): `gemv`, `skinny` or None
    (F.linear). The operands checked once, then each kernel's size rules."""
    if not _kernel_operands(x, weight, bias):
        return None
    m, k = x.shape
    nbytes = weight.numel() * weight.element_size()
    if 0 < m <= GEMV_MAX_ROWS and nbytes <= GEMV_MAX_BYTES and k % 8 == 0 and enabled():
        return gemv
    if (2 <= m <= skinny_max_rows() and nbytes <= SKINNY_MAX_BYTES and k % SKINNY_K_MULTIPLE == 0
            and weight.shape[0] % SKINNY_OUTPUTS_PER_CTA == 0 and skinny_enabled()):  # fmt: skip
        return skinny
    return None


def uses_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether `linear` runs the decode GEMV for this input (see the module docstring)."""
    return _route(x, weight, bias) is gemv


def uses_skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether `linear` runs the few-row kernel for this input (see the module docstring)."""
    return _route(x, weight, bias) is skinny


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): (M, K) x (N, K) -> (M, N), by the GEMV for decode-sized M
    and the few-row kernel for 2..skinny_max_rows() rows where switched on."""
    kernel = _route(x, weight, bias)
    return kernel(x, weight, bias) if kernel is not None else F.linear(x, weight, bias)


def down_of_silu(gate_up: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """linear(silu_mul(gate_up), weight, bias): a SwiGLU MLP's down projection of its gate|up
    output (M, 2I) with weight (N, I). With TREEVERIFY_FUSED_SILU_DOWN=1, where the GEMV or the
    few-row kernel takes the (M, I) input, the activation is made on that kernel's load, as
    fused_ops.silu_mul rounds it (silu to the dtype, then the product): the activation's own
    launch is gone. Elsewhere the two steps."""
    from treeverify.models.fused_ops import silu_mul

    if fused_silu_enabled() and gate_up.dim() == 2 and gate_up.shape[1] == 2 * weight.shape[1]:
        # the (M, I) gate half: the rows, stride and alignment the kernel reads
        kernel = _route(gate_up[:, : weight.shape[1]], weight, bias)
        if kernel is not None:
            return kernel(gate_up, weight, bias, act=True)
    return linear(silu_mul(gate_up), weight, bias)


def _checked(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    act: bool,
    rows: tuple[int, int],
    k_multiple: int,
    n_multiple: int,
) -> tuple[int, int]:
    """(M, N) of a direct kernel call, or a ValueError naming the operand it cannot take: x
    (M in rows, K or 2K with `act`) and weight (N, K) bf16 / fp16 alike on one CUDA device, K
    and N multiples of k_multiple and n_multiple, rows 16-byte aligned, bias (N,) contiguous
    of the same dtype and device. (The CPU is checked last, so every rule is testable there.)"""
    if not (x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2):
        raise ValueError(f"x: expected a 2-D bf16 or fp16 tensor, got {x.dtype} {tuple(x.shape)}")
    if weight.dtype != x.dtype or weight.device != x.device or weight.dim() != 2:
        raise ValueError(f"weight: expected 2-D {x.dtype} on {x.device}, got {weight.dtype} on "
                         f"{weight.device}")  # fmt: skip
    if bias is not None and (bias.dtype != x.dtype or bias.device != x.device):
        raise ValueError(f"bias: expected {x.dtype} on {x.device}, got {bias.dtype} on "
                         f"{bias.device}")  # fmt: skip
    (m, n), k = (x.shape[0], weight.shape[0]), weight.shape[1]
    cols = 2 * k if act else k
    if not rows[0] <= m <= rows[1] or x.shape[1] != cols or k % k_multiple:
        raise ValueError(f"x: expected (M in {rows[0]}..{rows[1]}, {cols}) with K a multiple of "
                         f"{k_multiple}, got {tuple(x.shape)}")  # fmt: skip
    if n <= 0 or n % n_multiple:
        raise ValueError(f"weight: expected N a positive multiple of {n_multiple}, got {n}")
    for name, t in (("x", x), ("weight", weight)):
        if not _aligned(t):  # the kernels' 16-byte loads
            raise ValueError(f"{name}: expected 16-byte aligned rows with contiguous columns")
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias: expected ({n},) contiguous, got {tuple(bias.shape)}")
    if not x.is_cuda:
        raise ValueError(f"x: expected a CUDA tensor, got one on {x.device}")
    return m, n


def _launch(kernel, grid: tuple[int, int, int], args: list, x: torch.Tensor,
            smem_bytes: int = 0) -> None:  # fmt: skip
    """On x's device and current stream, by programmatic dependent launch where the decode
    GEMV's switch and the device allow it (models/pdl.py); `smem_bytes`: a norm instance's
    dynamic shared memory (`norm_smem_bytes`)."""
    with torch.cuda.device(x.device):  # the launch goes to the current context's device
        kernel.launch(grid, args, torch.cuda.current_stream(x.device).cuda_stream,
                      programmatic=pdl.decode_gemv(_index(x)), smem_bytes=smem_bytes)  # fmt: skip


# A norm instance's rows of normalized input in dynamic shared memory: at most this much (the
# static partials and sums take the rest of the 48 KiB a launch may use without opting in).
NORM_SMEM_MAX_BYTES = 40 << 10


def norm_smem_bytes(m: int, k: int) -> int:
    """The dynamic shared memory a norm instance needs for m rows of k columns: the GEMV's
    m rows of k / 8 16-byte vectors, the few-row kernel's m rows of k / 8 padded to 4 mod 8
    (skinny_gemm.cu's norm_pitch: conflict-free quarter-warp loads)."""
    if m <= GEMV_MAX_ROWS:
        return m * k * 2
    return m * ((k // 8) | 4) * 16


def _norm_smem(m: int, k: int, norm: NormOperands | None) -> int:
    """A launch's dynamic shared memory (0 without a norm), or a ValueError past the cap."""
    if norm is None:
        return 0
    smem = norm_smem_bytes(m, k)
    if smem > NORM_SMEM_MAX_BYTES:
        raise ValueError(f"norm: {m} rows of {k} columns need {smem} bytes of shared memory, "
                         f"past the norm instances' {NORM_SMEM_MAX_BYTES}")  # fmt: skip
    return smem


def _index(x: torch.Tensor) -> int:
    return x.device.index if x.device.index is not None else torch.cuda.current_device()


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         act: bool = False, norm: NormOperands | None = None) -> torch.Tensor:  # fmt: skip
    """The GEMV kernel itself: x (M <= GEMV_MAX_ROWS, K) and weight (N, K) aligned as
    `uses_gemv` requires, bias (N,) or None -> y (M, N) on the current stream (no sync; allocates
    y; no autograd). Any weight size: the benchmark times it past the dispatch's cap. `act`: x
    is a gate|up output (M, 2K) and the input silu(gate) * up, made on the kernel's load
    (`down_of_silu`). `norm`: the input is rmsnorm(x + residual) (models/norm_linear.py, which
    checks its operands)."""
    m, n = _checked(x, weight, bias, act, (1, GEMV_MAX_ROWS), 8, 1)
    y = x.new_empty(m, n)
    kernel = _kernel(_index(x), m, x.dtype, act, norm is not None)
    smem = _norm_smem(m, weight.shape[1], norm)
    _launch(kernel, (-(-n // ROWS_PER_CTA), 1, 1), launch_args(x, weight, bias, y, norm), x, smem)
    return y


def skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           act: bool = False, norm: NormOperands | None = None) -> torch.Tensor:  # fmt: skip
    """The few-row kernel itself: x (2..SKINNY_MAX_ROWS, K) and weight (N, K) aligned as
    `uses_skinny` requires (K a multiple of 32, N of 16), bias (N,) or None -> y (M, N) on
    the current stream (no sync; allocates y; no autograd). Any weight size: the benchmark
    times it past the dispatch's cap. `act`, `norm`: as `gemv`'s (x (M, 2K), gate|up)."""
    m, n = _checked(x, weight, bias, act, (2, SKINNY_MAX_ROWS), SKINNY_K_MULTIPLE,
                    SKINNY_OUTPUTS_PER_CTA)  # fmt: skip
    y = x.new_empty(m, n)
    kernel = _skinny_kernel(_index(x), skinny_tiles(m), x.dtype, act, norm is not None)
    args = skinny_launch_args(x, weight, bias, y, norm)
    smem = _norm_smem(m, weight.shape[1], norm)
    _launch(kernel, (n // SKINNY_OUTPUTS_PER_CTA, 1, 1), args, x, smem)
    return y


def skinny_tiles(m: int) -> int:
    """The few-row kernel's instance for m rows: the fewest n8 tiles of x rows among the built
    ones (kernels/cuda/variants.py SKINNY_TILE_COUNTS; rows past m read as zeros). 9..16 rows
    take three tiles, not two: on the H100 (21feabf's gemv_bench) two tiles ran 2.2-2.4 us a
    call on tiny-code's shapes at 9 and 16 rows where three ran 1.85-2.0 at 17 (lm_head 2.9-3.1
    both), on every weight measured."""
    from treeverify.kernels.cuda.variants import SKINNY_TILE_COUNTS

    if not 1 <= m <= SKINNY_MAX_ROWS:
        raise ValueError(f"m: expected 1..{SKINNY_MAX_ROWS} rows, got {m}")
    return next(nt for nt in SKINNY_TILE_COUNTS if m <= 8 * nt)


def skinny_launch_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       y: torch.Tensor, norm: NormOperands | None = None) -> list:  # fmt: skip
    """skinny_gemm's parameters in its signature's order (tests/test_gemv.py counts them)."""
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int
    return [
        ptr(x.data_ptr()), i64(x.stride(0)), i32(x.shape[0]),
        ptr(weight.data_ptr()), i64(weight.stride(0)),
        ptr(bias.data_ptr() if bias is not None else 0), ptr(y.data_ptr()), i64(y.stride(0)),
        i32(weight.shape[0]), i32(weight.shape[1]), *_norm_args(norm),
    ]  # fmt: skip


def launch_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                y: torch.Tensor, norm: NormOperands | None = None) -> list:  # fmt: skip
    """decode_gemv's parameters in its signature's order (tests/test_gemv.py counts them)."""
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int
    return [
        ptr(x.data_ptr()), i64(x.stride(0)), ptr(weight.data_ptr()), i64(weight.stride(0)),
        ptr(bias.data_ptr() if bias is not None else 0), ptr(y.data_ptr()), i64(y.stride(0)),
        i32(weight.shape[0]), i32(weight.shape[1]), *_norm_args(norm),
    ]  # fmt: skip


@dataclass(frozen=True)
class NormOperands:
    """What a NORM instance reads and writes besides x and the weight (linear_common.cuh
    NormArgs; models/norm_linear.py checks them): the input is rmsnorm(x + residual) by
    `gamma`; with a residual the sum goes to r_out (and tap's rows, `tap.stride(0)` apart)."""

    residual: torch.Tensor | None  # (M, K) contiguous, or None: the input is rmsnorm(x)
    r_out: torch.Tensor | None  # (M, K) contiguous, with a residual
    tap: torch.Tensor | None  # (M, K) rows strided, columns contiguous
    gamma: torch.Tensor  # (K,) contiguous
    eps: float


def _norm_args(norm: NormOperands | None) -> list:
    """The six trailing parameters of both kernels (zeros but eps's 0.0 for the plain and
    activation instances, which never read them)."""
    ptr, i64 = ctypes.c_void_p, ctypes.c_longlong
    if norm is None:
        return [ptr(0), ptr(0), ptr(0), i64(0), ptr(0), ctypes.c_float(0.0)]

    def addr(t: torch.Tensor | None) -> int:
        return t.data_ptr() if t is not None else 0

    return [ptr(addr(norm.residual)), ptr(addr(norm.r_out)), ptr(addr(norm.tap)),
            i64(norm.tap.stride(0) if norm.tap is not None else 0), ptr(norm.gamma.data_ptr()),
            ctypes.c_float(norm.eps)]  # fmt: skip


def describe() -> str:
    """One line for the startup log and /server_info: which linear path decode rows take."""
    if not enabled():
        return "decode GEMV off (TREEVERIFY_DECODE_GEMV=0, no GPU or no cuda-python): cuBLAS"
    few = (f"2-{skinny_max_rows()} rows x weights <= {SKINNY_MAX_BYTES >> 20} MB few-row kernel"
           if skinny_enabled() else "few-row kernel off (TREEVERIFY_SKINNY_GEMM=0)")  # fmt: skip
    return (f"decode GEMV on: {GEMV_MAX_ROWS} row x weights <= {GEMV_MAX_BYTES >> 20} MB; "
            f"{few}; other linears cuBLAS")  # fmt: skip


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state dict) whose forward is `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
