"""tree_attention: the public eager entry point. Validates on the host, then dispatches.

Backends: "torch" (the reference, any device and dtype), "cuda" (treeverify.kernels.cuda, fp16/bf16
on an NVIDIA GPU), "triton" (treeverify.kernels.triton: fp16/bf16/fp32 on a GPU, or on the CPU
under TRITON_INTERPRET=1), "auto" (cuda when it applies and imports, else torch).
"""

from __future__ import annotations

import functools

import torch

from treeverify.kernels.reference import tree_attention_reference
from treeverify.kernels.validate import validate_tree_attention_args

BACKENDS = ("auto", "torch", "cuda", "triton")
_CUDA_DTYPES = (torch.float16, torch.bfloat16)


def cuda_backend():
    """The cuda backend's entry point; RuntimeError saying why when it cannot be imported."""
    try:
        from treeverify.kernels.cuda import tree_attention_cuda
    except ImportError as exc:
        raise RuntimeError(
            f"tree_attention: the cuda backend is unavailable: importing "
            f"treeverify.kernels.cuda.tree_attention_cuda failed ({type(exc).__name__}: {exc}). "
            f"It needs the 'cuda' extra (pip install 'treeverify[cuda]') and an NVIDIA GPU; "
            f"backend='torch' runs everywhere."
        ) from exc
    return tree_attention_cuda


def triton_backend():
    """The triton backend's entry point; RuntimeError saying why when it cannot be imported."""
    try:
        from treeverify.kernels.triton import tree_attention_triton
    except ImportError as exc:
        raise RuntimeError(
            f"tree_attention: the triton backend is unavailable: importing "
            f"treeverify.kernels.triton failed ({type(exc).__name__}: {exc}). It needs "
            f"triton >= 3.6 (pip install 'treeverify[triton]'); backend='torch' runs everywhere."
        ) from exc
    return tree_attention_triton


@functools.cache
def triton_available() -> bool:
    """True when triton imports: the compiler of the Triton backend and of the fused model and
    draft kernels, each of which keeps its PyTorch path without it."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def cuda_backend_available() -> bool:
    """True when treeverify.kernels.cuda imports (it does not prove a GPU is present)."""
    try:
        cuda_backend()
    except RuntimeError:
        return False
    return True


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """The concrete backend ("torch", "cuda" or "triton") a call with these inputs would use."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend != "auto":
        return backend
    if torch.device(device).type == "cuda" and dtype in _CUDA_DTYPES and cuda_backend_available():
        return "cuda"
    return "torch"


def tree_attention(
    q,  # (total_q, Hq, Dqk)
    k_cache,  # (num_pages, page_size, Hkv, Dqk)
    v_cache,  # (num_pages, page_size, Hkv, Dv), or None for MLA: V = k_cache[..., :v_head_dim]
    block_table,  # (B, max_pages) int32
    prefix_lens,  # (B,) int32
    qo_indptr,  # (B+1,) int32
    tree_mask,  # (total_q, W) int32, bit j of word j//32 of row r: node j visible to row r
    sm_scale: float,
    *,
    v_head_dim: int | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:  # (total_q, Hq, Dv), q.dtype
    """Tree-verify attention: ``out = softmax(q·Kᵀ·sm_scale + tree mask)·V`` per request.

    Request b's rows ``q[qo_indptr[b]:qo_indptr[b+1]]`` are its T_b tree nodes; node i sits in the
    cache at logical position P_b + i (page ``block_table[b, (P_b+i)//page_size]``) and sees all
    P_b prefix tokens plus the nodes whose bits are set in its mask row. Accumulates in fp32,
    returns q's dtype; with ``out=`` writes there and returns it. Bad input raises ValueError
    naming the argument (this eager entry reads the index tensors to the host to check them).
    """
    chosen = resolve_backend(backend, q.device, q.dtype) if isinstance(q, torch.Tensor) else None
    validate_tree_attention_args(
        q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, tree_mask, sm_scale,
        v_head_dim=v_head_dim, out=out, check_data=True,
    )  # fmt: skip
    if chosen == "torch":
        return tree_attention_reference(
            q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, tree_mask, sm_scale,
            v_head_dim=v_head_dim, out=out, check_data=False,
        )  # fmt: skip
    if chosen == "cuda":
        if q.device.type != "cuda":
            raise ValueError(f"backend: 'cuda' needs tensors on a CUDA device, got q on {q.device}")
        return cuda_backend()(
            q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, tree_mask, sm_scale,
            v_head_dim=v_head_dim, out=out,
        )  # fmt: skip
    return triton_backend()(
        q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, tree_mask, sm_scale,
        v_head_dim=v_head_dim, out=out,
    )  # fmt: skip
