"""The DFlash drafter's attention on a GPU in a few Triton kernels instead of ~25 PyTorch ones.

A draft is latency-bound: at the tiny-code pair's size each of its ~60 kernels costs 2-4 us in a
captured graph whatever it reads (docs/performance.md, "DFlash draft": 0.21 ms of a 0.62 ms
round, cuDNN's SDPA alone 21 us a layer: 4 CTAs walking 2128 keys one after another). Per layer:

  qk_norm_rope   the fused q|k|v projection's output -> q normed and rotated (B*T, Hq, D), and
                 the block's keys (normed, rotated) and values (B, T, 2, Hkv, D)       (~12 -> 1)
  context_keys_values  a committed row's keys and values for every layer (the rings' rows):
                 per layer the k|v rows of the fused weight in one GEMM, then the same kernel
                 as above with no query heads                                      (~8 -> 2)
  ring_attention the block queries over [the request's ring rows; the block] read in place from
                 the DraftContextCache store (no gather, no concatenation, no bias tensor: a
                 ring row is valid when its age (end - 1 - row) mod W is below the request's
                 count), the held rows split evenly by age so 8 CTAs per (request, KV head)
                 share the walk, then a merge writing (B*T, Hq*D) for o_proj     (~8 + SDPA -> 2)

Every kernel here goes out by programmatic dependent launch where the Triton kernels do
(models/pdl.py, TREEVERIFY_TRITON_PDL: each program waits for the kernel before it as it
starts, then lets the next one launch), so a draft's launches overlap their predecessors' tails.

Scores and softmax stay fp32 (acceptance fell 4.58 -> 3.93 on prose when the scores were
rounded to bf16; see spec/dflash.py), probabilities meet V in bf16 as in SDPA's flash kernel.
The draft's output only steers the tree: verification keeps decoding lossless whatever it
proposes, so these match the PyTorch path within bf16 rounding, not bit for bit
(tests/test_dflash_fused_interpret.py on the CPU interpreter, tests/test_dflash_fused_gpu.py).
`supported` says when they run; every other case takes the PyTorch path in spec/dflash.py.
"""

from __future__ import annotations

import functools
import math

import torch

from treeverify.models import pdl

SPLITS = 8  # CTAs sharing one (request, KV head)'s ring walk; the merge reads all of them
BLOCK_N = 64  # ring rows per tile


@functools.cache
def _kernels():
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    return build_kernels()


