"""The PyTorch reference for tree_attention: ground truth for every test and backend.

Exact math, plain code: per request, the keys (P_b prefix tokens then T_b tree nodes) are walked
in chunks of ``chunk_size`` tokens gathered from the paged cache, with an online softmax (running
max and sum) accumulated in fp32 (fp64 for fp64 inputs). Query rows are taken in blocks so one
score tile holds at most ``_SCORE_ELEMS`` elements: memory stays bounded at any prefix length.
GQA shares each gathered KV head among its g query heads by viewing q as (T, Hkv, g, D).
Runs on any device torch supports; it is not meant to be fast.
"""

from __future__ import annotations

import torch

from treeverify.kernels.bits import unpack_tree_mask
from treeverify.kernels.validate import validate_tree_attention_args

DEFAULT_CHUNK_SIZE = 4096
_SCORE_ELEMS = 1 << 24  # max elements of one (Hkv, rows * g, chunk) score tile: 64 MiB in fp32


def tree_attention_reference(
    q,
    k_cache,
    v_cache,
    block_table,
    prefix_lens,
    qo_indptr,
    tree_mask,
    sm_scale,
    *,
    v_head_dim=None,
    out=None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    check_data: bool = True,
):
    """tree_attention computed exactly; arguments as ``treeverify.kernels.tree_attention``.

    chunk_size: keys per online-softmax step. check_data=False skips the host-side value checks
    (for callers that already ran them); shape/dtype/device checks always run.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size: expected an int >= 1, got {chunk_size!r}")
    f = validate_tree_attention_args(
        q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, tree_mask, sm_scale,
        v_head_dim=v_head_dim, out=out, check_data=check_data,
    )  # fmt: skip
    if out is None:
        out = torch.empty((f.total_q, f.hq, f.dv), dtype=q.dtype, device=q.device)
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    g = f.group
    rows_per_block = max(1, _SCORE_ELEMS // (f.hq * chunk_size))
    qo = qo_indptr.tolist()
    prefix = prefix_lens.tolist()

    for b in range(f.batch):
        r0, r1, p = qo[b], qo[b + 1], prefix[b]
        t = r1 - r0
        n_kv = p + t
        pages = block_table[b, : -(-n_kv // f.page_size)].long()
        sees = unpack_tree_mask(tree_mask[r0:r1], t)  # (T, T) bool
        qh = q[r0:r1].to(acc_dtype) * sm_scale  # (T, Hq, Dqk)
        qh = qh.view(t, f.hkv, g, f.dqk).permute(1, 0, 2, 3).reshape(f.hkv, t * g, f.dqk)
        run_max = torch.full((f.hkv, t * g), float("-inf"), dtype=acc_dtype, device=q.device)
        run_sum = torch.zeros((f.hkv, t * g), dtype=acc_dtype, device=q.device)
        acc = torch.zeros((f.hkv, t * g, f.dv), dtype=acc_dtype, device=q.device)

        for c0 in range(0, n_kv, chunk_size):
            c1 = min(c0 + chunk_size, n_kv)
            pos = torch.arange(c0, c1, device=q.device)
            page, slot = pages[pos // f.page_size], pos % f.page_size
            k = k_cache[page, slot].to(acc_dtype)  # (n, Hkv, Dqk)
            v = k[..., : f.dv] if v_cache is None else v_cache[page, slot].to(acc_dtype)
            k_t = k.permute(1, 2, 0)  # (Hkv, Dqk, n)
            v = v.permute(1, 0, 2)  # (Hkv, n, Dv)
            visible = None  # (T, n) bool; None: every key in the chunk is prefix
            if c1 > p:
                first_tree = max(c0, p)
                visible = torch.ones((t, c1 - c0), dtype=torch.bool, device=q.device)
                visible[:, first_tree - c0 :] = sees[:, first_tree - p : c1 - p]

            for i0 in range(0, t, rows_per_block):
                i1 = min(i0 + rows_per_block, t)
                rows = slice(i0 * g, i1 * g)
                s = qh[:, rows] @ k_t  # (Hkv, rows * g, n)
                if visible is not None:
                    hidden = ~visible[i0:i1, None, :].expand(i1 - i0, g, c1 - c0)
                    s = s.masked_fill(hidden.reshape(1, (i1 - i0) * g, c1 - c0), float("-inf"))
                # key 0 (prefix token 0, or the root) is visible to every row, so the running
                # max is finite from the first chunk on and exp(-inf - m_new) is 0 for hidden keys
                m_old = run_max[:, rows]
                m_new = torch.maximum(m_old, s.amax(dim=-1))
                scale_old = torch.exp(m_old - m_new)
                probs = torch.exp(s - m_new[..., None])
                run_sum[:, rows] = run_sum[:, rows] * scale_old + probs.sum(dim=-1)
                acc[:, rows] = acc[:, rows] * scale_old[..., None] + probs @ v
                run_max[:, rows] = m_new

        res = acc / run_sum[..., None]  # (Hkv, T * g, Dv); every row sees itself: sum > 0
        res = res.view(f.hkv, t, g, f.dv).permute(1, 0, 2, 3).reshape(t, f.hq, f.dv)
        out[r0:r1] = res.to(out.dtype)
    return out
