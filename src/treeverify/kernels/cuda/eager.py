"""Eager (non-captured) CUDA tree attention: sizes read from the arguments, workspace per call."""

from __future__ import annotations

from collections import OrderedDict

import torch

from treeverify.kernels.cuda.launch import Params
from treeverify.kernels.cuda.runner import (
    Launcher,
    check_alignment,
    launcher_flags,
    pool_page_size,
)
from treeverify.kernels.eager import cached, eager_bucket, eager_out

_launchers: OrderedDict[tuple, Launcher] = OrderedDict()  # recent eager buckets


def launcher_for(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    dv: int,
    mla: bool,
    batch: int,
    max_tree: int,
    max_kv: int,
    total_q_cap: int,
) -> Launcher:
    """A Launcher for this exact bucket, reused across calls with the same sizes (small LRU)."""
    key = (
        *launcher_flags(),
        q.device,
        q.dtype,
        q.shape[1],
        k_cache.shape[-2],
        pool_page_size(k_cache),
        q.shape[2],
        dv,
        mla,
        batch,
        max_tree,
        max_kv,
        total_q_cap,
    )
    return cached(
        _launchers,
        key,
        lambda: Launcher(
            device=q.device,
            dtype=q.dtype,
            hq=q.shape[1],
            hkv=k_cache.shape[-2],
            dqk=q.shape[2],
            dv=dv,
            mla=mla,
            max_batch=batch,
            max_tree=max_tree,
            max_kv=max_kv,
            total_q_cap=total_q_cap,
            page_size=pool_page_size(k_cache),
        ),
    )


def tree_attention_cuda(
    q: torch.Tensor,  # (total_q, Hq, Dqk)
    k_cache: torch.Tensor,  # (num_pages, page_size, Hkv, Dqk)
    v_cache: torch.Tensor | None,  # (num_pages, page_size, Hkv, Dv) or None (MLA)
    block_table: torch.Tensor,  # (B, max_pages) int32
    prefix_lens: torch.Tensor,  # (B,) int32
    qo_indptr: torch.Tensor,  # (B+1,) int32
    tree_mask: torch.Tensor,  # (total_q, W) int32
    sm_scale: float,
    *,
    v_head_dim: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Arguments already validated by tree_attention(); this reads two sizes to the host."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t is not None:
            check_alignment(name, t)
    bk = eager_bucket(q, v_cache, v_head_dim, prefix_lens, qo_indptr)
    launcher = launcher_for(q, k_cache, bk.dv, bk.mla, bk.batch, bk.max_tree, bk.max_kv, bk.total_q)
    out = eager_out(q, bk.dv, out)
    check_alignment("out", out)
    params = launcher.fill(
        Params(),
        q=q,
        k=k_cache,
        v=v_cache,
        out=out,
        workspace=launcher.workspace(),
        block_table=block_table.contiguous(),
        prefix_lens=prefix_lens.contiguous(),
        kv_indptr=None,
        qo_indptr=qo_indptr.contiguous(),
        tree_mask=tree_mask.contiguous(),
        sm_scale=sm_scale,
    )
    launcher.launch(params)
    return out
