"""One graph bucket's step inputs, staged in one pinned host buffer and copied in one transfer.

A replayed step reads its inputs from fixed device buffers: token ids, positions, valid rows (the
graphs'), KV slots (the attention seam's) and each attention plan's metadata (prefix lengths,
qo_indptr, tree mask, page table). Filling them one by one costs the host ~25 torch ops and ~10
copies per step, more than a small model's whole forward on the GPU. Here the host writes all of
them with numpy into one pinned buffer, one non-blocking copy moves it to the device twin, and
the bucket's captured graph begins by unpacking the twin into the fixed buffers (copy kernels
inside the graph, no host cost):

    int64  ids (R) | positions (R) | slots (R) | draw keys (R)                 R = B * n rows
    int32  prefix lens (B) | qo_indptr (B+1) | valid (R) | temperature (R, fp32 bits) |
           mask (R, words) | page table^T (P, B)

Temperatures and draw keys (engine/sample_noise.py's K) are read only by a sampled decode step
launched ahead (engine/decode_ahead.py) and a sampled whole round (engine/round_graphs.py),
which draw each row's token on the device; every other write leaves them 0 (greedy).

The page table is stored transposed so that the pages in use, the first w of P, are a prefix of
the buffer: the copy stops there. Rows of the table past w keep stale page ids, which no kernel
reads (a request reads the pages under its prefix + tree only). A tree round's ids, positions and
mask are on the device already: `write_device_step` stages the host part, and device copies fill
the rest of the twin after the transfer (same stream, so in order).
"""

from __future__ import annotations

import numpy as np
import torch

from treeverify.engine.step_batch import cached_chain, padded_chain


