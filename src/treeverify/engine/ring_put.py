"""A plain step's tapped rows written into the DFlash context's feed ring (engine/feed_ring.py)
by a kernel inside the step's own graph (TREEVERIFY_RING_IN_GRAPH; on by default since the
forty-fourth session's H100 A/B, 0 for the copy), instead of a copy queued after each replay.

Why: on the H100 the ring write as a DMA copy between two step graphs costs ~22 us a step back
to back at b=8 (scripts/step_copies_gpu.py, forty-fourth session: 285 -> 308 us), on a plain
step of ~255 us; the DFlash engine's plain steps ran ~16 us dearer than plain decoding's. Inside
the graph it is one more node, no gap between replays, no host launch. Measured (bench_pair,
same passes, H100): the DFlash engine's plain step at b=1 on sampled prose 0.171 ms against the
copy's 0.192-0.202 (plain decoding 0.170); adaptive there 0.91x plain against 0.77-0.81x.

A graph writes the same addresses on every replay, but each step's rows need the ring's next
free rows. So the ring keeps its head on the device too: the kernel reads it, applies the host's
rule (`FeedRing.start_of`: a write that would cross the ring's end starts at the next lap),
copies the rows there and stores the new head. The host replays the same rule for every launch
(`FeedRing.advance`) before the replay, so host and device heads agree without a readback; a
step launched ahead and then discarded wrote its rows and took its ids, as a copy did.

    ring_put   grid (1,): first = lap rule(head, n); buf[first % rows :][:n] = hidden; head =
               first + n (one program, a loop over BLOCK-wide pieces: the head is read before
               it is written)
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def ring_put(Hidden, Buf, Head, n, width, rows, BLOCK: tl.constexpr):
        head = tl.load(Head)
        at = head % rows
        first = tl.where(at + n <= rows, head, head + rows - at)  # the next lap when crossing
        dst = (first % rows) * width
        total = n * width
        for start in range(0, total, BLOCK):
            offs = start + tl.arange(0, BLOCK)  # (BLOCK,)
            m = offs < total
            tl.store(Buf + dst + offs, tl.load(Hidden + offs, mask=m), mask=m)
        tl.debug_barrier()  # every thread has read the head before one thread moves it
        tl.store(Head, first + n)

    return ring_put


def ring_put(hidden: torch.Tensor, buf: torch.Tensor, head: torch.Tensor) -> None:
    """hidden (n, F) contiguous into the ring `buf` (rows, F) at the rows the device `head`
    ((1,) int64, the next id) gives, and the head moved past them: one launch, capture-safe.
    Under TRITON_INTERPRET every tensor may be on the CPU (the tests')."""
    if hidden.dim() != 2 or buf.dim() != 2 or hidden.shape[1] != buf.shape[1]:
        raise ValueError(f"ring_put: hidden {tuple(hidden.shape)}, buf {tuple(buf.shape)}; "
                         f"expected (n, F) and (rows, F)")  # fmt: skip
    if hidden.shape[0] > buf.shape[0]:
        raise ValueError(f"ring_put: {hidden.shape[0]} rows, the ring holds {buf.shape[0]}")
    if hidden.dtype != buf.dtype or not (hidden.is_contiguous() and buf.is_contiguous()):
        raise ValueError(f"ring_put: hidden {hidden.dtype} and buf {buf.dtype} must be of one "
                         f"dtype and contiguous")  # fmt: skip
    if head.shape != (1,) or head.dtype != torch.int64:
        raise ValueError(f"ring_put: head {tuple(head.shape)} {head.dtype}; expected (1,) int64")
    n, width = hidden.shape
    _kernel()[(1,)](hidden, buf, head, n, width, buf.shape[0], BLOCK=1024, num_warps=4)
