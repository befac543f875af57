"""The attention seam of the models, backed by the paged KV cache and TreeAttentionPlan.

For one step the runner describes each chunk (a prefill chunk or a decode) of the flat batch:
its already-cached prefix length and its pages. `plan()` copies that into the fixed buffers of a
`TreeAttentionPlan` once per step (host side); each layer's call then writes the chunk's K/V into
the cache and only runs the plan. Every chunk is a "tree" that is a chain (token i sees the
prefix and tokens 0..i of its chunk), and a decode is a tree of one node: plain decoding runs the
same op, masks and kernels a DDTree verify round uses. The plan's buffers keep fixed addresses,
which is what CUDA-graph capture of a step will need.
"""

from __future__ import annotations

import functools
import math

import torch

from treeverify.engine.kv_cache import KVCache
from treeverify.kernels.bits import chain_bits
from treeverify.kernels.plan import TreeAttentionPlan
from treeverify.kernels.staging import copy_from_host
from treeverify.models.fused_mla import mla_rope_pack_store
from treeverify.models.fused_ops import rope_qk_store


@functools.lru_cache(maxsize=256)
def _chain_bits_cached(n: int) -> torch.Tensor:
    return chain_bits(n)  # (n, ceil(n/32)); callers copy, never write


def chain_masks(query_lens: list[int]) -> torch.Tensor:
    """(sum(query_lens), W) int32 on the host: row i of a chunk sees nodes 0..i of that chunk."""
    if all(n == 1 for n in query_lens):  # all decodes: each row sees itself (host work O(1))
        return torch.ones(len(query_lens), 1, dtype=torch.int32)
    words = math.ceil(max(query_lens) / 32)
    out = torch.zeros(sum(query_lens), words, dtype=torch.int32)
    row = 0
    for n in query_lens:
        bits = _chain_bits_cached(n)  # (n, ceil(n/32))
        out[row : row + n, : bits.shape[1]] = bits
        row += n
    return out


def _masks(query_lens: list[int], trees: list[torch.Tensor | None] | None) -> torch.Tensor:
    """(T, W) int32 on the host: each chunk's tree bits, or a chain where it has none."""
    if trees is None or all(t is None for t in trees):
        return chain_masks(query_lens)
    words = max(math.ceil(n / 32) for n in query_lens)
    out = torch.zeros(sum(query_lens), words, dtype=torch.int32)
    row = 0
    for n, tree in zip(query_lens, trees, strict=True):
        bits = _chain_bits_cached(n) if tree is None else tree.cpu()
        out[row : row + n, : bits.shape[1]] = bits
        row += n
    return out


