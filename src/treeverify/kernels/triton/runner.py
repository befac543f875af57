"""Launching the Triton kernels: tile config, split policy, capture-safe launcher, eager entry.

`TritonTreeAttention` is built once per problem family and bucket: it fixes the tile config, the
split policy and both grids from capacities only. `launch()` issues the forward kernel (and the
merge kernel when a request can be split) on the current stream: no allocation, no `.item()`,
no data-dependent grid, so it can be captured in a CUDA graph and replayed after the metadata
buffers were rewritten in place.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import torch
import triton

from treeverify.kernels.eager import cached, eager_bucket, eager_buffers
from treeverify.kernels.splits import SplitPolicy, choose_splits
from treeverify.kernels.triton.tree_attention import tree_attn_fwd, tree_attn_merge

LOG2E = 1.4426950408889634
DEFAULT_NUM_SMS = 132  # an H100/H200; used when the device is not a CUDA GPU (interpreter)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# TRITON_INTERPRET=1 at import made the kernels InterpretedFunctions instead of JITFunctions.
INTERPRETED = not isinstance(tree_attn_fwd, triton.runtime.jit.JITFunction)


@dataclass(frozen=True)
class TritonConfig:
    bm: int  # packed (node, head) rows per program
    bn: int  # KV tokens per tile
    num_warps: int
    num_stages: int


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def choose_config(
    *, hq: int, hkv: int, dqk: int, dv: int, mla: bool, max_tree: int, dtype: torch.dtype
) -> TritonConfig:
    """Tiles per problem family, chosen by scripts/triton_sweep.py on the H200 (2026-11-29,
    bench_results/2026-11-29-h200-triton-sweep.json; grid with these: triton-v2-grid.json):
    - MLA (and Dv >= 256): 64 x 32, 8 warps, 2 stages. 64 rows because the 64 x 512 fp32
      accumulator is already 128 registers/thread at 8 warps; 2 stages ran as fast as 3 and a
      16-token tile 1.7x slower.
    - GQA with >= 128 packed rows per KV head: 128 x 64, 8 warps, 3 stages (1.37x over 128 x 32).
    - GQA with fewer rows (small trees, memory-bound): 64 x 64, 4 warps, 3 stages (1.55x over 8
      warps: more CTAs per SM in flight).
    BM never exceeds the next power of two of max_tree*G (tl.dot needs >= 16; below 64 rows
    Triton uses mma.sync, not wgmma). fp32 inputs (a correctness path, not a target) take 16-32
    row tiles and 3xTF32 dots (~fp32 accuracy).
    """
    rows = max_tree * (hq // hkv)
    if dtype == torch.float32:  # a correctness path: small tiles, few spills
        bm_max = 64 if (mla or dv >= 256) else 128
        bm = min(bm_max, max(16, _next_pow2(rows)))
        return TritonConfig(min(bm, 16 if (mla or dv >= 256) else 32), 16, 8, 2)
    if mla or dv >= 256:
        bm, bn, warps, stages = 64, 32, 8, 2
    elif rows >= 128:
        bm, bn, warps, stages = 128, 64, 8, 3
    else:
        bm, bn, warps, stages = 64, 64, 4, 3
    bm = min(bm, max(16, _next_pow2(rows)))
    return TritonConfig(bm, bn, warps if bm >= 64 else 4, stages)


def _paged_strides(cache: torch.Tensor) -> tuple[int, int, int]:
    """(page, slot, head) element strides of a (pages, page_size, H, D) or (slots, H, D) pool."""
    if cache.dim() == 4:
        return cache.stride(0), cache.stride(1), cache.stride(2)
    return cache.stride(0), 0, cache.stride(1)


class TritonTreeAttention:
    """Capture-safe Triton tree attention for one bucket of capacities."""

    def __init__(
        self,
        hq: int,
        hkv: int,
        dqk: int,
        dv: int,
        mla: bool,
        max_batch: int,
        max_tree: int,
        max_kv: int,
        total_q_cap: int,
        device: torch.device | str,
        dtype: torch.dtype,
        *,
        splits: SplitPolicy | None = None,  # e.g. the CUDA launcher's, to share one plan
        config: TritonConfig | None = None,  # override the tile choice (tuning sweeps)
        num_sms: int | None = None,
    ):
        if hq % hkv:
            raise ValueError(f"hq: expected a multiple of hkv={hkv}, got {hq}")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype: the triton backend takes fp16, bf16 or fp32, got {dtype}")
        dr = dqk - dv
        if dv < 16 or dv & (dv - 1):
            raise ValueError(f"dv: the triton backend needs a power of two >= 16, got {dv}")
        if mla:
            if dr < 16 or dr & (dr - 1):
                raise ValueError(
                    f"dqk: MLA needs dqk - dv to be a power of two >= 16 (576 - 512 = 64), "
                    f"got dqk={dqk}, dv={dv}"
                )
        elif dr:
            raise ValueError(f"dqk: GQA needs dqk == dv, got dqk={dqk}, dv={dv}")
        self.device = torch.device(device)
        if self.device.type != "cuda" and not INTERPRETED:
            raise ValueError(
                f"device: the triton backend runs on CUDA devices, got {self.device}; for the "
                f"CPU interpreter set TRITON_INTERPRET=1 before treeverify.kernels.triton loads"
            )
        self.dtype = dtype
        self.hq, self.hkv, self.dqk, self.dv, self.dr, self.mla = hq, hkv, dqk, dv, dr, mla
        self.group = hq // hkv
        self.max_batch, self.max_tree, self.max_kv = max_batch, max_tree, max_kv
        self.total_q_cap = total_q_cap
        self.config = config or choose_config(
            hq=hq, hkv=hkv, dqk=dqk, dv=dv, mla=mla, max_tree=max_tree, dtype=dtype
        )
        self.m_tiles = math.ceil(max_tree * self.group / self.config.bm)
        if num_sms is None:
            num_sms = (
                torch.cuda.get_device_properties(self.device).multi_processor_count
                if self.device.type == "cuda"
                else DEFAULT_NUM_SMS
            )
        ctas_per_sm = 1 if (mla or self.config.bm >= 128 or dv >= 256) else 2  # by smem/regs
        self.splits = splits or choose_splits(
            batch=max_batch,
            hkv=hkv,
            m_tiles=self.m_tiles,
            max_kv=max_kv,
            bn=self.config.bn,
            num_sms=num_sms,
            ctas_per_sm=ctas_per_sm,
        )
        self.grid = (self.m_tiles, self.splits.max_splits, max_batch * hkv)
        self.merge_grid = (total_q_cap, hq)
        self.log_b = max(1, max_batch.bit_length())
        # Lanes of the balanced rule's batch sum: a power of two >= max_batch; 0 where the plan
        # does not balance (the kernels then compile no batch sum: tree_attention._split_chunk).
        self.block_b = max(16, triton.next_power_of_2(max_batch)) if self.splits.balance_div else 0
        self.prec = "tf32x3" if dtype == torch.float32 else "tf32"  # 16-bit: ignored
        # The CPU interpreter's bf16 tl.dot multiplies raw uint16 bits and its casts truncate.
        self.interp_bf16 = INTERPRETED and dtype == torch.bfloat16

    def workspace_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """fp32 partial O and log2-LSE shapes (1 element each when no request can be split)."""
        s = self.splits.max_splits
        if s == 1:
            return (1,), (1,)
        return (s, self.total_q_cap, self.hq, self.dv), (s, self.total_q_cap, self.hq)

    def launch(
        self,
        q: torch.Tensor,  # (rows <= total_q_cap, Hq, Dqk)
        k_cache: torch.Tensor,  # (pages, page_size, Hkv, Dqk) or (slots, Hkv, Dqk)
        v_cache: torch.Tensor | None,  # like k_cache with Dv, or None (MLA)
        out: torch.Tensor,  # (rows, Hq, Dv)
        block_table: torch.Tensor,  # (>= max_batch, pages) int32
        prefix_lens: torch.Tensor,  # (>= max_batch,) int32, contiguous
        qo_indptr: torch.Tensor,  # (max_batch + 1,) int32, contiguous
        tree_mask: torch.Tensor,  # (>= total_q, W) int32
        part_o: torch.Tensor,  # workspace_shapes()[0], fp32, contiguous
        part_lse: torch.Tensor,  # workspace_shapes()[1], fp32, contiguous
        sm_scale: float,
    ) -> None:
        """Launch only: every size and stride is host metadata; the grid is fixed."""
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
            if t is not None and t.stride(-1) != 1:
                raise ValueError(f"{name}: the triton backend needs a contiguous last dimension")
        if block_table.stride(-1) != 1 or tree_mask.stride(-1) != 1:
            raise ValueError("block_table, tree_mask: need a contiguous last dimension")
        cfg = self.config
        kp = _paged_strides(k_cache)
        vc = k_cache if v_cache is None else v_cache
        vp = _paged_strides(vc)
        page_size = k_cache.shape[1] if k_cache.dim() == 4 else 1
        scale_log2 = float(sm_scale) * LOG2E
        ms, chunk = self.splits.max_splits, self.splits.chunk
        tree_attn_fwd[self.grid](
            q, k_cache, vc, out, part_o, part_lse, block_table, prefix_lens, qo_indptr,
            tree_mask, q.stride(0), q.stride(1), *kp, *vp, out.stride(0), out.stride(1),
            block_table.stride(0), tree_mask.stride(0), self.hq, self.hkv, ms, chunk,
            self.max_batch, self.splits.balance_div, self.total_q_cap, scale_log2,
            G=self.group, BLOCK_B=self.block_b, PAGE_SIZE=page_size, DV=self.dv, DR=self.dr,
            V_FROM_K=v_cache is None,
            BM=cfg.bm, BN=cfg.bn, PREC=self.prec, INTERP_BF16=self.interp_bf16,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        if ms > 1:
            tree_attn_merge[self.merge_grid](
                out, part_o, part_lse, prefix_lens, qo_indptr, out.stride(0), out.stride(1),
                self.max_batch, self.hq, ms, chunk, self.splits.balance_div, self.total_q_cap,
                DV=self.dv, BLOCK_B=self.block_b, LOG_B=self.log_b, INTERP_BF16=self.interp_bf16,
                num_warps=4 if self.dv >= 256 else 2,
            )  # fmt: skip


_runners: OrderedDict[tuple, TritonTreeAttention] = OrderedDict()


def runner_for(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    dv: int,
    mla: bool,
    batch: int,
    max_tree: int,
    max_kv: int,
    total_q_cap: int,
) -> TritonTreeAttention:
    """A TritonTreeAttention for this exact bucket, reused across eager calls (small LRU)."""
    key = (q.device, q.dtype, q.shape[1], k_cache.shape[-2], q.shape[2], dv, mla, batch,
           max_tree, max_kv, total_q_cap)  # fmt: skip
    return cached(
        _runners,
        key,
        lambda: TritonTreeAttention(
            q.shape[1],
            k_cache.shape[-2],
            q.shape[2],
            dv,
            mla,
            batch,
            max_tree,
            max_kv,
            total_q_cap,
            q.device,
            q.dtype,
        ),  # fmt: skip
    )


def tree_attention_triton(
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
    """Eager Triton tree attention. Arguments already validated by tree_attention(); this reads
    the largest tree and the longest key range to the host and allocates the workspace."""
    bk = eager_bucket(q, v_cache, v_head_dim, prefix_lens, qo_indptr)
    runner = runner_for(q, k_cache, bk.dv, bk.mla, bk.batch, bk.max_tree, bk.max_kv, bk.total_q)
    out, part_o, part_lse = eager_buffers(q, bk.dv, out, runner.workspace_shapes())
    runner.launch(
        q, k_cache, v_cache, out, block_table.contiguous(), prefix_lens.contiguous(),
        qo_indptr.contiguous(), tree_mask.contiguous(), part_o, part_lse, sm_scale,
    )  # fmt: skip
    return out
