"""A plan's four metadata buffers in one device buffer, filled from host metadata in two copies.

`TreeAttentionPlan.plan()` zeroed four device buffers and copied four host tensors into them,
each copy staged through a fresh pinned block: eight launches, four pinned allocations and a
dozen small torch ops, 145-310 us of host time a step on the H200's host against issue 15's
<= 50 us (scripts/host_step_profile.py, 2f9e56c: `fill_` 13 us, a staged copy 20-37 us). Here the
buffers (prefix_lens, qo_indptr, tree_mask, block_table) are views of one int32 device buffer at
fixed addresses, and a step's host metadata is written with numpy into a pinned staging buffer
laid out the same way, then queued as one host-to-device copy of

    [prefix_lens | qo_indptr | tree_mask | block_table rows]

Every region is written whole within what is copied: prefix lengths zero past the batch,
qo_indptr total_q past it, the mask zero past the step's rows and words, and the page rows up to
the larger of this step's and the previous step's batch (zeros past this step's), so the device
buffers always read as if zeroed and refilled, and nothing from an earlier, larger batch
survives. A mask already on the device (a speculative round's) is copied on the device after
that. Staging buffers form a ring of two: one is rewritten only once the event recorded after its
copy has passed, so the host never writes memory a queued copy still reads and waits only when
the GPU runs two plans behind.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

_ALIGN = 64  # int32 elements: every region starts 256-byte aligned, like its own allocation
_RING = 2


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class PlanMetadata:
    def __init__(
        self, max_batch: int, max_pages: int, max_total_q: int, words: int, device: torch.device
    ):
        self.max_batch, self.max_pages = max_batch, max_pages
        self.max_total_q, self.words = max_total_q, words
        self.device = torch.device(device)
        self.off_qo = _round_up(max_batch)
        self.off_mask = _round_up(self.off_qo + max_batch + 1)
        self.off_table = _round_up(self.off_mask + max_total_q * words)
        size = self.off_table + max_batch * max_pages
        self.buffer = torch.zeros(size, dtype=torch.int32, device=self.device)  # fixed address
        self.prefix_lens = self.buffer[:max_batch]  # (max_batch,)
        self.qo_indptr = self.buffer[self.off_qo : self.off_qo + max_batch + 1]  # (max_batch+1,)
        self.tree_mask = self.buffer[self.off_mask : self.off_mask + max_total_q * words].view(
            max_total_q, words
        )  # (max_total_q, words)
        self.block_table = self.buffer[self.off_table :].view(max_batch, max_pages)
        self._table_rows = 0  # rows of block_table that may hold non-zero values
        self._driver = self._check = None  # cuda.bindings.driver, on the first copy
        self._streams: dict[int, object] = {}  # CUstream handles by stream
        self._ring: list[tuple[torch.Tensor, np.ndarray, torch.cuda.Event | None]] = []
        self._next = 0

    def __del__(self) -> None:
        # The staging buffers go back to PyTorch's pinned-memory cache, which does not know about
        # these driver copies: let the last ones finish before the memory can be handed out.
        for _, _, event in getattr(self, "_ring", ()):
            if event is not None:
                with contextlib.suppress(Exception):  # at shutdown CUDA may already be gone
                    event.synchronize()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def written(self, batch: int) -> None:
        """Record that the buffers were zeroed and refilled another way (plan()'s device path):
        block_table rows past `batch` hold zeros."""
        self._table_rows = batch

    def write_from_host(
        self,
        block_table: np.ndarray,  # (B, pages)
        prefix_lens: np.ndarray,  # (B,)
        qo_indptr: np.ndarray,  # (B+1,)
        tree_mask: np.ndarray | torch.Tensor,  # (>= total_q, W) host, or on the device
        total_q: int,
    ) -> None:
        """Queue the step's metadata into the device buffers (never waits for the GPU unless it
        runs two plans behind). The caller has checked every capacity."""
        batch, cols = block_table.shape
        table_rows = max(batch, self._table_rows)
        stage, h, done = self._slot()
        h[:batch] = prefix_lens
        h[batch : self.max_batch] = 0
        q = h[self.off_qo : self.off_qo + self.max_batch + 1]
        q[: batch + 1] = qo_indptr
        q[batch + 1 :] = total_q  # padding requests: empty trees
        m = h[self.off_mask : self.off_mask + self.max_total_q * self.words]
        m = m.reshape(self.max_total_q, self.words)
        host_mask = isinstance(tree_mask, np.ndarray)
        if host_mask:
            w = tree_mask.shape[1]
            m[:total_q, :w] = tree_mask[:total_q]
            m[:total_q, w:] = 0
            m[total_q:] = 0
        else:
            m[:] = 0
        t = h[self.off_table : self.off_table + table_rows * self.max_pages]
        t = t.reshape(table_rows, self.max_pages)
        t[:batch, :cols] = block_table
        t[:batch, cols:] = 0
        t[batch:] = 0
        # the plan's device's current stream (not the current device's: a plan may live on another)
        stream = torch.cuda.current_stream(self.device) if done is not None else None
        self._copy(stage, self.off_table + table_rows * self.max_pages, stream)
        if not host_mask:  # a device mask (a speculative round's): copied on the device
            self.tree_mask[:total_q, : tree_mask.shape[1]].copy_(tree_mask[:total_q])
        if done is not None:
            done.record(stream)
        self._table_rows = batch

    def _slot(self) -> tuple[torch.Tensor, np.ndarray, torch.cuda.Event | None]:
        """The next staging buffer of the ring, once no queued copy reads it any more."""
        cuda = self.device.type == "cuda"
        if len(self._ring) < (_RING if cuda else 1):  # made on first use (pinned host memory)
            stage = torch.zeros(self.buffer.numel(), dtype=torch.int32, pin_memory=cuda)
            event = torch.cuda.Event() if cuda else None
            self._ring.append((stage, stage.numpy(), event))
            slot = self._ring[-1]
        else:
            slot = self._ring[self._next % len(self._ring)]
            if slot[2] is not None and not slot[2].query():
                slot[2].synchronize()  # the GPU runs two plans behind: wait for that copy
        self._next += 1
        return slot

    def _copy(self, stage: torch.Tensor, end: int, stream: torch.cuda.Stream | None) -> None:
        """Queue stage[:end] -> buffer[:end] on `stream` (None: the CPU, a plain copy)."""
        if stream is None:
            self.buffer[:end].copy_(stage[:end])
            return
        if self._driver is None:
            from cuda.bindings import driver

            from treeverify.kernels.cuda.launch import _check

            self._driver, self._check = driver, _check
        handle = stream.cuda_stream
        cu_stream = self._streams.get(handle)
        if cu_stream is None:
            cu_stream = self._streams[handle] = self._driver.CUstream(handle)
        res = self._driver.cuMemcpyHtoDAsync(
            self.buffer.data_ptr(), stage.data_ptr(), 4 * end, cu_stream
        )
        self._check(res, "cuMemcpyHtoDAsync(plan metadata)")
