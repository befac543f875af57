"""A whole round's own state, on the device (engine/round_graphs.py): its nodes' KV slots from
the staged page table, and the next round's inputs from its result (lookahead).

Both run inside the captured round. As torch ops they are ~12 small kernels each, ~2 us apiece
on the GPU (the whole round went 0.64 -> 0.69 ms on the H200 when they were added); on CUDA each
is one launch of kernels/cuda/round_state.cu instead (integer arithmetic: the same values,
tests/test_round_graphs_gpu.py). The torch versions run on the CPU and are the reference.
"""

from __future__ import annotations

import ctypes

import torch


def _kernel(device: torch.device):
    from treeverify.kernels.cuda.launch import load
    from treeverify.kernels.cuda.variants import RoundStateVariant
    from treeverify.spec.tree_heap import available

    return load(RoundStateVariant(), device) if available(device) else None


class RoundState:
    """The state updates of one engine's whole rounds; `fused`: the CUDA kernel (a GPU with
    cuda-python), else torch ops."""

    def __init__(self, device: torch.device, page_size: int, fused: bool = True):
        self.device, self.page_size = device, page_size
        self.kernel = _kernel(device) if fused and device.type == "cuda" else None

    def node_slots(self, v: dict[str, torch.Tensor], b: int, n: int, scratch: int) -> None:
        """v["slots"][:b*n] = node i of request r at position prefix[r] + i, through the staged
        page table (P, B); padding rows (valid 0): the scratch slot."""
        if self.kernel is not None:
            self._launch(0, b, n, scratch, v, None, None, None, 0)
            return
        ps, table = self.page_size, v["table"]  # (P, B) pages-major
        pos = v["prefix"][:b].long()[:, None] + torch.arange(n, device=self.device)  # (b, n)
        req = torch.arange(b, device=self.device)[:, None]  # (b, 1)
        page = table[(pos // ps).clamp(max=table.shape[0] - 1), req].long()  # (b, n)
        real = v["valid"][: b * n].view(b, n) != 0  # (b, n)
        v["slots"][: b * n].view(b, n).copy_(torch.where(real, page * ps + pos % ps, scratch))

    def advance(self, meta: torch.Tensor, b: int, length: torch.Tensor, bonus: torch.Tensor,
                v: dict[str, torch.Tensor], window: int) -> None:  # fmt: skip
        """The next round's inputs from this one's result, in place: for requests with context
        rows, rows read + m (at most `window`, the drafter's), root = bonus, ring end and
        prefix + m. meta: the whole (4, max bucket) int64 draft meta; length, bonus (b,)."""
        if self.kernel is not None:
            length, bonus = (x.to(torch.int64).contiguous() for x in (length, bonus))
            self._launch(1, b, 0, 0, v, meta, length, bonus, window)
            return
        m4 = meta[:, :b]  # (4, b)
        live = m4[0] > 0  # (b,)
        m = torch.where(live, length, 0)  # (b,) accepted nodes + root = positions advanced
        m4[0].copy_(torch.where(live, (m4[0] + m).clamp(max=window), 0))  # rows read
        m4[1].copy_(torch.where(live, bonus, m4[1]))  # the root: this round's bonus
        m4[2].add_(m)  # ring end = the root's position
        prefix = v["prefix"][:b]  # (b,) int32
        prefix.add_(m.to(prefix.dtype))

    def _launch(self, phase: int, b: int, n: int, scratch: int, v, meta, length, bonus,
                window: int) -> None:  # fmt: skip
        table = v["table"]  # (P, B) int32, contiguous view of the stage's twin
        ptr, i32 = ctypes.c_void_p, ctypes.c_int
        none = ptr(0)
        args = [
            i32(phase), i32(n), i32(self.page_size), i32(table.shape[0]), i32(table.shape[1]),
            i32(window), ctypes.c_longlong(scratch),
            ptr(meta.data_ptr()) if meta is not None else none,
            i32(meta.stride(0) if meta is not None else 0),
            ptr(length.data_ptr()) if length is not None else none,
            ptr(bonus.data_ptr()) if bonus is not None else none,
            ptr(v["prefix"].data_ptr()), ptr(table.data_ptr()), ptr(v["valid"].data_ptr()),
            ptr(v["slots"].data_ptr()),
        ]  # fmt: skip
        with torch.cuda.device(self.device):
            self.kernel.launch((b, 1, 1), args, torch.cuda.current_stream(self.device).cuda_stream)