class PagedAttention:
    """Plans per attention shape (made on first use) over one KV cache.

    Plans are kept per bucket: `None` is the eager bucket (the engine's full capacities); a CUDA
    graph bucket `(B, n)` (B requests of n tokens) has plans sized exactly for it, so a captured
    batch-1 decode launches a batch-1 grid. `select(bucket)` picks the set that `plan()` fills and
    the layers run. The step's slots live in one fixed buffer; rows past the step's tokens
    (padding of a captured bucket) write their K/V to the cache's scratch slot.
    """

    def __init__(
        self,
        cache: KVCache,
        *,
        max_batch: int,
        max_chunk: int,
        max_total_q: int,
        context_length: int,
        backend: str = "torch",
        split_context: int | None = None,
    ):
        self.cache, self.backend = cache, backend
        self.max_batch, self.max_chunk = max_batch, max_chunk
        self.max_total_q = max_total_q
        self.context_length = context_length
        # the longest request the engine admits (the model's positions): what the plans' split
        # grids are sized for (TreeAttentionPlan split_kv_len); None: the whole pool
        self.split_context = split_context
        self.max_pages = math.ceil(context_length / cache.page_size)
        self._plans: dict[tuple, TreeAttentionPlan] = {}  # (bucket, shape) -> plan
        self.bucket: tuple[int, int] | None = None
        self.slots = torch.full(
            (max_total_q,), cache.scratch_slot, dtype=torch.int64, device=cache.device
        )  # fmt: skip  (rows,) fixed address
        self._meta: tuple | None = None

    def select(self, bucket: tuple[int, int] | None) -> None:
        """Use the plans of a graph bucket (B, n), or the eager ones (None)."""
        if bucket is not None and (bucket[0] * bucket[1] > self.max_total_q
                                   or bucket[1] > self.max_chunk):  # fmt: skip
            raise ValueError(f"bucket: {bucket} exceeds the engine's capacities")
        self.bucket = bucket

    def plan(
        self,
        slots: torch.Tensor,  # (T,) int64
        block_tables: list[list[int]],  # per chunk: its page ids
        prefix_lens: list[int],  # per chunk: tokens cached before this chunk
        query_lens: list[int],  # per chunk: tokens in this step
        tree_masks: list[torch.Tensor | None] | None = None,  # per chunk: (n, W_i) or chain
        mask: torch.Tensor | None = None,  # or the whole step's (T, W) bits, on the device
    ) -> None:
        """Host side, once per step: the metadata every layer's plan run reads. `slots` and
        `mask` may live on the device (a speculative round's): they are copied, never read."""
        width = max(len(t) for t in block_tables)
        table = torch.zeros(len(block_tables), width, dtype=torch.int32)
        for b, pages in enumerate(block_tables):
            table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        qo = [0]
        for n in query_lens:
            qo.append(qo[-1] + n)
        total = qo[-1]
        copy_from_host(self.slots[:total], slots)  # queued, never waits for the GPU
        self.slots[total:].fill_(self.cache.scratch_slot)
        self._meta = (
            table,  # (B, pages) host: each plan stages it in its pinned ring (plan_metadata.py)
            torch.tensor(prefix_lens, dtype=torch.int32),  # (B,) host: plan() checks it
            torch.tensor(qo, dtype=torch.int32),  # (B+1,) host
            mask if mask is not None else _masks(query_lens, tree_masks),  # (T, W)
        )
        for (bucket, _), p in self._plans.items():
            if bucket == self.bucket:
                p.plan(*self._meta)

    def _plan_for(self, q: torch.Tensor, hkv: int, dv: int, mla: bool, sm_scale: float):
        shape = (q.shape[1], hkv, q.shape[2], dv, mla, sm_scale, q.dtype)
        key = (self.bucket, shape)
        plan = self._plans.get(key)
        if plan is None:
            batch, tree = self.bucket or (self.max_batch, self.max_chunk)
            total_q = batch * tree if self.bucket else self.max_total_q
            plan = TreeAttentionPlan(
                num_qo_heads=q.shape[1], num_kv_heads=hkv, head_dim_qk=q.shape[2],
                head_dim_v=dv, mla=mla,
                page_size=self.cache.page_size, max_batch=batch,
                max_tree=tree, max_pages_per_request=self.max_pages,
                max_kv_len=self.context_length, max_total_q=total_q,
                split_kv_len=self.split_context,
                sm_scale=sm_scale, dtype=q.dtype, device=self.cache.device, backend=self.backend,
            )  # fmt: skip
            plan.plan(*self._meta)
            self._plans[key] = plan
        return plan

    def plans_for(self, bucket: tuple[int, int]) -> list[TreeAttentionPlan]:
        """The plans of a graph bucket (one per attention shape of the model)."""
        return [p for (b, _), p in self._plans.items() if b == bucket]

    def plan_scratch(self, batch: int, n: int) -> None:
        """Plan B chains of n tokens over the scratch page only: what a capture or a warmup
        forward runs, touching no request's K/V."""
        cache = self.cache
        pages = [cache.num_pages] * math.ceil(n / cache.page_size)  # the scratch page
        self.plan(torch.full((batch * n,), cache.scratch_slot, dtype=torch.int64),
                  [pages] * batch, [0] * batch, [n] * batch)  # fmt: skip

    def forget(self, bucket: tuple[int, int]) -> None:
        """Drop a bucket's plans (their buffers) and go back to the eager plans."""
        for key in [k for k in self._plans if k[0] == bucket]:
            del self._plans[key]
        self.select(None)

    @property
    def workspace_bytes(self) -> int:
        return sum(p.workspace_bytes for p in self._plans.values())

    def __call__(self, layer, q, k, v, sm_scale, v_head_dim=None):
        self._check_planned()
        kc, vc = self.cache.write(layer, self.slots[: q.shape[0]], k, v)
        mla = v is None
        plan = self._plan_for(q, k.shape[1], v_head_dim if mla else v.shape[2], mla, sm_scale)
        return self._run(plan, q, kc, vc)

    def rope_store_attend(
        self,
        layer: int,
        qkv: torch.Tensor,  # (T, Hq + 2 Hkv, D) a GQA layer's fused projection
        cos2: torch.Tensor,  # (T, D) Rope.rotate_half_tables
        sin2: torch.Tensor,  # (T, D)
        hq: int,
        hkv: int,
        sm_scale: float,
    ) -> torch.Tensor | None:  # (T, Hq, D)
        """The layer's attention from its fused projection, q and k rotated and k, v written to
        their cache slots by one kernel (models/fused_ops.py rope_qk_store) instead of rope_qk
        then the cache write: one launch a layer fewer. None where that kernel does not apply
        (the CPU, a cache not allocated yet, other dtypes): the caller takes the two-step path."""
        self._check_planned()
        kc, vc = self.cache.k.get(layer), self.cache.v.get(layer)
        if kc is None or vc is None:
            return None
        t, d = qkv.shape[0], qkv.shape[2]
        q = rope_qk_store(qkv, cos2, sin2, hq, hkv, self.slots[:t], kc, vc)  # (T, Hq, D)
        if q is None:
            return None
        return self._run(self._plan_for(q, hkv, d, False, sm_scale), q, kc, vc)

    def pack_store_attend(
        self,
        layer: int,
        q_lat: torch.Tensor,  # (T, H, L) W_ukᵀ q_nope
        q: torch.Tensor,  # (T, H, N + R) [q_nope | q_pe]
        ckv: torch.Tensor,  # (T, L) c_kv after kv_a_layernorm
        k_pe: torch.Tensor,  # (T, R) before the rotation
        cos: torch.Tensor,  # (T, R/2) Rope's tables
        sin: torch.Tensor,  # (T, R/2)
        interleave: bool,
        sm_scale: float,
    ) -> torch.Tensor | None:  # (T, H, L) the latent attention output
        """An absorbed MLA layer's attention from its operands: qa = [q_lat | rope(q_pe)] packed
        and [c_kv | rope(k_pe)] written to the latent cache slots by one kernel
        (models/fused_mla.py mla_rope_pack_store), then attention: the cache write's launch
        saved. None where that kernel does not apply (the CPU, a cache not allocated yet): the
        caller packs and calls the attention as before."""
        self._check_planned()
        kc = self.cache.k.get(layer)
        if kc is None:
            return None
        lat = q_lat.shape[2]
        qa = mla_rope_pack_store(q_lat, q, ckv, k_pe, cos, sin, interleave,
                                 self.slots[: q_lat.shape[0]], kc)  # fmt: skip
        if qa is None:
            return None
        return self._run(self._plan_for(qa, 1, lat, True, sm_scale), qa, kc, None)

    def _check_planned(self) -> None:
        if self._meta is None:
            raise RuntimeError("PagedAttention: plan() must run before the forward pass")

    def _run(self, plan: TreeAttentionPlan, q: torch.Tensor, kc, vc) -> torch.Tensor:
        # Rows of padding requests belong to no tree: the CUDA kernels zero them (no memset
        # launch per layer); the other backends never write them, so they get zeros here.
        shape = (q.shape[0], q.shape[1], plan.dv)  # (T, Hq, Dv)
        out = q.new_empty(shape) if plan.zeroes_padding_rows else q.new_zeros(shape)
        return plan.run(q, kc, vc, out)
