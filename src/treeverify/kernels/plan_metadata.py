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
the GPU runs two plans behind. The stream, the copy and the events are driver calls on raw
handles (no torch Stream or Event objects a step): host time is what this file is for.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

_ALIGN = 64  # int32 elements: every region starts 256-byte aligned, like its own allocation
_RING = 2


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class _Slot:
    """One staging buffer of the ring: pinned host memory laid out as the device buffer, numpy
    views of its four regions (made once: a step only assigns into them), and the driver event
    recorded after the copy that reads it (None on the CPU)."""

    __slots__ = ("stage", "prefix_lens", "qo_indptr", "tree_mask", "block_table", "event")

    def __init__(self, stage: torch.Tensor, meta: PlanMetadata, event: object | None):
        h = stage.numpy()
        self.stage, self.event = stage, event
        self.prefix_lens = h[: meta.max_batch]  # (max_batch,)
        self.qo_indptr = h[meta.off_qo : meta.off_qo + meta.max_batch + 1]  # (max_batch+1,)
        mask = h[meta.off_mask : meta.off_mask + meta.max_total_q * meta.words]
        self.tree_mask = mask.reshape(meta.max_total_q, meta.words)  # (max_total_q, words)
        self.block_table = h[meta.off_table :].reshape(meta.max_batch, meta.max_pages)


class PlanMetadata:
    def __init__(
        self, max_batch: int, max_pages: int, max_total_q: int, words: int, device: torch.device
    ):
        self.max_batch, self.max_pages = max_batch, max_pages
        self.max_total_q, self.words = max_total_q, words
        self.off_qo = _round_up(max_batch)
        self.off_mask = _round_up(self.off_qo + max_batch + 1)
        self.off_table = _round_up(self.off_mask + max_total_q * words)
        size = self.off_table + max_batch * max_pages
        self.buffer = torch.zeros(size, dtype=torch.int32, device=device)  # fixed address
        self.device = self.buffer.device  # with its index ("cuda" alone: the current device)
        self.prefix_lens = self.buffer[:max_batch]  # (max_batch,)
        self.qo_indptr = self.buffer[self.off_qo : self.off_qo + max_batch + 1]  # (max_batch+1,)
        self.tree_mask = self.buffer[self.off_mask : self.off_mask + max_total_q * words].view(
            max_total_q, words
        )  # (max_total_q, words)
        self.block_table = self.buffer[self.off_table :].view(max_batch, max_pages)
        self._table_rows = 0  # rows of block_table that may hold non-zero values
        self._drv = self._check = None  # cuda.bindings.driver and its error check, on first use
        self._streams: dict[int, object] = {}  # CUstream handles by raw stream
        self._ring: list[_Slot] = []
        self._next = 0

    def __del__(self) -> None:
        # The staging buffers go back to PyTorch's pinned-memory cache, which does not know about
        # these driver copies: let the last ones finish before the memory can be handed out.
        drv = getattr(self, "_drv", None)
        for slot in getattr(self, "_ring", ()):
            if slot.event is not None and drv is not None:
                with contextlib.suppress(Exception):  # at shutdown CUDA may already be gone
                    drv.cuEventSynchronize(slot.event)
                    drv.cuEventDestroy(slot.event)

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
        slot = self._slot()
        slot.prefix_lens[:batch] = prefix_lens
        slot.prefix_lens[batch:] = 0
        slot.qo_indptr[: batch + 1] = qo_indptr
        slot.qo_indptr[batch + 1 :] = total_q  # padding requests: empty trees
        m = slot.tree_mask
        host_mask = isinstance(tree_mask, np.ndarray)
        if host_mask:
            w = tree_mask.shape[1]
            m[:total_q, :w] = tree_mask[:total_q]
            if w < self.words:
                m[:total_q, w:] = 0
            m[total_q:] = 0
        else:
            m[:] = 0
        t = slot.block_table
        t[:batch, :cols] = block_table
        if cols < self.max_pages:
            t[:batch, cols:] = 0
        if table_rows > batch:
            t[batch:table_rows] = 0
        end = self.off_table + table_rows * self.max_pages
        if slot.event is None:  # the CPU: a plain copy
            self.buffer[:end].copy_(slot.stage[:end])
        else:
            stream = self._stream()
            res = self._drv.cuMemcpyHtoDAsync(
                self.buffer.data_ptr(), slot.stage.data_ptr(), 4 * end, stream
            )
            self._check(res, "cuMemcpyHtoDAsync(plan metadata)")
        if not host_mask:  # a device mask (a speculative round's): copied on the device
            self.tree_mask[:total_q, : tree_mask.shape[1]].copy_(tree_mask[:total_q])
        if slot.event is not None:  # after the mask's copy too: both on the same stream
            self._check(self._drv.cuEventRecord(slot.event, stream), "cuEventRecord(plan)")
        self._table_rows = batch

    def _stream(self) -> object:
        """The CUstream of the plan's device's current stream (not the current device's: a plan
        may live on another), without making a torch Stream object each step."""
        handle = torch._C._cuda_getCurrentRawStream(self.device.index)
        stream = self._streams.get(handle)
        if stream is None:
            stream = self._streams[handle] = self._drv.CUstream(handle)
        return stream

    def _slot(self) -> _Slot:
        """The next staging buffer of the ring, once no queued copy reads it any more."""
        cuda = self.device.type == "cuda"
        if len(self._ring) < (_RING if cuda else 1):  # made on first use (pinned host memory)
            stage = torch.zeros(self.buffer.numel(), dtype=torch.int32, pin_memory=cuda)
            self._ring.append(_Slot(stage, self, self._new_event() if cuda else None))
            slot = self._ring[-1]
        else:
            slot = self._ring[self._next % len(self._ring)]
            if slot.event is not None:
                res = self._drv.cuEventQuery(slot.event)
                if res[0] == self._drv.CUresult.CUDA_ERROR_NOT_READY:  # two plans behind: wait
                    res = self._drv.cuEventSynchronize(slot.event)
                self._check(res, "cuEventQuery(plan staging)")
        self._next += 1
        return slot

    def _new_event(self) -> object:
        """A driver event (no timing) in the plan's device's context; loads the driver calls."""
        if self._drv is None:
            from cuda.bindings import driver

            from treeverify.kernels.cuda.launch import _check

            self._drv, self._check = driver, _check
        with torch.cuda.device(self.device):  # its primary context current for the create
            res, event = self._drv.cuEventCreate(
                int(self._drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)
            )
        self._check(res, "cuEventCreate(plan staging)")
        return event