def build_kernels():
    """Decorate the kernels (TRITON_INTERPRET=1 set before this call: the CPU interpreter)."""
    import triton
    import triton.language as tl

    # The tree-attention kernels' 16-bit helpers: on the CPU interpreter (IB: bf16 there) a bf16
    # tl.dot multiplies raw bits and casts truncate, so IB takes fp32 dots and rounds first.
    # Module globals: Triton resolves a kernel's callees in its module's namespace.
    global _cast, _mma, _online_tile
    from treeverify.kernels.triton.tree_attention import _cast, _mma

    gdc_wait, gdc_launch_dependents = pdl.gdc()  # PDL's two calls (models/pdl.py)

    @triton.jit
    def _online_tile(q, k, v, ok, m_i, l_i, acc, sm_scale, IB: tl.constexpr):
        # One tile of keys k / values v (rows where `ok`) into the running softmax (m_i, l_i)
        # and output acc of the queries q: fp32 scores, probabilities meet V in v's dtype.
        zero = tl.zeros((q.shape[0], k.shape[0]), tl.float32)
        sc = _mma(q, tl.trans(k), zero, "ieee", IB) * sm_scale
        sc = tl.where(ok[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        p = tl.exp(sc - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        acc = _mma(_cast(p, v.dtype, IB), v, acc * alpha[:, None], "ieee", IB)
        return m_new, l_i * alpha + tl.sum(p, axis=1), acc

    @triton.jit
    def qk_norm_rope_kernel(QKV, QW, KW, C, S, Q, KV, kv_row, hq, hkv, eps,
                            D: tl.constexpr, HALF: tl.constexpr, IB: tl.constexpr,
                            PDL: tl.constexpr):  # fmt: skip
        # One (row, head) per program: heads < hq are queries, then keys, then values; a row's
        # k|v (2, Hkv, D) lands kv_row elements after the previous row's.
        if PDL:  # models/pdl.py: wait for the kernel before, then let the next one start
            gdc_wait()
            gdc_launch_dependents()
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        d = tl.arange(0, D)
        sw = (d + HALF) % D
        src = QKV + t * (hq + 2 * hkv) * D + h * D
        dt = Q.dtype.element_ty
        if h < hq + hkv:
            x = tl.load(src + d).to(tl.float32)
            xs = tl.load(src + sw).to(tl.float32)
            if h < hq:
                w = tl.load(QW + d).to(tl.float32)
                ws = tl.load(QW + sw).to(tl.float32)
            else:
                w = tl.load(KW + d).to(tl.float32)
                ws = tl.load(KW + sw).to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
            n = _cast(x * rstd * w, dt, IB).to(tl.float32)  # RMSNorm rounds once (F.rms_norm)
            ns = _cast(xs * rstd * ws, dt, IB).to(tl.float32)
            c = tl.load(C + t * D + d).to(tl.float32)
            s = tl.load(S + t * D + d).to(tl.float32)
            # x*cos and swap(x)*sin each round, then their sum: apply_rope_tables' three ops
            prod = _cast(n * c, dt, IB).to(tl.float32) + _cast(ns * s, dt, IB).to(tl.float32)
            out = _cast(prod, dt, IB)
            if h < hq:
                tl.store(Q + (t * hq + h) * D + d, out)
            else:
                tl.store(KV + t * kv_row + (h - hq) * D + d, out)
        else:
            v = tl.load(src + d)
            tl.store(KV + t * kv_row + (h - hq) * D + d, v)

    @triton.jit
    def ring_attention_kernel(
        Q, RING, BLK, COUNTS, ENDS, SLOTS, OPART, LPART,
        rows, width, ring_slot_stride, ring_row_stride, layer_off, hkv, sm_scale,
        T: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BT: tl.constexpr,
        BN: tl.constexpr, NS: tl.constexpr, IB: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        # Program (request b, KV head kh) x split s: its query rows are m = t * G + gi (block
        # row t, query head kh * G + gi); split s walks its share of the request's held rows
        # by age (0 = the newest, at ring position end - 1), so a short context spreads over
        # every split instead of the one or two its ring positions fall in (a walk by ring
        # position left one split 3 tiles of a 300-row context); rows at positions >= `rows`
        # are not read. The last split also takes the block's own T keys (always visible).
        if PDL:  # as in qk_norm_rope_kernel
            gdc_wait()
            gdc_launch_dependents()
        bh = tl.program_id(0)
        s = tl.program_id(1)
        b = bh // hkv
        kh = bh % hkv
        m = tl.arange(0, BM)
        d = tl.arange(0, D)
        m_ok = m < T * G
        hq = hkv * G
        q_row = (b * T + m // G).to(tl.int64) * hq + kh * G + m % G  # (BM,)
        q = tl.load(Q + q_row[:, None] * D + d[None, :], mask=m_ok[:, None], other=0.0)
        count = tl.load(COUNTS + b)
        end = tl.load(ENDS + b)
        base = RING + tl.load(SLOTS + b) * ring_slot_stride + layer_off + kh * D
        v_off = hkv * D  # a row's values follow its keys: (2, Hkv, D)
        m_i = tl.full((BM,), -1.0e30, tl.float32)  # finite: a fully masked tile stays NaN-free
        l_i = tl.zeros((BM,), tl.float32)
        acc = tl.zeros((BM, D), tl.float32)
        held = tl.minimum(count, width)  # ages 0 .. held - 1 are in the ring
        chunk = tl.cdiv(tl.cdiv(held, BN), NS) * BN
        lo = s * chunk
        hi = tl.minimum(lo + chunk, held)
        for a0 in range(lo, hi, BN):
            age = a0 + tl.arange(0, BN)
            r = (end - 1 - age + width) % width  # age < width: no negative remainder
            ok = (age < hi) & (r < rows)
            ptr = base + r.to(tl.int64)[:, None] * ring_row_stride + d[None, :]
            k = tl.load(ptr, mask=ok[:, None], other=0.0)
            v = tl.load(ptr + v_off, mask=ok[:, None], other=0.0)
            m_i, l_i, acc = _online_tile(q, k, v, ok, m_i, l_i, acc, sm_scale, IB)
        if s == NS - 1:
            j = tl.arange(0, BT)
            j_ok = j < T
            ptr = BLK + ((b * T + j).to(tl.int64) * 2 * hkv + kh)[:, None] * D + d[None, :]
            k = tl.load(ptr, mask=j_ok[:, None], other=0.0)
            v = tl.load(ptr + v_off, mask=j_ok[:, None], other=0.0)
            m_i, l_i, acc = _online_tile(q, k, v, j_ok, m_i, l_i, acc, sm_scale, IB)
        part = (bh * NS + s).to(tl.int64) * BM + m  # (BM,)
        has = l_i > 0
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        tl.store(OPART + part[:, None] * D + d[None, :], o)
        tl.store(LPART + part, tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf")))

    @triton.jit
    def ring_merge_kernel(OPART, LPART, OUT, hkv,
                          T: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                          NS: tl.constexpr, IB: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
        # Program (request b, KV head kh): the NS splits' partial outputs weighted by their
        # log-sum-exp (the last split always holds the block's keys, so the max is finite).
        if PDL:  # as in qk_norm_rope_kernel
            gdc_wait()
            gdc_launch_dependents()
        bh = tl.program_id(0)
        b = bh // hkv
        kh = bh % hkv
        m = tl.arange(0, BM)
        d = tl.arange(0, D)
        first = (bh * NS).to(tl.int64) * BM
        top = tl.full((BM,), float("-inf"), tl.float32)
        for s in range(NS):
            top = tl.maximum(top, tl.load(LPART + first + s * BM + m))
        acc = tl.zeros((BM, D), tl.float32)
        total = tl.zeros((BM,), tl.float32)
        for s in range(NS):
            w = tl.exp(tl.load(LPART + first + s * BM + m) - top)  # (BM,) 0 for empty splits
            o = tl.load(OPART + (first + s * BM + m)[:, None] * D + d[None, :])
            acc += w[:, None] * o
            total += w
        hq = hkv * G
        row = (b * T + m // G).to(tl.int64) * hq + kh * G + m % G  # (BM,) as the queries
        out = _cast(acc / total[:, None], OUT.dtype.element_ty, IB)
        tl.store(OUT + row[:, None] * D + d[None, :], out, mask=(m < T * G)[:, None])

    return qk_norm_rope_kernel, ring_attention_kernel, ring_merge_kernel


@functools.cache
def _block_kernel():
    """block_rows_kernel, decorated on first use (the interpreter's tests clear this cache)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    gdc_wait, gdc_launch_dependents = pdl.gdc()

    @triton.jit
    def block_rows_kernel(ROOTS, ENDS, EMB, TC, TS, X, C, S, mask_id, hidden, limit,
                          T: tl.constexpr, D: tl.constexpr, BH: tl.constexpr,
                          BD: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
        # Program i = (request b, block row j): the embedding row of the root (j = 0) or the
        # mask token into X's row i, and the rotary tables' rows at position end + j (clamped
        # to the tables, as rope_rows reads them) into C and S: the block's glue in one launch.
        if PDL:  # models/pdl.py: the roots and ends come from the kernels before
            gdc_wait()
            gdc_launch_dependents()
        i = tl.program_id(0).to(tl.int64)
        b = i // T
        j = i % T
        tok = tl.where(j == 0, tl.load(ROOTS + b).to(tl.int64), mask_id)
        h = tl.arange(0, BH)
        mh = h < hidden
        tl.store(X + i * hidden + h, tl.load(EMB + tok * hidden + h, mask=mh), mask=mh)
        p = tl.minimum(tl.maximum(tl.load(ENDS + b).to(tl.int64) + j, 0), limit - 1)
        d = tl.arange(0, BD)
        md = d < D
        tl.store(C + i * D + d, tl.load(TC + p * D + d, mask=md), mask=md)
        tl.store(S + i * D + d, tl.load(TS + p * D + d, mask=md), mask=md)

    return block_rows_kernel


def block_rows(
    weight: torch.Tensor,  # (V, H) the target's embedding table, in the drafter's dtype
    roots: torch.Tensor,  # (B,) int: block position 0's token
    ends: torch.Tensor,  # (B,) int: block position 0's position
    mask_token: int,
    cos_table: torch.Tensor,  # (L, D) Rope.tabulate's, in the drafter's dtype
    sin_table: torch.Tensor,  # (L, D)
    t: int,  # the block size T
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # x (B, T, H), cos2, sin2 (B*T, D)
    """DFlashDrafter._block's outputs by one kernel: the block [root, MASK x (T-1)] embedded and
    the rotary tables' rows at its positions (a fill, a cat, the embedding, an arange, an add and
    rope_rows as torch ops). Copies only: bit-equal to them."""
    import triton

    bsz, (limit, d), hidden = roots.shape[0], cos_table.shape, weight.shape[1]
    roots, ends = roots.contiguous(), ends.contiguous()  # the kernel reads ROOTS + b, ENDS + b
    x = weight.new_empty(bsz, t, hidden)
    cos2, sin2 = cos_table.new_empty(bsz * t, d), sin_table.new_empty(bsz * t, d)
    if bsz:
        _block_kernel()[(bsz * t,)](roots, ends, weight, cos_table, sin_table, x, cos2, sin2,
                                    mask_token, hidden, limit, T=t, D=d,
                                    BH=triton.next_power_of_2(hidden),
                                    BD=triton.next_power_of_2(d),
                                    num_warps=1 if hidden <= 1024 else 4,
                                    **pdl.flags(roots))  # fmt: skip
    return x, cos2, sin2


def _interp_bf16(x: torch.Tensor) -> bool:
    """bf16 on the CPU interpreter (the kernels were decorated with TRITON_INTERPRET=1)."""
    import triton

    return x.dtype == torch.bfloat16 and not isinstance(
        _kernels()[0], triton.runtime.jit.JITFunction
    )


def supported(x: torch.Tensor, head_dim: int, interpret: bool = False) -> bool:
    """The kernels run here: CUDA (or, with `interpret`, the CPU interpreter) bf16/fp16 tensors,
    a power-of-two head_dim >= 16 (tl.dot's smallest tile), and Triton importable."""
    return (
        (x.is_cuda or interpret)
        and x.dtype in (torch.bfloat16, torch.float16)
        and head_dim >= 16
        and head_dim & (head_dim - 1) == 0
        and _kernels() is not None
    )


def qk_norm_rope(
    qkv: torch.Tensor,  # (B*T, Hq + 2 Hkv, D) the fused q|k|v projection of the normed block
    q_norm,  # RMSNorm modules (weight (D,), eps): the per-head q and k norms
    k_norm,
    cos2: torch.Tensor,  # (B*T, D) Rope.rotate_half_tables at the block's positions
    sin2: torch.Tensor,  # (B*T, D)
    hq: int,
    hkv: int,
    batch: int,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,  # (q, k|v) to write (tests poison)
) -> tuple[torch.Tensor, torch.Tensor]:  # q (B*T, Hq, D), block k|v (B, T, 2, Hkv, D)
    rows, heads, d = qkv.shape
    if out is None:
        out = qkv.new_empty(rows, hq, d), qkv.new_empty(batch, rows // batch, 2, hkv, d)
    q, kv = out
    _kernels()[0][(rows, heads)](qkv, q_norm.weight, k_norm.weight, cos2, sin2, q, kv,
                                 2 * hkv * d, hq, hkv, q_norm.eps, D=d, HALF=d // 2,
                                 IB=_interp_bf16(qkv), num_warps=1, **pdl.flags(qkv))  # fmt: skip
    return q, kv


def context_keys_values(
    ctx: torch.Tensor,  # (R, H) projected context rows (fc, hidden_norm)
    layers,  # the drafter's DFlashDecoderLayers, q|k|v fused
    cos2: torch.Tensor,  # (R, D) rotate-half tables at the rows' positions
    sin2: torch.Tensor,  # (R, D)
) -> torch.Tensor:  # (R, n_layers, 2, Hkv, D): every layer's rotated keys and values
    """What `DFlashAttention.keys_values` gives per layer, stacked: per layer one GEMM over the
    fused weight's k|v rows and one kernel (k normed and rotated, v copied) writing its slice."""
    from treeverify.models.gemv import linear

    attn = layers[0].self_attn
    r, hq, hkv, d = ctx.shape[0], attn.hq, attn.hkv, attn.d
    out = ctx.new_empty(r, len(layers), 2, hkv, d)
    kernel = _kernels()[0]
    for i, layer in enumerate(layers):
        a = layer.self_attn
        weight, bias = a.qkv
        kv_w = weight[hq * d :]  # (2 Hkv D, H): the k and v rows, a view
        kv = linear(ctx, kv_w, None if bias is None else bias[hq * d :]).view(r, 2 * hkv, d)
        kernel[(r, 2 * hkv)](kv, a.k_norm.weight, a.k_norm.weight, cos2, sin2, kv, out[:, i],
                             len(layers) * 2 * hkv * d, 0, hkv, a.k_norm.eps, D=d, HALF=d // 2,
                             IB=_interp_bf16(ctx), num_warps=1, **pdl.flags(ctx))  # fmt: skip
    return out


def ring_attention(
    q: torch.Tensor,  # (B*T, Hq, D) the block's queries, normed and rotated
    store: torch.Tensor,  # (slots, W, n_layers, 2, Hkv, D) the DraftContextCache rings
    layer: int,
    meta: torch.Tensor,  # (4, B) int64: rows held per request, roots, ends, ring slots
    rows: int,  # ring rows to walk (the first `rows` of each ring)
    block_kv: torch.Tensor,  # (B, T, 2, Hkv, D) from qk_norm_rope
    sm_scale: float,
    out: torch.Tensor | None = None,  # (B*T, Hq * D) to write (tests poison it)
) -> torch.Tensor:  # (B*T, Hq * D) in q's dtype, heads in order: o_proj's input
    bsz, t, _, hkv, d = block_kv.shape
    hq = q.shape[1]
    g = hq // hkv
    bm = max(16, 1 << math.ceil(math.log2(t * g)))
    bt = max(16, 1 << math.ceil(math.log2(t)))
    if not store.is_contiguous() or store.shape[-1] != d or store.shape[-2] != hkv:
        raise ValueError(f"store: expected contiguous (slots, W, n_layers, 2, {hkv}, {d}), got "
                         f"{tuple(store.shape)}")  # fmt: skip
    counts, ends, slots = meta[0], meta[2], meta[3]  # (B,) each, views with meta's strides
    o_part = q.new_empty(bsz * hkv * SPLITS * bm, d, dtype=torch.float32)
    l_part = q.new_empty(bsz * hkv * SPLITS * bm, dtype=torch.float32)
    out = q.new_empty(bsz * t, hq * d) if out is None else out
    _, attn, merge = _kernels()
    row_stride = store.stride(1)
    attn[(bsz * hkv, SPLITS)](
        q, store, block_kv, counts, ends, slots, o_part, l_part,
        rows, store.shape[1], store.stride(0), row_stride, layer * store.stride(2), hkv, sm_scale,
        T=t, G=g, D=d, BM=bm, BT=bt, BN=BLOCK_N, NS=SPLITS, IB=_interp_bf16(q), num_warps=4,
        **pdl.flags(q),
    )  # fmt: skip
    merge[(bsz * hkv,)](o_part, l_part, out, hkv, T=t, G=g, D=d, BM=bm, NS=SPLITS,
                        IB=_interp_bf16(q), num_warps=4, **pdl.flags(q))  # fmt: skip
    return out
