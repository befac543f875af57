"""The launch sequence of the CUDA backend: split policy, parameter filling, fwd + merge.

`Launcher` is built once per problem family and bucket (at plan time or once per eager call):
it compiles/loads the variants, fixes the grid and the split policy, and owns nothing that
changes per step. `Launcher.fill()` writes tensor addresses and strides into a ctypes struct,
and `Launcher.launch()` issues the forward (and the merge kernel, for plans where some split tile
can be too large to merge in the forward: split_merge.cuh) on the current stream: no
allocation, no sync. `Launcher.workspace()` makes the buffers one plan keeps at fixed
addresses: split partials and the row-tile counters of the merge in the forward (zero between
launches: the kernel resets each after use).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch

from treeverify import env
from treeverify.kernels.cuda import tma
from treeverify.kernels.cuda.launch import Params, device_arch, load, scale_log2
from treeverify.kernels.cuda.variants import (
    MERGE_SPLIT_LANES_ARCHES,
    GqaSm90Variant,
    MlaSm90Variant,
    fwd_variant,
    gqa_wide_pays,
    merge_variant,
)
from treeverify.kernels.split_arena import SplitArena
from treeverify.kernels.splits import (
    LONGEST_FIRST_MAX_BATCH,
    balance_pays,
    choose_splits,
    merge_heads_per_cta,
    merge_kernel_needed,
    plan_merge_limit,
    split_lanes_pay,
)


class SplitWorkspace(NamedTuple):
    part_o: torch.Tensor  # (max_splits, total_q_cap, Hq, Dv) fp32, or empty when never split;
    # the persistent GQA kernel: (2 slots x CTAs x 128 rows, Dv)
    part_lse: torch.Tensor  # (max_splits, total_q_cap, Hq) fp32, or empty; persistent: (slots,)
    counters: torch.Tensor  # (m_tiles * max_batch * Hkv,) int32 zeros, or empty: merge kernel


def launcher_flags() -> tuple:
    """Every environment flag a Launcher reads when it is made (kernel choice, splits, merge,
    launch mode): what a cache of launchers must key on, so that a flag changed between calls
    (tests, A/B runs) gets a launcher built under it rather than one made under the old value."""
    return (
        env.cuda_portable(),
        env.cuda_mla_schedule(),
        env.cuda_gqa_schedule(),
        env.cuda_gqa_q_regs(),
        env.cuda_gqa_256(),
        env.cuda_split_balance(),
        env.cuda_split_share(),
        env.cuda_max_splits(),
        env.cuda_tma_min_page(),
        env.cuda_merge_max_ctas(),
        env.cuda_split_merge(),
        env.cuda_pdl(),
        env.cuda_merge_ilp(),
        env.cuda_merge_wide(),
        env.cuda_fused_merge_ilp(),
        env.cuda_split_order(),
        env.cuda_merge_split_lanes(),
    )


class Launcher:
    def __init__(
        self,
        *,
        device: torch.device,
        dtype: torch.dtype,
        hq: int,
        hkv: int,
        dqk: int,
        dv: int,
        mla: bool,
        max_batch: int,
        max_tree: int,
        max_kv: int,
        total_q_cap: int,
        split_balance: int | None = None,
        page_size: int = 16,
    ):
        """`split_balance`: the balanced split rule's grid factor (kernels/splits.py); None:
        TREEVERIFY_CUDA_SPLIT_BALANCE (default 2). `page_size`: the KV pool's (one kernel choice,
        the 256-row GQA CTA, depends on it: gqa_wide_pays)."""
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"q: the cuda backend takes bf16 or fp16, got {dtype}")
        self.device = torch.device(device)
        self.dtype_name = "bf16" if dtype == torch.bfloat16 else "fp16"
        self.arch = device_arch(self.device)
        props = torch.cuda.get_device_properties(self.device)
        rows = max_tree * (hq // hkv)  # packed rows of one KV head
        self.fwd = fwd_variant(
            self.arch,
            dqk,
            dv,
            mla,
            self.dtype_name,
            rows=rows,
            portable=env.cuda_portable(),
            mla_schedule=env.cuda_mla_schedule(),
            gqa_schedule=env.cuda_gqa_schedule(),
            gqa_q_regs=env.cuda_gqa_q_regs(),
            gqa_wide=gqa_wide_pays(  # read for GQA only (fwd_variant)
                env.cuda_gqa_256(), rows, max_batch * hkv * math.ceil(rows / 256),
                props.multi_processor_count, page_size, max_batch * max_kv,
            ),
        )  # fmt: skip
        self.fwd_kernel = load(self.fwd, self.device)
        self.hq, self.hkv, self.dqk, self.dv, self.mla = hq, hkv, dqk, dv, mla
        self.group = hq // hkv
        self.max_batch, self.max_tree, self.total_q_cap = max_batch, max_tree, total_q_cap
        self.m_tiles = math.ceil(rows / self.fwd.bm)
        by_smem = (228 * 1024) // (self.fwd.smem_bytes + 1024)  # 1 KB reserved per CTA
        by_regs = 65536 // max(1, self.fwd_kernel.compiled.registers * self.fwd.threads)
        ctas_per_sm = max(1, min(2, by_smem, by_regs))
        self.splits = choose_splits(
            batch=max_batch,
            hkv=hkv,
            m_tiles=self.m_tiles,
            max_kv=max_kv,
            bn=self.fwd.bn,
            num_sms=props.multi_processor_count,
            ctas_per_sm=ctas_per_sm,
            balance=(split_balance or env.cuda_split_balance()) if balance_pays(
                max_kv=max_kv, max_tree=max_tree, hq=hq, hkv=hkv, dqk=dqk, dv=dv, mla=mla
            ) else 1,
            single_share=env.cuda_split_share(),
        )  # fmt: skip
        forced = env.cuda_max_splits()
        if forced is not None:  # an A/B or a sweep (scripts/split_sweep.py), not the policy
            self.splits = dataclasses.replace(self.splits, max_splits=forced, balance_div=0)
        # Balanced plans dispatch splits last (device_common.cuh, cta_split); others as v11.
        # ... and may give a later split's CTAs to the requests longest first (cta_request_head:
        # one warp ranks the batch, so batches of at most LONGEST_FIRST_MAX_BATCH).
        self.split_longest_first = (
            bool(self.splits.balance_div)
            and max_batch <= LONGEST_FIRST_MAX_BATCH
            and env.cuda_split_order() == "longest"
        )
        bh, s = max_batch * hkv, self.splits.max_splits
        # Cluster launches (schedule pingpong-tma2) pair m-tiles: x rounded up to a multiple
        # (a CTA past the rows exits at once); the split counters are sized by grid x too.
        self.cluster = getattr(self.fwd, "cluster", 1)
        # Schedules that take TMA tensor maps (pingpong-tma*): whether, and from which page size.
        self.tma = getattr(self.fwd, "tma", False)
        self.tma_min_page = env.cuda_tma_min_page() if self.tma else 0
        self.grid_x = -(-self.m_tiles // self.cluster) * self.cluster
        self.grid = (self.grid_x, bh, s) if self.splits.balance_div else (self.grid_x, s, bh)
        # Schedule pingpong-persist (v23, gqa_pp_persist.cuh): one CTA an SM, in groups of
        # m_tiles (each CTA a row block of its group's share); it merges cut units itself.
        self.persist = getattr(self.fwd, "persist", False)
        if self.persist:
            sms = props.multi_processor_count
            self.grid = (max(1, sms // self.m_tiles) * self.m_tiles, 1, 1)
        self.merge_heads = merge_heads_per_cta(total_q_cap, hq, env.cuda_merge_max_ctas())
        self.merge_grid = (total_q_cap, -(-hq // self.merge_heads), 1)
        split_lanes = self.arch in MERGE_SPLIT_LANES_ARCHES and split_lanes_pay(
            env.cuda_merge_split_lanes(), max_splits=self.splits.max_splits,
            merge_ctas=math.prod(self.merge_grid), num_sms=props.multi_processor_count,
        )  # fmt: skip
        self.merge = merge_variant(
            dv, self.dtype_name, env.cuda_merge_ilp(), self.merge_heads, self.splits.max_splits,
            env.cuda_merge_wide(), split_lanes,
        )  # fmt: skip
        self.merge_kernel = load(self.merge, self.device)
        tile_rows = min(self.fwd.bm, max_tree * self.group)  # a row tile's packed rows
        self.fused_merge_bytes = plan_merge_limit(
            env.cuda_split_merge(), max_splits=self.splits.max_splits, tile_rows=tile_rows,
            dv=dv, mla=mla, batch=max_batch,
        )  # fmt: skip
        # The merge kernel by programmatic dependent launch (sm_90+; device_common.cuh). Auto:
        # only where the forward is one wave (v13b, measured 1.004x; the thought was that the
        # merge's early, waiting CTAs take SM slots from a forward's later waves, but the one
        # case PDL slows, 0.92x, is one wave: not understood yet, docs/performance.md).
        one_wave = math.prod(self.grid) <= props.multi_processor_count * ctas_per_sm
        pdl = env.cuda_pdl()
        self.pdl = torch.cuda.get_device_capability(self.device)[0] >= 9 and (
            pdl == "1" or (pdl == "auto" and one_wave)
        )
        # A 2-split tile merged in the forward with 4 rows of loads at a time and twice the
        # byte limit (v28, TREEVERIFY_CUDA_FUSED_MERGE_ILP): the sm_90 kernels only (the
        # portable ones compile v8's shape, split_merge.cuh).
        self.fused_merge_ilp = env.cuda_fused_merge_ilp() and isinstance(
            self.fwd, (GqaSm90Variant, MlaSm90Variant)
        )
        self.merge_kernel_needed = not self.persist and merge_kernel_needed(
            max_splits=self.splits.max_splits,
            tile_rows=tile_rows,
            dv=dv,
            limit=self.fused_merge_bytes,
            shaped=self.fused_merge_ilp,
        )

    def workspace_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """part_o's and part_lse's shapes and the counters' length for this launcher's grid."""
        s = self.splits.max_splits
        if self.persist:  # (2 slots, CTAs, 128 rows) partials; a counter per cut-unit row block
            slots = 2 * self.grid[0] * 128
            return (slots, self.dv), (slots,), self.m_tiles * self.max_batch * self.hkv
        if s == 1:
            return (0,), (0,), 0
        tiles = self.grid_x * self.max_batch * self.hkv if self.fused_merge_bytes else 0
        return (s, self.total_q_cap, self.hq, self.dv), (s, self.total_q_cap, self.hq), tiles

    def workspace(self, arena: SplitArena | None = None) -> SplitWorkspace:
        """Split buffers for this launcher's grid: new ones (allocates: at plan time, or
        eagerly), or views of `arena`, shared with other plans that never run at the same time."""
        o_shape, lse_shape, counters = self.workspace_shapes()
        if arena is not None:
            (part_o, part_lse), ctr = arena.take((o_shape, lse_shape), counters)
            return SplitWorkspace(part_o, part_lse, ctr)
        dev = self.device
        return SplitWorkspace(
            torch.empty(o_shape, dtype=torch.float32, device=dev),
            torch.empty(lse_shape, dtype=torch.float32, device=dev),
            torch.zeros(counters, dtype=torch.int32, device=dev),
        )

    def fill(
        self,
        params: Params,
        *,
        q: torch.Tensor,  # (total_q, Hq, Dqk)
        k: torch.Tensor,  # (pages, page_size, Hkv, Dqk) or (slots, Hkv, Dqk) with page_size 1
        v: torch.Tensor | None,
        out: torch.Tensor,  # (total_q, Hq, Dv); rows past the last tree are zeroed
        workspace: SplitWorkspace,
        block_table: torch.Tensor,
        prefix_lens: torch.Tensor | None,
        kv_indptr: torch.Tensor | None,
        qo_indptr: torch.Tensor,
        tree_mask: torch.Tensor,
        sm_scale: float,
        k_ext: torch.Tensor | None = None,
        v_ext: torch.Tensor | None = None,
    ) -> Params:
        """Write every address, stride and size into `params` (host only, no device work)."""
        kp = _paged_strides(k)
        vp = kp if v is None else _paged_strides(v)
        params.q, params.k = q.data_ptr(), k.data_ptr()
        params.v = k.data_ptr() if v is None else v.data_ptr()
        params.out = out.data_ptr()
        ws = workspace
        params.part_o = ws.part_o.data_ptr() if ws.part_o.numel() else 0
        params.part_lse = ws.part_lse.data_ptr() if ws.part_lse.numel() else 0
        params.split_counters = ws.counters.data_ptr() if ws.counters.numel() else 0
        params.fused_merge_bytes = self.fused_merge_bytes if ws.counters.numel() else 0
        params.fwd_bm = self.fwd.bm
        params.out_rows = out.shape[0]
        params.block_table = block_table.data_ptr()
        params.bt_i64 = int(block_table.dtype == torch.int64)
        params.bt_stride = block_table.stride(0) if block_table.dim() == 2 else 0
        params.prefix_lens = prefix_lens.data_ptr() if prefix_lens is not None else 0
        params.kv_indptr = kv_indptr.data_ptr() if kv_indptr is not None else 0
        params.qo_indptr = qo_indptr.data_ptr()
        params.tree_mask = tree_mask.data_ptr()
        params.k_ext = k_ext.data_ptr() if k_ext is not None else 0
        params.v_ext = (
            (v_ext if v_ext is not None else k_ext).data_ptr() if k_ext is not None else 0
        )
        params.q_stride_tok, params.q_stride_head = q.stride(0), q.stride(1)
        params.k_stride_page, params.k_stride_slot, params.k_stride_head = kp
        params.v_stride_page, params.v_stride_slot, params.v_stride_head = vp
        params.o_stride_tok, params.o_stride_head = out.stride(0), out.stride(1)
        if k_ext is not None:
            params.kext_stride_tok, params.kext_stride_head = k_ext.stride(0), k_ext.stride(1)
            ve = v_ext if v_ext is not None else k_ext
            params.vext_stride_tok, params.vext_stride_head = ve.stride(0), ve.stride(1)
        params.batch = self.max_batch
        params.hq, params.hkv, params.group = self.hq, self.hkv, self.group
        params.page_size = pool_page_size(k)
        params.mask_words = tree_mask.shape[1]
        params.max_splits, params.chunk = self.splits.max_splits, self.splits.chunk
        params.balance_div = self.splits.balance_div
        params.split_order = int(self.split_longest_first)
        params.fused_merge_ilp = int(self.fused_merge_ilp)
        params.merge_heads = self.merge_heads
        params.persist_m = self.m_tiles if self.persist else 0
        params.total_q_cap = self.total_q_cap
        params.scale_log2 = scale_log2(sm_scale)
        self._fill_tma(params, k, v)
        return params

    def _fill_tma(self, params: Params, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """Schedule "pingpong-tma": the K and V pools' tensor maps (kept on `params` for
        launch(); cached per pool) and the box rows, or tma_rows 0 (every tile by cp.async)
        where the page size or the pool's layout does not suit TMA (kernels/cuda/tma.py)."""
        params.tma_rows = 0
        if not self.tma:
            return
        params.tma_maps = (tma.NO_MAP, tma.NO_MAP)  # the kernel takes two maps either way
        rows = tma.box_rows(params.page_size, self.dqk, self.tma_min_page)
        if rows:
            maps = tuple(tma.tensor_map(c, rows) for c in (k, k if v is None else v))
            if None not in maps:
                params.tma_rows, params.tma_maps = rows, maps

    def launch(self, params: Params) -> None:
        """Forward, then the merge kernel where needed (it skips rows the forward merged)."""
        stream = torch.cuda.current_stream(self.device).cuda_stream
        args = [params, *params.tma_maps] if self.tma else [params]
        self.fwd_kernel.launch(self.grid, args, stream, cluster=self.cluster)
        if self.merge_kernel_needed:
            self.merge_kernel.launch(self.merge_grid, [params], stream, programmatic=self.pdl)


def pool_page_size(cache: torch.Tensor) -> int:
    """Slots a page of a (pages, page_size, H, D) pool; 1 for a (slots, H, D) one."""
    return cache.shape[1] if cache.dim() == 4 else 1


def _paged_strides(cache: torch.Tensor) -> tuple[int, int, int]:
    """(page, slot, head) element strides of a (pages, page_size, H, D) or (slots, H, D) pool."""
    if cache.dim() == 4:
        return cache.stride(0), cache.stride(1), cache.stride(2)
    return cache.stride(0), 0, cache.stride(1)


def check_alignment(name: str, t: torch.Tensor) -> None:
    """cp.async moves 16-byte chunks: base and every row start must be 16-byte aligned."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: the cuda backend needs a contiguous last dimension")
    if t.data_ptr() % 16 or any(s % 8 for s in t.stride()[:-1]):
        raise ValueError(
            f"{name}: the cuda backend needs 16-byte aligned rows (base % 16 == 0, strides "
            f"multiples of 8 elements), got strides {tuple(t.stride())}"
        )
