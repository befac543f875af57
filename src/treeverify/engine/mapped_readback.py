"""A captured step's result written straight into pinned host memory by the graph's last kernel,
instead of a copy to the host queued after each replay (TREEVERIFY_MAPPED_READBACK; on by
default since the forty-fourth session's H100 A/B, 0 for the copy): a plain step's (b,)
tokens (engine/decode_ahead.py), a whole round's packed (b, 2 + 2K) rows
(engine/round_graphs.py).

Why: on the H100 the copy of a plain step's (b,) tokens to pinned memory, a DMA on a copy
engine between two replays on the compute engine, costs 14-20 us of a step back to back
(scripts/step_copies_gpu.py, forty-third session: tiny-code b=1 169.5 -> 183.8 us, b=8
252.9 -> 272.6 us), ~8% of tiny-code's plain step. Pinned host memory is mapped into the
device's address space (unified addressing), so a kernel can store to it like device memory;
the host reads it once the step's event has completed.

A graph writes the same addresses on every replay, and a step launched ahead may end before
the host has read the one before it. So each bucket holds two host rows and a device flip: the
kernel writes row `flip` and turns it over; the host, which counts the replays it launched,
reads the row of each launch's parity. A launch's row is written again two launches later,
and the engine launches step k + 2 only after it has read step k.

    put_rows   grid (1,): rows[flip] = values; flip = 1 - flip (one program, a loop over
               BLOCK-wide pieces: the flip is read before it is written)
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def put_rows(Values, Rows, Flip, n, BLOCK: tl.constexpr):
        f = tl.load(Flip)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)  # (BLOCK,)
            m = offs < n
            vals = tl.load(Values + offs, mask=m)
            tl.store(Rows + f * n + offs, vals, mask=m)
        tl.debug_barrier()  # every thread has read the flip before one thread turns it
        tl.store(Flip, 1 - f)

    return put_rows


def put_rows(values: torch.Tensor, rows: torch.Tensor, flip: torch.Tensor) -> None:
    """rows[flip] = values and flip turned over, in one launch (capture-safe). values (n,)
    int64 on the device, contiguous; rows (2, n) int64, pinned host memory on a GPU; flip (1,)
    int64 on the device. Under TRITON_INTERPRET every tensor may be on the CPU (the tests')."""
    n = values.shape[0]
    if values.dim() != 1 or rows.shape != (2, n) or flip.shape != (1,):
        raise ValueError(f"put_rows: values {tuple(values.shape)}, rows {tuple(rows.shape)}, "
                         f"flip {tuple(flip.shape)}; expected (n,), (2, n) and (1,)")  # fmt: skip
    import triton

    block = min(1024, triton.next_power_of_2(max(n, 16)))
    _kernel()[(1,)](values, rows, flip, n, BLOCK=block, num_warps=1)


class MappedRows:
    """One bucket's two host rows of a result's shape, its device flip, and the host's mirror."""

    def __init__(self, shape: tuple[int, ...], device: torch.device):
        pinned = device.type == "cuda"
        # (2, *shape) int64, host (pinned on a GPU: the kernel stores to it through unified
        # addressing)
        self.rows = torch.zeros((2, *shape), dtype=torch.int64, pin_memory=pinned)
        self.flip = torch.zeros(1, dtype=torch.int64, device=device)  # (1,) the row written next
        self.parity = 0  # the row the next launch's kernel writes (the host's mirror of flip)

    def write(self, values: torch.Tensor) -> None:
        """Queue the kernel (inside a capture: the graph's last node); values of the rows'
        shape, int64, contiguous."""
        if tuple(values.shape) != tuple(self.rows.shape[1:]) or not values.is_contiguous():
            raise ValueError(f"MappedRows.write: values {tuple(values.shape)}, expected "
                             f"{tuple(self.rows.shape[1:])} contiguous")  # fmt: skip
        put_rows(values.view(-1), self.rows.view(2, -1), self.flip)

    def reset(self) -> None:
        """After capture (a warm-up may have run the kernel): the flip and its mirror at 0."""
        self.flip.zero_()
        self.parity = 0

    def launched(self) -> torch.Tensor:
        """A replay was just launched: the host row its kernel writes, of the result's shape
        (read after its event); the mirror turned over with the device's flip."""
        row = self.rows[self.parity]
        self.parity ^= 1
        return row
