"""TreeAttentionPlan: capture-safe tree attention through plan() / run().

The plan owns every buffer the kernels read or write, at fixed addresses, sized by the bucket's
capacities: page table, prefix lengths, qo_indptr, tree mask, split-KV partial outputs and LSEs.
`plan()` checks capacities on the host and queues the new metadata into those buffers (host
metadata: one copy through a pinned staging ring, kernels/plan_metadata.py); `run()` only
launches (no allocation, no sync, no host-dependent grid), so one captured CUDA graph serves
every step of its bucket after the metadata buffers are rewritten in place.

    plan = TreeAttentionPlan(num_qo_heads=32, num_kv_heads=8, head_dim_qk=128, page_size=16,
                             max_batch=8, max_tree=64, max_pages_per_request=520,
                             max_kv_len=8256, sm_scale=128 ** -0.5)
    plan.plan(block_table, prefix_lens, qo_indptr, tree_mask)    # host side, every step
    plan.run(q, k_cache, v_cache, out)                           # inside the graph
"""

from __future__ import annotations

import itertools
import math
import operator

import numpy as np
import torch

from treeverify.kernels.plan_metadata import PlanMetadata
from treeverify.kernels.split_arena import SplitArena
from treeverify.kernels.staging import copy_from_host
from treeverify.kernels.validate import validate_tree_attention_args


def _extents(qo: np.ndarray, pl: np.ndarray) -> tuple[int, int, int]:
    """total_q, the largest tree and the longest prefix + tree of a step's qo_indptr (B+1,) and
    prefix_lens (B,): plan()'s capacity checks."""
    if pl.shape[0] <= 16:  # Python ints: a numpy call costs ~1 us of host time, a step ~4 of them
        q, p = qo.tolist(), pl.tolist()
        trees = [b - a for a, b in itertools.pairwise(q)]
        first, fewest, shortest = q[0], min(trees), min(p)
        out = q[-1], max(trees), max(map(operator.add, p, trees))
    else:
        trees = qo[1:].astype(np.int64) - qo[:-1]  # (B,)
        first, fewest, shortest = int(qo[0]), int(trees.min()), int(pl.min())
        out = int(qo[-1]), int(trees.max()), int((pl + trees).max())
    # cheap on values already read: a negative prefix ran to NaN, a decreasing indptr to a
    # shape error deep in the backend
    if first != 0 or fewest < 0:
        raise ValueError(f"qo_indptr: expected non-decreasing offsets from 0, got {qo.tolist()}")
    if shortest < 0:
        raise ValueError(f"prefix_lens: expected lengths >= 0, got {pl.tolist()}")
    return out


