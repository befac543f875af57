"""Drop-in for SGLang's Triton `extend_attention_fwd` in target-verify (tree) mode.

Takes SGLang's argument list as it is (facts in shared/design/tree-attention.md): the prefix
comes from the token pool through `kv_indptr`/`kv_indices` (page size 1, int64 slot ids), the
N draft tokens' K/V from `k_extend`/`v_extend`, and the tree from `custom_mask` (per request
row-major [N, prefix+N] bytes at `mask_indptr`, or [N, N] with `skip_prefix_custom_mask`). A
small kernel packs the mask's tree columns into our bit layout, then the tree-verify kernel runs
with its KV addressing switched to SGLang's pool. Capture-safe: the workspace is allocated on
the first call of a shape (outside capture) and reused at fixed addresses afterwards; the grid
depends only on tensor shapes, never on their values.
"""

from __future__ import annotations

import ctypes
import math

import torch

from treeverify.kernels.bits import chain_bits

_workspaces: dict[tuple, _Workspace] = {}


class _Workspace:
    """Fixed-address buffers of one shape: the converted tree bits, the causal-chain bits (built
    once here, so a causal call does no device work of its own), split partials, params."""

    def __init__(self, launcher, batch: int, n: int, device: torch.device):
        from treeverify.kernels.cuda.launch import Params, load
        from treeverify.kernels.cuda.variants import MaskVariant

        self.launcher = launcher
        self.bits = torch.zeros(batch * n, math.ceil(n / 32), dtype=torch.int32, device=device)
        self.causal_bits = chain_bits(n, device).repeat(batch, 1)  # (B*N, W): node i sees 0..i
        self.split = launcher.workspace()  # partials + the fused merge's counters
        self.mask_kernel = load(MaskVariant(), device)
        self.params = Params()


def _workspace(key: tuple, make) -> _Workspace:
    ws = _workspaces.get(key)
    if ws is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "extend_attention_fwd: first call of this shape is inside CUDA graph capture; "
                "run it once eagerly (warmup) so its workspace exists at a fixed address"
            )
        ws = _workspaces[key] = make()
    return ws


def extend_attention_fwd(
    q_extend: torch.Tensor,  # (B*N, Hq, Dqk)
    k_extend: torch.Tensor,  # (B*N, Hkv, Dqk)
    v_extend: torch.Tensor,  # (B*N, Hkv, Dv) (MLA: a view of k_extend[..., :Dv])
    o_extend: torch.Tensor,  # (B*N, Hq, Dv), written
    k_buffer: torch.Tensor,  # (pool_slots, Hkv, Dqk)
    v_buffer: torch.Tensor,  # (pool_slots, Hkv, Dv) (MLA: k_buffer[..., :Dv])
    qo_indptr: torch.Tensor,  # (B+1,) int32, arange(0, (B+1)*N, N)
    kv_indptr: torch.Tensor,  # (B+1,) int32, prefix lengths' cumsum
    kv_indices: torch.Tensor,  # (>= kv_indptr[B],) int64 slot ids of the prefix tokens
    custom_mask: torch.Tensor | None,  # flat uint8/bool, per request [N, P+N] (or [N, N])
    is_causal: bool,
    mask_indptr: torch.Tensor | None,  # (B+1,) int64 offsets of each request's mask
    max_len_extend: int,  # N
    sm_scale: float | None = None,
    logit_cap: float = 0.0,
    skip_prefix_custom_mask: bool = True,
    sliding_window_size: int = -1,
    sinks: torch.Tensor | None = None,
    window_kv_offsets: torch.Tensor | None = None,
    xai_temperature_len: int = -1,
) -> None:
    """SGLang's target-verify attention on our kernel; writes o_extend in place."""
    from treeverify.kernels.cuda.eager import launcher_for
    from treeverify.kernels.cuda.runner import check_alignment

    if logit_cap:
        raise ValueError(f"logit_cap: not supported by treeverify's kernel, got {logit_cap}")
    if sliding_window_size != -1 or window_kv_offsets is not None:
        raise ValueError("sliding_window_size: sliding windows are not supported in tree verify")
    if sinks is not None:
        raise ValueError("sinks: attention sinks are not supported in tree verify")
    if xai_temperature_len != -1:
        raise ValueError("xai_temperature_len: not supported in tree verify")
    if custom_mask is None and not is_causal:
        raise ValueError("custom_mask: required for tree verify (or set is_causal for a chain)")
    if custom_mask is not None and mask_indptr is None:
        raise ValueError("mask_indptr: required with custom_mask")
    for name, t in (
        ("q_extend", q_extend),
        ("k_extend", k_extend),
        ("o_extend", o_extend),
        ("k_buffer", k_buffer),
    ):
        if t.dim() != 3:
            raise ValueError(
                f"{name}: expected a 3-D tensor (tokens, heads, dim), got {tuple(t.shape)}"
            )
        check_alignment(name, t)
    if kv_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"kv_indices: expected int32 or int64, got {kv_indices.dtype}")
    total_q, hq, dqk = q_extend.shape
    batch = qo_indptr.shape[0] - 1
    n = int(max_len_extend)
    if batch < 1 or total_q != batch * n:
        raise ValueError(f"q_extend: expected B*N = {batch}*{n} rows, got {total_q}")
    dv = o_extend.shape[2]
    mla = dqk != dv
    # MLA: V is the first Dv columns of the latent row, read from the K rows once.
    if mla and v_buffer.data_ptr() != k_buffer.data_ptr():
        raise ValueError("v_buffer: for MLA (Dqk != Dv) it must be a view of k_buffer")
    scale = sm_scale if sm_scale is not None else dqk**-0.5
    # Split sizing from shapes only (capture-safe): the pool's index buffer bounds the prefix.
    est_kv = math.ceil(kv_indices.shape[0] / batch) + n
    words = math.ceil(n / 32)
    launcher = launcher_for(q_extend, k_buffer, dv, mla, batch, n, est_kv, total_q)
    # Keyed by the launcher itself: its grid (kernel family, splits, merge) sizes the buffers.
    key = (launcher, total_q, batch, n)
    ws = _workspace(key, lambda: _Workspace(launcher, batch, n, q_extend.device))
    stream = torch.cuda.current_stream(q_extend.device).cuda_stream
    if custom_mask is not None:
        if mask_indptr.dtype != torch.int64:
            raise ValueError(f"mask_indptr: expected int64, got {mask_indptr.dtype}")
        mask = custom_mask if custom_mask.dtype == torch.uint8 else custom_mask.view(torch.uint8)
        args = [
            ctypes.c_void_p(mask.data_ptr()), ctypes.c_void_p(mask_indptr.data_ptr()),
            ctypes.c_void_p(qo_indptr.data_ptr()), ctypes.c_void_p(kv_indptr.data_ptr()),
            ctypes.c_void_p(ws.bits.data_ptr()), ctypes.c_int(batch), ctypes.c_int(words),
            ctypes.c_int(total_q),
        ]  # fmt: skip
        ws.mask_kernel.launch((total_q, 1, 1), args, stream)
    launcher.fill(
        ws.params, q=q_extend, k=k_buffer, v=None if mla else v_buffer, out=o_extend,
        workspace=ws.split, block_table=kv_indices, prefix_lens=None,
        kv_indptr=kv_indptr, qo_indptr=qo_indptr,
        tree_mask=ws.bits if custom_mask is not None else ws.causal_bits, sm_scale=scale,
        k_ext=k_extend, v_ext=None if mla else v_extend,
    )  # fmt: skip
    launcher.launch(ws.params)
