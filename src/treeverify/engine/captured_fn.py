"""A tensor function captured once per batch bucket, replayed with new inputs.

For the pieces of a speculative round that are many small kernels and depend only on fixed-size
tensors (the DDTree build + mask compile, the greedy accept + K/V move): launching them one by
one costs more host time than the work itself. `CapturedFn` captures `fn` for each batch bucket
over static input buffers; a call copies its inputs into the first B rows, resets the padding
rows to the example inputs' values (so a function with side effects, like a K/V move, sees
harmless rows there), replays, and returns the outputs' first rows. No sync.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from treeverify.engine.cuda_graphs import capturing


class CapturedFn:
    def __init__(
        self,
        fn: Callable[..., tuple[torch.Tensor, ...]],
        example_inputs: Callable[[int], tuple[torch.Tensor, ...]],  # batch -> static inputs
        batch_sizes: Sequence[int],
        rows_per_item: Sequence[int],  # per output: rows per batch item (e.g. N for a mask)
        pool=None,
    ):
        self.fn, self.rows_per_item = fn, list(rows_per_item)
        self.batch_sizes = sorted(batch_sizes)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple, tuple, tuple]] = {}
        self.pool = pool
        for b in sorted(self.batch_sizes, reverse=True):
            inputs = example_inputs(b)
            pads = tuple(x.clone() for x in inputs)  # what padding rows are reset to
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn(*inputs)  # warmup: lazy kernels, autotuning, allocator
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, self.pool):
                outputs = fn(*inputs)
            self.pool = graph.pool()
            for buf, pad in zip(inputs, pads, strict=True):  # warmup/capture may have written
                buf.copy_(pad)
            self.graphs[b] = (graph, inputs, outputs, pads)
        torch.cuda.synchronize()

    def bucket_for(self, batch: int) -> int | None:
        return next((b for b in self.batch_sizes if b >= batch), None)

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        batch = args[0].shape[0]
        bucket = self.bucket_for(batch)
        if bucket is None:
            return self.fn(*args)  # larger than any bucket: eager, same results
        graph, inputs, outputs, pads = self.graphs[bucket]
        for buf, x, pad in zip(inputs, args, pads, strict=True):
            buf[:batch].copy_(x)
            if batch < bucket:
                buf[batch:].copy_(pad[batch:])
        graph.replay()
        return tuple(o[: batch * r] for o, r in zip(outputs, self.rows_per_item, strict=True))
