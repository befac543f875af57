"""One device buffer for the split partials of many plans that never run at once.

A plan's split partials (fp32 outputs and LSEs of every split, kernels/splits.py) and the fused
merge's row-tile counters live at fixed addresses that its captured graphs bake in. SGLang
captures a graph per batch size (dozens) and runs them one at a time on one stream, each layer
consuming its partials before the next launch writes them, so the plans can share one buffer
sized for the largest of them instead of each holding its own: a balanced plan for Kimi TP8 at
64 x 64 tree tokens holds 134 MB of partials (docs/sglang.md), the sum over captured sizes
several GB.

`SplitArena.take()` hands out views of the arena's buffers; a request larger than the arena
allocates a larger buffer, while the plans made before keep the old one alive through their
views (their graphs point at it), so correctness never depends on the order plans are made in;
SGLang 0.5.23 captures its largest batch size first, so in practice one buffer serves all. The
counters must be zero between launches: new ones are zeroed, and every kernel that uses them
resets each counter after use.
"""

from __future__ import annotations

import math

import torch


class SplitArena:
    """Shared fp32 partials + int32 counters for plans run one at a time (never concurrently:
    two plans' launches on two streams at once would overwrite each other's partials)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._f32 = torch.empty(0, dtype=torch.float32, device=self.device)
        self._i32 = torch.zeros(0, dtype=torch.int32, device=self.device)
        self.requests = 0  # views handed out (plans served)
        self.grown = 0  # times a request outgrew the buffers

    @property
    def nbytes(self) -> int:
        """Device bytes of the arena's current buffers (older ones live on in earlier views)."""
        return self._f32.numel() * 4 + self._i32.numel() * 4

    def take(
        self,
        f32_shapes: tuple[tuple[int, ...], ...],
        counters: int,
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Views for one plan: an fp32 tensor per shape in `f32_shapes` (laid end to end, each
        starting at a 256-byte boundary) and `counters` int32 zeros."""
        if counters < 0 or any(d < 0 for s in f32_shapes for d in s):
            raise ValueError(f"f32_shapes / counters: expected sizes >= 0, got {f32_shapes}, "
                             f"{counters}")  # fmt: skip
        align = 64  # fp32 elements: 256 bytes
        offsets, end = [], 0
        for shape in f32_shapes:
            offsets.append(end)
            end += -(-math.prod(shape) // align) * align
        if end > self._f32.numel():
            self.grown += self._f32.numel() > 0
            self._f32 = torch.empty(end, dtype=torch.float32, device=self.device)
        if counters > self._i32.numel():
            self.grown += self._i32.numel() > 0
            self._i32 = torch.zeros(counters, dtype=torch.int32, device=self.device)
        self.requests += 1
        views = [
            self._f32[o : o + math.prod(shape)].view(shape)
            for o, shape in zip(offsets, f32_shapes, strict=True)
        ]
        return views, self._i32[:counters]
