"""A plain step's tapped rows written into the DFlash context's feed ring (engine/feed_ring.py)
by a kernel inside the step's own graph (TREEVERIFY_RING_IN_GRAPH; on by default since the
forty-fourth session's H100 A/B, 0 for the copy), instead of a copy queued after each replay.

Why: on the H100 the ring write as a DMA copy between two step graphs costs ~22 us a step back
to back at b=8 (scripts/step_copies_gpu.py, forty-fourth session: 285 -> 308 us), on a plain
step of ~255 us; the DFlash engine's plain steps ran ~16 us dearer than plain decoding's. Inside
the graph it is one more node, no gap between replays, no host launch. Measured (bench_pair,
same passes, H100): the DFlash engine's plain step at b=1 on sampled prose 0.171 ms against the
copy's 0.192-0.202 (plain decoding 0.170); adaptive there 0.91x plain against 0.77-0.81x.
(Measured with the copy in one program, a loop; a review found that would take ~0.2-0.4 ms a
step at a large drafter's widths, so the copy is now spread over programs and the head moved by
a second kernel: one more graph node. That form passed its GPU tests on the H100 (e3f2922, the
forty-fifth session) and ran in that lease's pair runs, b=1 sampled prose adaptive 0.962x
plain; its own cost against the one-program form was not measured.)

A graph writes the same addresses on every replay, but each step's rows need the ring's next
free rows. So the ring keeps its head on the device too: the kernel reads it, applies the host's
rule (`FeedRing.start_of`: a write that would cross the ring's end starts at the next lap),
copies the rows there and stores the new head. The host replays the same rule for every launch
(`FeedRing.advance`) before the replay, so host and device heads agree without a readback; a
step launched ahead and then discarded wrote its rows and took its ids, as a copy did.

    put_rows   grid (cdiv(n F, BLOCK),): first = lap rule(head, n); each program copies its
               BLOCK of hidden's n F values to buf's rows from first % rows (a large model's
               rows, F ~ 20k at b = 32, spread over the SMs, not looped in one program)
    advance    grid (1,): head = lap rule(head, n) + n (after put_rows, in stream order: every
               program has read the head before it moves)

Only where Triton is installed (`graphs_write_ring`): without it the step's rows are copied as
before, like every other Triton kernel here keeps its PyTorch path.
"""

from __future__ import annotations

import functools

import torch

from treeverify import env
from treeverify.kernels.api import triton_available


def graphs_write_ring() -> bool:
    """Whether the step graphs write the feed ring themselves: TREEVERIFY_RING_IN_GRAPH on
    and Triton importable (else the copy after each replay)."""
    return env.ring_in_graph() and triton_available()


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    # (the lap rule written in both: a jitted helper must be a module global, and this module
    # imports triton only when a kernel is made)
    @triton.jit
    def put_rows(Hidden, Buf, Head, n, width, rows, BLOCK: tl.constexpr):
        head = tl.load(Head)
        at = head % rows
        first = tl.where(at + n <= rows, head, head + rows - at)  # the next lap when crossing
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
        m = offs < n * width
        tl.store(Buf + (first % rows) * width + offs, tl.load(Hidden + offs, mask=m), mask=m)

    @triton.jit
    def advance(Head, n, rows):
        head = tl.load(Head)
        at = head % rows
        tl.store(Head, tl.where(at + n <= rows, head, head + rows - at) + n)

    return put_rows, advance


def ring_put(hidden: torch.Tensor, buf: torch.Tensor, head: torch.Tensor,
             block: int = 1024) -> None:  # fmt: skip
    """hidden (n, F) contiguous into the ring `buf` (rows, F) at the rows the device `head`
    ((1,) int64, the next id) gives, and the head moved past them: two launches, capture-safe.
    `block`: values a program copies (the tests make it small to run several programs).
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
    if block < 1 or block & (block - 1):
        raise ValueError(f"block: expected a power of 2, got {block}")
    import triton

    n, width = hidden.shape
    put_rows, advance = _kernels()
    put_rows[(triton.cdiv(n * width, block),)](hidden, buf, head, n, width, buf.shape[0],
                                               BLOCK=block, num_warps=4)  # fmt: skip
    advance[(1,)](head, n, buf.shape[0], num_warps=1)