class StepStage:
    def __init__(self, batch: int, n: int, words: int, pages: int, scratch_slot: int,
                 device: torch.device):  # fmt: skip
        self.batch, self.n, self.words, self.pages = batch, n, words, pages
        self.rows = rows = batch * n
        self.scratch_slot = scratch_slot
        self._n64 = 4 * rows  # int64 values, stored as 2 int32 each
        self._o32 = {}  # int32 offsets (past the int64 part)
        off = 2 * self._n64
        for name, size in (("prefix", batch), ("qo", batch + 1), ("valid", rows),
                           ("temp", rows), ("mask", rows * words),
                           ("table", pages * batch)):  # fmt: skip
            self._o32[name] = (off, off + size)
            off += size
        self.size = off
        self._pin = torch.device(device).type == "cuda"  # (a CPU stage: the tests' twin)
        self.host = torch.zeros(off, dtype=torch.int32, pin_memory=self._pin)
        self.dev = torch.zeros(off, dtype=torch.int32, device=device)
        self._host_views(self.host.numpy())
        self._copied = torch.cuda.Event() if self._pin else None  # the last copy enqueued
        if self._copied is not None:
            self._copied.record()
        self.views = self._device_views()  # the twin, typed and shaped
        # the last staged table: each request's page list (the object) and its length then
        self.table_lists: list[tuple[list[int], int]] | None = None

    def _host_views(self, h: np.ndarray) -> None:
        """numpy views of a host buffer: writes without a torch op per value."""
        r = self.rows
        h64 = h[: 2 * self._n64].view(np.int64)
        self.h_ids, self.h_pos, self.h_slots = h64[:r], h64[r : 2 * r], h64[2 * r : 3 * r]
        self.h_key = h64[3 * r : 4 * r]
        part = {k: h[a:b] for k, (a, b) in self._o32.items()}
        self.h_prefix, self.h_qo, self.h_valid = part["prefix"], part["qo"], part["valid"]
        self.h_temp = part["temp"].view(np.float32)
        self.h_mask = part["mask"].reshape(r, self.words)  # (R, words)
        self.h_table = part["table"].reshape(self.pages, self.batch)  # (P, B) transposed

    def _device_views(self) -> dict[str, torch.Tensor]:
        """The device twin, typed and shaped: what a captured graph unpacks from."""
        r, d = self.rows, self.dev
        d64 = d[: 2 * self._n64].view(torch.int64)
        part = {k: d[a:b] for k, (a, b) in self._o32.items()}
        return {
            "ids": d64[:r], "pos": d64[r : 2 * r], "slots": d64[2 * r : 3 * r],
            "key": d64[3 * r : 4 * r],
            "prefix": part["prefix"], "qo": part["qo"], "valid": part["valid"],
            "temp": part["temp"].view(torch.float32),
            "mask": part["mask"].view(r, self.words),  # (R, words)
            "table": part["table"].view(self.pages, self.batch),  # (P, B)
        }  # fmt: skip

    def _fresh_if_busy(self) -> None:
        """The host buffer is rewritten only once its last copy ran; if that copy is still
        queued (the engine reads every step's results first, so it never is), stage into a
        fresh pinned buffer instead (kept by the caching host allocator until its copy ran)."""
        if self._copied is not None and not self._copied.query():
            self.host = torch.zeros(self.size, dtype=torch.int32, pin_memory=True)
            self._host_views(self.host.numpy())

    def _write_common(self, block_tables: list[list[int]], starts: list[int], n: int) -> int:
        """Prefix lens, qo_indptr, valid rows and page table of b requests of n rows each
        (padding requests: empty trees); returns w, the page-table rows in use."""
        b = len(starts)
        if b > self.batch:
            raise ValueError(f"batch: {b} requests exceed the bucket's {self.batch}")
        w = self._write_table(block_tables)
        self.h_prefix[:b] = starts
        self.h_prefix[b:] = 0
        self.h_qo[: b + 1] = np.arange(0, (b + 1) * n, n)
        self.h_qo[b + 1 :] = b * n
        self.h_valid[: b * n] = 1
        self.h_valid[b * n :] = 0
        self.h_temp[:] = 0  # greedy unless a sampled decode step says otherwise
        self.h_key[:] = 0
        return w

    def _write_table(self, block_tables: list[list[int]]) -> int:
        """The requests' pages into the host table (padding requests' columns zeroed); returns
        w, the table rows in use."""
        w = max(len(t) for t in block_tables)
        if w > self.pages:
            raise ValueError(f"block_tables: {w} pages exceed the staged {self.pages}")
        self.table_lists = [(t, len(t)) for t in block_tables]
        table = self.h_table
        table[:w] = 0  # padding requests' columns too
        for i, pages in enumerate(block_tables):
            table[: len(pages), i] = pages
        return w

    def write_decodes(self, tokens: list[int], starts: list[int], slots: list[int],
                      block_tables: list[list[int]], temps: list[float] | None = None,
                      keys: list[int] | None = None) -> None:  # fmt: skip
        """b plain decodes (n = 1): token, position (= its prefix length), slot, pages; for a
        sampled step launched ahead each row's temperature (0: greedy) and draw key."""
        self._fresh_if_busy()
        b = len(tokens)
        w = self._write_common(block_tables, starts, 1)
        if temps is not None:
            self.h_temp[:b], self.h_key[:b] = temps, keys
        self.h_ids[:b], self.h_pos[:b], self.h_slots[:b] = tokens, starts, slots
        self.h_ids[b:], self.h_pos[b:], self.h_slots[b:] = 0, 0, self.scratch_slot
        self.h_mask[:b, 0] = 1  # a decode row sees itself (bit 0)
        self.h_mask[b:] = 0
        self._copy(w)

    def write_prefill(self, tokens: list[int], start: int, slots: list[int],
                      block_table: list[int]) -> None:  # fmt: skip
        """One request's prefill chunk of P <= n tokens (a (1, n) bucket) as a chain of n rows,
        padded as `step_batch.padded_chain` lays it out."""
        self._fresh_if_busy()
        if self.batch != 1:
            raise ValueError(f"tokens: a prefill chain is one request's, not a bucket "
                             f"({self.batch}, {self.n})'s")  # fmt: skip
        ids, pos, slot, valid = padded_chain(tokens, start, slots, self.n, self.scratch_slot)
        w = self._write_common([block_table], [start], self.n)
        self.h_ids[:], self.h_pos[:], self.h_slots[:] = ids.numpy(), pos.numpy(), slot.numpy()
        self.h_valid[:] = valid.numpy()
        chain = cached_chain(self.n).numpy()  # (n, ceil(n/32)): row i sees rows 0..i
        self.h_mask[:, : chain.shape[1]] = chain
        self.h_mask[:, chain.shape[1] :] = 0
        self._copy(w)

    def write_round(
        self,
        block_tables: list[list[int]],
        starts: list[int],
        temps: list[float] | None = None,
        keys: list[int] | None = None,
    ) -> None:
        """The host part of a whole captured round (engine/round_graphs.py): b requests of n
        rows, their prefix lengths and pages (and for sampled requests each one's temperature
        and draw key, on all its rows); the graph itself writes the nodes' slots, the trees'
        ids, positions and mask into the twin after this copy."""
        self._fresh_if_busy()
        w = self._write_common(block_tables, starts, self.n)
        if temps is not None:
            rows = len(temps) * self.n
            self.h_temp[:rows] = np.repeat(np.asarray(temps, dtype=np.float32), self.n)
            self.h_key[:rows] = np.repeat(np.asarray(keys, dtype=np.int64), self.n)
        self._copy(w)

    def table_current(self, block_tables: list[list[int]]) -> bool:
        """Whether the table last staged is exactly these page lists (then a step launched next
        needs no restaging of it). The block manager only appends to a request's table in place
        and replaces it by a new list whenever it loses pages (a commit's shrink, a free), so
        the same list objects at the same lengths are the same tables: O(batch), where
        comparing page ids would be O(pages) every step. (Page counts alone are not enough: a
        round's commit gives reserved tail pages back and a later hold may regrow the table to
        the same length with other pages; a review found the next round reading a stale table.)"""
        rec = self.table_lists
        return (rec is not None and len(rec) == len(block_tables)
                and all(t is r and len(t) == n
                        for (r, n), t in zip(rec, block_tables, strict=True)))  # fmt: skip

    def write_table(self, block_tables: list[list[int]]) -> None:
        """Only the page table (pages held for a round launched ahead, engine/round_graphs.py):
        one copy of the table rows in use; the rest of the twin stays as the device wrote it.
        Queued after the work already launched, so a round in flight reads the table it had."""
        self._fresh_if_busy()
        w = self._write_table(block_tables)
        a = self._o32["table"][0]
        self.dev[a : a + w * self.batch].copy_(self.host[a : a + w * self.batch],
                                                non_blocking=self._pin)  # fmt: skip
        if self._copied is not None:
            self._copied.record()

    def write_device_step(self, starts: list[int], block_tables: list[list[int]],
                          ids: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor, *,
                          pos: torch.Tensor | None = None,
                          depths: torch.Tensor | None = None) -> None:  # fmt: skip
        """b requests of n rows each whose ids and mask (and maybe slots) are on the device
        already (a tree round's): the host part is staged and copied, then device ops fill the
        rest of the twin. ids (b*n,) int64; slots (b*n,) int64, host or device; mask (b*n, W)
        int32; positions either given (pos (b*n,)) or prefix + depth (depths (b, n))."""
        self._fresh_if_busy()
        b, n, v = len(starts), self.n, self.views
        w = self._write_common(block_tables, starts, n)
        rows = b * n
        self.h_ids[rows:], self.h_pos[rows:] = 0, 0
        self.h_mask[:] = 0  # the trees' words are copied in below; the rest stays clear
        self.h_slots[rows:] = self.scratch_slot
        if not slots.is_cuda:
            self.h_slots[:rows] = slots.reshape(-1).numpy()
        self._copy(w)
        v["ids"][:rows].copy_(ids.reshape(-1))
        if pos is not None:
            v["pos"][:rows].copy_(pos)
        else:  # after the copy (same stream): the staged prefix lengths are on the device
            torch.add(depths, v["prefix"][:b, None], out=v["pos"][:rows].view(b, n))
        v["mask"][:rows, : mask.shape[1]].copy_(mask)
        if slots.is_cuda:
            v["slots"][:rows].copy_(slots.reshape(-1))

    def _copy(self, w: int) -> None:
        end = self._o32["table"][0] + w * self.batch  # through the table rows in use
        self.dev[:end].copy_(self.host[:end], non_blocking=self._pin)
        if self._copied is not None:
            self._copied.record()