class TreeAttentionPlan:
    def __init__(
        self,
        *,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        head_dim_v: int | None = None,
        mla: bool = False,
        page_size: int,
        max_batch: int,
        max_tree: int,
        max_pages_per_request: int,
        max_kv_len: int | None = None,
        max_total_q: int | None = None,
        sm_scale: float,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cuda",
        backend: str = "cuda",
        split_balance: int | None = None,
        split_arena: SplitArena | None = None,
        split_kv_len: int | None = None,
    ):
        """`split_arena` (cuda backend): take the split partials from this shared arena
        (kernels/split_arena.py) instead of allocating them: for plans never run at once.
        `split_kv_len` (default and at most `max_kv_len`): the keys the split-KV grid is sized
        for (kernels/splits.py choose_splits). A serving engine passes the model's context while
        `max_kv_len` also covers a round's tree past its last position: such a step splits into
        longer chunks by the same device rule (never wrong), and a grid sized for the model, not
        the whole pool, launches no idle split CTAs and merges small plans in the forward."""
        for name, value in (
            ("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads),
            ("head_dim_qk", head_dim_qk), ("page_size", page_size), ("max_batch", max_batch),
            ("max_tree", max_tree), ("max_pages_per_request", max_pages_per_request),
            ("head_dim_v", head_dim_qk if head_dim_v is None else head_dim_v),
            ("max_kv_len", 1 if max_kv_len is None else max_kv_len),
            ("max_total_q", 1 if max_total_q is None else max_total_q),
            ("split_balance", 1 if split_balance is None else split_balance),
        ):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if mla and head_dim_v is not None and head_dim_v > head_dim_qk:  # V is K's first columns
            raise ValueError(f"head_dim_v: MLA's V is the first head_dim_v columns of K, so at "
                             f"most head_dim_qk={head_dim_qk}, got {head_dim_v}")  # fmt: skip
        if not isinstance(dtype, torch.dtype) or dtype not in (
            torch.float16,
            torch.bfloat16,
            torch.float32,
        ):
            raise ValueError(f"dtype: expected torch.float16, torch.bfloat16 or torch.float32, "
                             f"got {dtype!r}")  # fmt: skip
        if (
            isinstance(sm_scale, bool)
            or not isinstance(sm_scale, (int, float))
            or not (math.isfinite(sm_scale) and sm_scale > 0)
        ):
            raise ValueError(f"sm_scale: expected a finite number > 0, got {sm_scale!r}")
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device: {device!r} is not a device ({exc})") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device: {str(device)!r}, but this torch sees no CUDA GPU; use "
                             f"device='cpu' with backend='torch'")  # fmt: skip
        if num_qo_heads % num_kv_heads:
            raise ValueError(
                f"num_qo_heads: expected a multiple of num_kv_heads={num_kv_heads}, "
                f"got {num_qo_heads}"
            )
        if backend not in ("cuda", "triton", "torch"):
            raise ValueError(f"backend: a plan runs 'cuda', 'triton' or 'torch', got {backend!r}")
        if split_arena is not None and backend != "cuda":
            raise ValueError(f"split_arena: only the cuda backend takes one, not {backend!r}")
        self._shared_partials = split_arena is not None  # the arena's bytes, not this plan's
        self.hq, self.hkv, self.dqk = num_qo_heads, num_kv_heads, head_dim_qk
        self.dv = head_dim_v if head_dim_v is not None else head_dim_qk
        self.mla, self.page_size, self.sm_scale = mla, page_size, float(sm_scale)
        self.max_batch, self.max_tree = max_batch, max_tree
        self.max_pages = max_pages_per_request
        self.max_kv_len = (
            max_kv_len if max_kv_len is not None else max_pages_per_request * page_size
        )
        if split_kv_len is not None and (
            isinstance(split_kv_len, bool) or not isinstance(split_kv_len, int) or split_kv_len < 1
        ):
            raise ValueError(f"split_kv_len: expected a positive int, got {split_kv_len!r}")
        self.split_kv_len = min(split_kv_len or self.max_kv_len, self.max_kv_len)
        self.max_total_q = max_total_q if max_total_q is not None else max_batch * max_tree
        self.words = math.ceil(max_tree / 32)
        self.dtype, self.device, self.backend = dtype, torch.device(device), backend
        dev = self.device
        # Metadata buffers at fixed addresses (captured graphs read these): views of one buffer.
        self._meta = PlanMetadata(max_batch, self.max_pages, self.max_total_q, self.words, dev)
        self.block_table = self._meta.block_table  # (max_batch, max_pages)
        self.prefix_lens = self._meta.prefix_lens  # (max_batch,)
        self.qo_indptr = self._meta.qo_indptr  # (max_batch + 1,)
        self.tree_mask = self._meta.tree_mask  # (max_total_q, words)
        self.batch = 0  # requests in the last plan() (host copy, for the torch backend)
        self._launcher = None
        self._triton = None
        if backend == "triton":
            from treeverify.kernels.triton import TritonTreeAttention

            self._triton = TritonTreeAttention(
                self.hq, self.hkv, self.dqk, self.dv, mla, max_batch, max_tree, self.split_kv_len,
                self.max_total_q, dev, dtype,
            )  # fmt: skip
            o_shape, lse_shape = self._triton.workspace_shapes()
            self.part_o = torch.empty(o_shape, dtype=torch.float32, device=dev)
            self.part_lse = torch.empty(lse_shape, dtype=torch.float32, device=dev)
        if backend == "cuda":
            from treeverify.kernels.cuda.launch import Params
            from treeverify.kernels.cuda.runner import Launcher

            self._launcher = Launcher(
                device=dev,
                dtype=dtype,
                hq=self.hq,
                hkv=self.hkv,
                dqk=self.dqk,
                dv=self.dv,
                mla=mla,
                max_batch=max_batch,
                max_tree=max_tree,
                max_kv=self.split_kv_len,
                total_q_cap=self.max_total_q,
                split_balance=split_balance,
                page_size=page_size,
            )  # compiles and loads the kernels now (warmup), never on a request
            self._workspace = self._launcher.workspace(split_arena)
            self.part_o, self.part_lse = self._workspace.part_o, self._workspace.part_lse
            self._params = Params()

    @property
    def workspace_bytes(self) -> int:
        """Device bytes this plan holds (metadata + split partials; partials taken from a
        shared arena are the arena's, not counted here)."""
        tensors = []
        if self._triton is not None or (self._launcher is not None and not self._shared_partials):
            tensors += [self.part_o, self.part_lse]
        if self._launcher is not None and not self._shared_partials:
            tensors.append(self._workspace.counters)
        return self._meta.nbytes + sum(t.numel() * t.element_size() for t in tensors)

    @property
    def zeroes_padding_rows(self) -> bool:
        """True: run() zeroes out's rows past the last tree itself (the CUDA kernels do); else
        the caller must pass zeros there (padding requests' rows are never written)."""
        return self._launcher is not None

    @property
    def split_policy(self):
        if self._triton is not None:
            return self._triton.splits
        return self._launcher.splits if self._launcher is not None else None

    def plan(
        self,
        block_table: torch.Tensor,  # (B, pages) int32, B <= max_batch, pages <= max_pages
        prefix_lens: torch.Tensor,  # (B,) int32
        qo_indptr: torch.Tensor,  # (B+1,) int32
        tree_mask: torch.Tensor,  # (total_q, W) int32, W <= ceil(max_tree / 32)
    ) -> None:
        """Check capacities on the host, then queue the metadata's copies into the fixed
        buffers. Host tensors (the path this is built for) never wait for the GPU: they are
        written into a pinned staging buffer and queued as one copy (kernels/plan_metadata.py),
        so the next step can be planned while this one runs; the mask may live on the device.
        Device prefix_lens / qo_indptr are read back for the capacity checks (a sync), and each
        buffer is zeroed and refilled on the device."""
        batch = prefix_lens.shape[0] if isinstance(prefix_lens, torch.Tensor) else -1
        if not 1 <= batch <= self.max_batch:
            raise ValueError(
                f"prefix_lens: batch {batch} exceeds the plan's max_batch "
                f"{self.max_batch} (or is empty)"
            )
        if (
            block_table.dim() != 2
            or block_table.shape[0] != batch
            or block_table.shape[1] > self.max_pages
        ):
            raise ValueError(
                f"block_table: expected ({batch}, <= {self.max_pages}) pages, got "
                f"{tuple(block_table.shape)}"
            )
        if tree_mask.dim() != 2 or tree_mask.shape[1] > self.words:
            raise ValueError(
                f"tree_mask: expected (total_q, <= {self.words}) words, got "
                f"{tuple(tree_mask.shape)}"
            )
        on_host = not (block_table.is_cuda or prefix_lens.is_cuda or qo_indptr.is_cuda)
        qo = qo_indptr.numpy() if on_host else qo_indptr.cpu().numpy()  # (B+1,)
        pl = prefix_lens.numpy() if on_host else prefix_lens.cpu().numpy()  # (B,)
        if qo.shape != (batch + 1,):
            raise ValueError(f"qo_indptr: expected ({batch + 1},) entries, got {qo.shape}")
        total_q, largest_tree, longest = _extents(qo, pl)
        if total_q > self.max_total_q:
            raise ValueError(f"qo_indptr: total_q {total_q} exceeds max_total_q {self.max_total_q}")
        if largest_tree > self.max_tree:
            raise ValueError(
                f"qo_indptr: a tree of {largest_tree} nodes exceeds max_tree {self.max_tree}"
            )
        if longest > self.max_kv_len:
            raise ValueError(
                f"prefix_lens: prefix + tree {longest} exceeds max_kv_len {self.max_kv_len}"
            )
        if tree_mask.shape[0] < total_q:
            raise ValueError(
                f"tree_mask: expected >= {total_q} rows (total_q), got {tree_mask.shape[0]}"
            )
        # (Not checked: that each row holds every page its prefix + tree reaches. Columns past
        # the given table read page 0, by design: the engine's padded prefill rows reach past
        # their request's pages into page 0, its scratch page. A caller whose page 0 holds real
        # KV passes every page; validate() / the eager call check that.)
        self.batch = batch
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if on_host and not capturing:
            mask = tree_mask if tree_mask.is_cuda else tree_mask.numpy()
            self._meta.write_from_host(block_table.numpy(), pl, qo, mask, total_q)
            return
        self.block_table.zero_()
        copy_from_host(self.block_table[:batch, : block_table.shape[1]], block_table)
        self.prefix_lens.zero_()
        copy_from_host(self.prefix_lens[:batch], prefix_lens)
        self.qo_indptr.fill_(total_q)  # padding requests: empty trees
        copy_from_host(self.qo_indptr[: batch + 1], qo_indptr)
        self.tree_mask.zero_()
        copy_from_host(self.tree_mask[:total_q, : tree_mask.shape[1]], tree_mask[:total_q])
        self._meta.written(batch)

    def validate(self, q, k_cache, v_cache) -> None:
        """Full data validation of the planned metadata against a cache (syncs: eager only)."""
        b = self.batch
        validate_tree_attention_args(
            q, k_cache, v_cache, self.block_table[:b], self.prefix_lens[:b],
            self.qo_indptr[: b + 1], self.tree_mask[: q.shape[0]], self.sm_scale,
            v_head_dim=self.dv if self.mla else None, check_data=True,
        )  # fmt: skip

    def run(
        self,
        q: torch.Tensor,  # (max_total_q or total_q, Hq, Dqk)
        k_cache: torch.Tensor,  # (num_pages, page_size, Hkv, Dqk)
        v_cache: torch.Tensor | None,
        out: torch.Tensor,  # (rows of q, Hq, Dv)
    ) -> torch.Tensor:
        """Launch only: reads the plan's buffers; safe inside torch.cuda.graph capture."""
        if q.dim() != 3 or q.shape[1:] != (self.hq, self.dqk) or q.dtype != self.dtype:
            raise ValueError(
                f"q: expected (rows, {self.hq}, {self.dqk}) {self.dtype}, got "
                f"{tuple(q.shape)} {q.dtype}"
            )
        if out.shape != (q.shape[0], self.hq, self.dv) or out.dtype != self.dtype:
            raise ValueError(
                f"out: expected ({q.shape[0]}, {self.hq}, {self.dv}) {self.dtype}, "
                f"got {tuple(out.shape)} {out.dtype}"
            )
        if q.shape[0] > self.max_total_q:
            raise ValueError(f"q: {q.shape[0]} rows exceed max_total_q {self.max_total_q}")
        if k_cache.dim() != 4 or k_cache.shape[1] != self.page_size:  # (a shape: no sync)
            raise ValueError(
                f"k_cache: expected (pages, {self.page_size}, heads, dim) for the plan's "
                f"page_size {self.page_size}, got {tuple(k_cache.shape)}"
            )
        if self._triton is not None:
            self._triton.launch(
                q, k_cache, v_cache, out, self.block_table, self.prefix_lens, self.qo_indptr,
                self.tree_mask, self.part_o, self.part_lse, self.sm_scale,
            )  # fmt: skip
            return out
        if self._launcher is None:
            return self._run_torch(q, k_cache, v_cache, out)
        launcher = self._launcher
        launcher.fill(
            self._params, q=q, k=k_cache, v=v_cache, out=out, workspace=self._workspace,
            block_table=self.block_table, prefix_lens=self.prefix_lens,
            kv_indptr=None, qo_indptr=self.qo_indptr, tree_mask=self.tree_mask,
            sm_scale=self.sm_scale,
        )  # fmt: skip
        launcher.launch(self._params)
        return out

    def _run_torch(self, q, k_cache, v_cache, out) -> torch.Tensor:
        from treeverify.kernels.reference import tree_attention_reference

        b = self.batch
        total = int(self.qo_indptr[b])
        tree_attention_reference(
            q[:total], k_cache, v_cache, self.block_table[:b], self.prefix_lens[:b],
            self.qo_indptr[: b + 1], self.tree_mask[:total], self.sm_scale,
            v_head_dim=self.dv if self.mla else None, out=out[:total], check_data=False,
        )  # fmt: skip
        return out
