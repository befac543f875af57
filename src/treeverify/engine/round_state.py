"""A whole round's own state, on the device (engine/round_graphs.py): its nodes' KV slots from
the staged page table, and the next round's inputs from its result (lookahead).

Both run inside the captured round. As torch ops they are ~12 small kernels each, ~2 us apiece
on the GPU (the whole round went 0.64 -> 0.69 ms on the H200 when they were added); on CUDA each
is one launch of kernels/cuda/round_state.cu instead (integer arithmetic: the same values,
tests/test_round_graphs_gpu.py). The torch versions run on the CPU and are the reference.

A whole round takes them through the round's glue: `stage_trees` writes the trees into the verify
stage with the node slots, `path_rows` makes the accepted rows' context indices and advances the
inputs; the draft context then writes those rows (`write_rows`). With `glue`
(TREEVERIFY_ROUND_GLUE, read when the engine is built) each is one kernel of round_state.cu
(five launches -> one, ~9 -> one; in the kernel lists of the b=1 round, H200, forty-seventh
session, the glue was ~20 of the round graph's 132 launches); without, the torch ops.
"""

from __future__ import annotations

import ctypes

import torch

from treeverify import env


def _kernel(device: torch.device, variant: str = "RoundStateVariant"):
    from treeverify.kernels.cuda import variants
    from treeverify.kernels.cuda.launch import load
    from treeverify.spec.tree_heap import available

    return load(getattr(variants, variant)(), device) if available(device) else None


class RoundState:
    """The state updates of one engine's whole rounds; `fused`: the CUDA kernels (a GPU with
    cuda-python), else torch ops; `glue`: stage_trees / path_rows by their kernels too (default:
    TREEVERIFY_ROUND_GLUE; where `fused` loads them), else by torch ops."""

    def __init__(self, device: torch.device, page_size: int, fused: bool = True,
                 glue: bool | None = None):  # fmt: skip
        self.device, self.page_size = device, page_size
        self.kernel = _kernel(device) if fused and device.type == "cuda" else None
        self.glue = env.round_glue() if glue is None else glue
        self.stage_kernel = self.path_kernel = None
        if self.glue and self.kernel is not None:
            self.stage_kernel = _kernel(device, "RoundStageVariant")
            self.path_kernel = _kernel(device, "RoundPathVariant")

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

    def stage_trees(self, v: dict[str, torch.Tensor], b: int, n: int, scratch: int,
                    meta: torch.Tensor, tokens: torch.Tensor, depths: torch.Tensor,
                    mask: torch.Tensor) -> None:  # fmt: skip
        """The round's trees into its verify stage: ids = tokens, positions = each request's
        ring end (meta row 2) + depth, the mask's first w words the tree's and the rest of its
        rows clear, and the node slots (`node_slots`). tokens, depths (b, n) int64; mask
        (b * n, w) int32; meta the (4, >= b) int64 draft meta."""
        rows = b * n
        if mask.shape[1] > v["mask"].shape[1]:
            raise ValueError(f"mask: {mask.shape[1]} words a row exceed the stage's "
                             f"{v['mask'].shape[1]}")  # fmt: skip
        if self.stage_kernel is not None:
            tokens, depths, mask = (x.contiguous() for x in (tokens, depths, mask))
            args = stage_trees_args(self.page_size, v, n, scratch, meta, tokens, depths, mask)
            self._run(self.stage_kernel, b, args)
            return
        self.node_slots(v, b, n, scratch)
        v["ids"][:rows].copy_(tokens.reshape(-1))
        torch.add(depths, meta[2][:b, None], out=v["pos"][:rows].view(b, n))
        v["mask"][:rows].zero_()
        v["mask"][:rows, : mask.shape[1]].copy_(mask)

    def path_rows(self, meta: torch.Tensor, b: int, n: int, packed: torch.Tensor, width: int,
                  scratch_row: int, v: dict[str, torch.Tensor],
                  window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """A round's accepted path as rows for the drafter's context, then the next round's
        inputs (`advance`, from packed's length and bonus). packed (b, 2 + 2k) [length, bonus,
        committed k, path k] (-1 past the path's end). Returns (b * k,) int64 each: the node's
        flat row r * n + node (0 past the end), its position (ring end + depth d) and its ring
        row (ring slot * width + position % width; `scratch_row` past the end)."""
        k = (packed.shape[1] - 2) // 2
        if self.path_kernel is not None:
            dev = packed.device
            rows, pos, ring = (torch.empty(b * k, dtype=torch.int64, device=dev) for _ in range(3))
            packed = packed.contiguous()  # (held by name until the launch is queued)
            args = path_rows_args(n, width, scratch_row, window, packed, meta, v,
                                  (rows, pos, ring))  # fmt: skip
            self._run(self.path_kernel, b, args)
            return rows, pos, ring
        path = packed[:, 2 + k :]  # (b, k)
        depth = torch.arange(k, device=packed.device)
        rows = torch.arange(b, device=packed.device)[:, None] * n + path.clamp(min=0)  # (b, k)
        pos = meta[2][:b, None] + depth[None, :]  # (b, k)
        ring = torch.where(path >= 0, meta[3][:b, None] * width + pos % width, scratch_row)
        out = rows.reshape(-1), pos.reshape(-1), ring.reshape(-1)  # before the advance moves ends
        self.advance(meta, b, packed[:, 0].contiguous(), packed[:, 1].contiguous(), v, window)
        return out

    def _run(self, kernel, b: int, args: list) -> None:
        with torch.cuda.device(self.device):
            kernel.launch((b, 1, 1), args, torch.cuda.current_stream(self.device).cuda_stream)

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
        self._run(self.kernel, b, args)


def stage_trees_args(page_size: int, v: dict[str, torch.Tensor], n: int, scratch: int,
                     meta: torch.Tensor, tokens: torch.Tensor, depths: torch.Tensor,
                     mask: torch.Tensor) -> list:  # fmt: skip
    """round_stage_trees' parameters in its signature's order (tests/test_round_state.py
    checks them against round_state.cu); tokens, depths, mask contiguous."""
    table, out = v["table"], v["mask"]  # (P, B), (R, words)
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    return [
        i32(n), i32(mask.shape[1]), i32(out.shape[1]), i32(page_size), i32(table.shape[0]),
        i32(table.shape[1]), ctypes.c_longlong(scratch), ptr(tokens.data_ptr()),
        ptr(depths.data_ptr()), ptr(meta.data_ptr()), i32(meta.stride(0)),
        ptr(mask.data_ptr()), ptr(v["prefix"].data_ptr()), ptr(table.data_ptr()),
        ptr(v["valid"].data_ptr()), ptr(v["ids"].data_ptr()), ptr(v["pos"].data_ptr()),
        ptr(v["slots"].data_ptr()), ptr(out.data_ptr()),
    ]  # fmt: skip


def path_rows_args(n: int, width: int, scratch_row: int, window: int, packed: torch.Tensor,
                   meta: torch.Tensor, v: dict[str, torch.Tensor],
                   outs: tuple[torch.Tensor, ...]) -> list:  # fmt: skip
    """round_path_rows' parameters in its signature's order; packed (b, 2 + 2k) contiguous,
    outs: rows, pos, ring (b * k,) int64."""
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    k = (packed.shape[1] - 2) // 2
    return [i32(k), i32(n), i64(width), i64(scratch_row), i32(window), ptr(packed.data_ptr()),
            ptr(meta.data_ptr()), i32(meta.stride(0)), ptr(v["prefix"].data_ptr())] + [
        ptr(x.data_ptr()) for x in outs]  # fmt: skip
