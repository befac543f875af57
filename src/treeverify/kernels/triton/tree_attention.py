"""Tree-verify attention in Triton: one forward kernel (split-KV) and one merge kernel.

Version log (geomean = % of the roofline floor over shared/bench/cases.json on one H200,
CUDA-graph replay, median; see docs/performance.md for the runs):
  v1  Port of the CUDA v1 algorithm. Rows = (tree node, q head) packed per KV head (row r of
      (request b, KV head h) = node r // G, query head h*G + r % G), so one KV tile load serves
      every query head of the group and every node of the m-tile. Grid (m_tiles, max_splits,
      batch*Hkv) fixed from plan-time capacities; each program reads qo_indptr / prefix_lens on
      the device and exits when its m-tile or split is empty (capture-safe). Split rule shared
      with the CUDA kernel (splits.py). Prefix tiles run unmasked; tail tiles read the packed
      tree mask and stop at the tile's last node (topological order). Online softmax in the log2
      domain (exp2, sm_scale*log2(e)), fp32 accumulation, tl.dot for QK and PV. One split:
      the output is written directly; several: fp32 partial O (normalised) + log2 LSE, merged
      by a second kernel. MLA: the 512 latent and the 64 rope columns of a K row are loaded as
      two tiles of the same rows, and the 512-column tile *is* V (each latent row read once).
      Spill-free tiles from compiling for sm_90, not yet timed.     22.6% (a44145d)
  v2  Tiles chosen by an H200 sweep (scripts/triton_sweep.py): MLA 64x32/8 warps/2 stages,
      GQA 128x64/8/3 (>= 128 rows per KV head) and 64x64/4/3 (fewer). Predicted "a few points";
      measured +2.6.                                                  25.2% (f3b280c + sweep)

This module decorates its kernels at import: set TRITON_INTERPRET=1 *before* importing it to
run them on the CPU interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _mma(a, b, acc, PREC: tl.constexpr, INTERP_BF16: tl.constexpr):
    """acc + a @ b. INTERP_BF16 (CPU interpreter only: its bf16 dot multiplies the raw bits):
    the same products in fp32 from the already-rounded 16-bit operands."""
    if INTERP_BF16:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        r = tl.dot(a, b, acc, input_precision=PREC)
    return r


@triton.jit
def _cast(x, dtype: tl.constexpr, INTERP_BF16: tl.constexpr):
    """x.to(dtype). The CPU interpreter truncates fp32 -> bf16 where the GPU rounds to nearest
    even, so under INTERP_BF16 round the fp32 bits first (then truncation is exact)."""
    if INTERP_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        r = bits.to(tl.float32, bitcast=True).to(dtype)
    else:
        r = x.to(dtype)
    return r


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    q,
    q_r,
    t0,
    K,
    V,
    BlockTable,
    TreeMask,
    bt_row,
    mask_row,
    row_ok,
    kvh,
    P,
    kv_stop,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    scale_log2,
    PAGE_SIZE: tl.constexpr,
    DV: tl.constexpr,
    DR: tl.constexpr,
    V_FROM_K: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
    INTERP_BF16: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One KV tile [t0, t0+BN): S = QK^T, (mask), online softmax update, O += PV."""
    offs_n = t0 + tl.arange(0, BN)
    offs_d = tl.arange(0, DV)
    col_ok = offs_n < kv_stop
    if MASKED:
        page = tl.load(BlockTable + bt_row + offs_n // PAGE_SIZE, mask=col_ok, other=0)
    else:
        page = tl.load(BlockTable + bt_row + offs_n // PAGE_SIZE)
    slot = offs_n % PAGE_SIZE
    page = page.to(tl.int64)
    k_row = page * stride_kp + slot * stride_ks + kvh * stride_kh
    if MASKED:
        k = tl.load(K + k_row[:, None] + offs_d[None, :], mask=col_ok[:, None], other=0.0)
    else:
        k = tl.load(K + k_row[:, None] + offs_d[None, :])
    s = _mma(q, tl.trans(k), None, PREC, INTERP_BF16)
    if DR > 0:
        offs_r = DV + tl.arange(0, DR)
        if MASKED:
            k_r = tl.load(K + k_row[:, None] + offs_r[None, :], mask=col_ok[:, None], other=0.0)
        else:
            k_r = tl.load(K + k_row[:, None] + offs_r[None, :])
        s = _mma(q_r, tl.trans(k_r), s, PREC, INTERP_BF16)
    s = s * scale_log2
    if MASKED:
        j = offs_n - P  # tree node of each column (negative: prefix)
        is_tree = j >= 0
        jj = tl.maximum(j, 0)
        word = tl.load(
            TreeMask + mask_row[:, None] + (jj // 32)[None, :],
            mask=row_ok[:, None] & (is_tree & col_ok)[None, :],
            other=0,
        )
        bit = (word >> (jj % 32)[None, :]) & 1
        visible = col_ok[None, :] & ((j < 0)[None, :] | (bit != 0))
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if V_FROM_K:
        v = k  # MLA: V is the first DV columns of the very same latent rows
    else:
        v_row = page * stride_vp + slot * stride_vs + kvh * stride_vh
        if MASKED:
            v = tl.load(V + v_row[:, None] + offs_d[None, :], mask=col_ok[:, None], other=0.0)
        else:
            v = tl.load(V + v_row[:, None] + offs_d[None, :])
    acc = _mma(_cast(p, v.dtype, INTERP_BF16), v, acc, PREC, INTERP_BF16)
    return acc, m_new, l_i


@triton.jit
def _split_chunk(PrefixLens, QoIndptr, batch, kv_total, max_splits, chunk, balance_div,
                 BLOCK_B: tl.constexpr):  # fmt: skip
    """KV keys per split of a request with kv_total keys (kernels/splits.py's rule). BLOCK_B:
    lanes of the balanced rule's batch sum (a power of two >= batch), 0 for a plan that does
    not balance, which then compiles none of it: evaluated by every CTA (v12), the sum took the
    MLA forward's register spills under Triton 3.6 from 288 to 1236 bytes (sm_90, aot_check)."""
    c = tl.maximum(chunk, (kv_total + max_splits - 1) // max_splits)
    if BLOCK_B > 0:  # no split shorter than the batch's keys / balance_div
        offs = tl.arange(0, BLOCK_B)
        prefixes = tl.load(PrefixLens + offs, mask=offs < batch, other=0)
        kv_batch = tl.sum(prefixes, 0) + tl.load(QoIndptr + batch) - tl.load(QoIndptr)
        c = tl.maximum(c, (kv_batch + balance_div - 1) // balance_div)
    return (c + chunk - 1) // chunk * chunk  # whole units


@triton.jit
def tree_attn_fwd(
    Q,
    K,
    V,
    Out,
    PartO,
    PartLse,
    BlockTable,
    PrefixLens,
    QoIndptr,
    TreeMask,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_mask,
    hq,
    hkv,
    max_splits,
    chunk,
    batch,
    balance_div,
    total_q_cap,
    scale_log2,
    G: tl.constexpr,
    BLOCK_B: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DV: tl.constexpr,
    DR: tl.constexpr,
    V_FROM_K: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
    INTERP_BF16: tl.constexpr,
):
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    pid_z = tl.program_id(2)
    b = pid_z // hkv
    kvh = pid_z % hkv
    qo0 = tl.load(QoIndptr + b)
    T = tl.load(QoIndptr + b + 1) - qo0
    P = tl.load(PrefixLens + b)
    rows = T * G
    m0 = pid_m * BM
    kv_total = P + T
    chunk_b = _split_chunk(PrefixLens, QoIndptr, batch, kv_total, max_splits, chunk, balance_div,
                           BLOCK_B)  # fmt: skip
    n_splits = tl.maximum(1, (kv_total + chunk_b - 1) // chunk_b)
    if (m0 >= rows) | (split >= n_splits):
        return
    # Topological order: the rows of this tile see tree columns < node_hi only.
    node_hi = tl.minimum(T, (m0 + BM - 1) // G + 1)
    kv_begin = split * chunk_b
    kv_stop = tl.minimum(P + node_hi, kv_begin + chunk_b)
    # Tiles entirely below min(P, kv_stop) are prefix: no mask, no bounds.
    n_full = tl.maximum(0, tl.minimum(P, kv_stop) - kv_begin) // BN
    full_end = kv_begin + n_full * BN

    offs_m = m0 + tl.arange(0, BM)
    row_ok = offs_m < rows
    node = tl.where(row_ok, offs_m // G, 0)
    head = kvh * G + offs_m % G
    tok = (qo0 + node).to(tl.int64)
    q_row = tok * stride_qt + head * stride_qh
    offs_d = tl.arange(0, DV)
    q = tl.load(Q + q_row[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    if DR > 0:
        offs_r = DV + tl.arange(0, DR)
        q_r = tl.load(Q + q_row[:, None] + offs_r[None, :], mask=row_ok[:, None], other=0.0)
    else:
        q_r = q  # unused
    bt_row = b.to(tl.int64) * stride_bt
    mask_row = tok * stride_mask

    acc = tl.zeros([BM, DV], dtype=tl.float32)
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    for t0 in range(kv_begin, full_end, BN):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, q_r, t0, K, V, BlockTable, TreeMask, bt_row, mask_row, row_ok,
            kvh, P, kv_stop, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            scale_log2, PAGE_SIZE, DV, DR, V_FROM_K, BN, PREC, INTERP_BF16, False,
        )  # fmt: skip
    for t0 in range(full_end, kv_stop, BN):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, q_r, t0, K, V, BlockTable, TreeMask, bt_row, mask_row, row_ok,
            kvh, P, kv_stop, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            scale_log2, PAGE_SIZE, DV, DR, V_FROM_K, BN, PREC, INTERP_BF16, True,
        )  # fmt: skip

    inv = tl.where(l_i > 0.0, 1.0 / tl.where(l_i > 0.0, l_i, 1.0), 0.0)
    o = acc * inv[:, None]
    if n_splits == 1:
        o_row = tok * stride_ot + head * stride_oh
        tl.store(
            Out + o_row[:, None] + offs_d[None, :],
            _cast(o, Out.dtype.element_ty, INTERP_BF16),
            mask=row_ok[:, None],
        )
    else:
        # An empty split (no visible column for this tile) writes O = 0 and LSE = -inf.
        prow = (split.to(tl.int64) * total_q_cap + tok) * hq + head
        tl.store(PartO + prow[:, None] * DV + offs_d[None, :], o, mask=row_ok[:, None])
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(PartLse + prow, lse, mask=row_ok)


@triton.jit
def tree_attn_merge(
    Out,
    PartO,
    PartLse,
    PrefixLens,
    QoIndptr,
    stride_ot,
    stride_oh,
    batch,
    hq,
    max_splits,
    chunk,
    balance_div,
    total_q_cap,
    DV: tl.constexpr,
    BLOCK_B: tl.constexpr,
    LOG_B: tl.constexpr,
    INTERP_BF16: tl.constexpr,
):
    """One program per (token, head): combine the split partials of split requests."""
    tok = tl.program_id(0)
    head = tl.program_id(1)
    total_q = tl.load(QoIndptr + batch)
    # Request of this token: the last b with qo_indptr[b] <= tok (fixed-trip binary search).
    lo = tok * 0
    hi = lo + batch - 1
    for _ in tl.static_range(LOG_B):
        mid = (lo + hi + 1) // 2
        go = tl.load(QoIndptr + mid) <= tok
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid - 1)
    b = lo
    T = tl.load(QoIndptr + b + 1) - tl.load(QoIndptr + b)
    kv_total = tl.load(PrefixLens + b) + T
    chunk_b = _split_chunk(PrefixLens, QoIndptr, batch, kv_total, max_splits, chunk, balance_div,
                           BLOCK_B)  # fmt: skip
    n = tl.maximum(1, (kv_total + chunk_b - 1) // chunk_b)
    if (tok >= total_q) | (n == 1):
        return  # padding row, or the forward kernel wrote the final output
    stride = total_q_cap * hq  # (scalar args equal to 1 arrive as constexprs: no .to() here)
    base = tok.to(tl.int64) * hq + head
    lmax = tl.full([], float("-inf"), dtype=tl.float32)
    for s in range(0, n):
        lmax = tl.maximum(lmax, tl.load(PartLse + base + s * stride))
    lmax = tl.where(lmax == float("-inf"), 0.0, lmax)
    offs_d = tl.arange(0, DV)
    acc = tl.zeros([DV], dtype=tl.float32)
    wsum = tl.zeros([], dtype=tl.float32)
    for s in range(0, n):
        row = base + s * stride  # int64 (base is)
        lse = tl.load(PartLse + row)
        w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - lmax))
        part = tl.load(PartO + row * DV + offs_d)
        acc += tl.where(w > 0.0, w * part, 0.0)
        wsum += w
    inv = tl.where(wsum > 0.0, 1.0 / tl.where(wsum > 0.0, wsum, 1.0), 0.0)
    tl.store(
        Out + tok.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
        _cast(acc * inv, Out.dtype.element_ty, INTERP_BF16),
    )
