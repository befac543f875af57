"""KV pool sizing from `--mem-fraction-static`, as SGLang defines it.

mem_fraction_static is the fraction of the GPU's memory for the static part: weights + KV pool.
Measured after the weights are loaded: everything already in use on the device (weights, the
CUDA context, other processes) counts against it, and the rest of that fraction becomes KV pages.
The remaining 1 - fraction is left for activations, the attention plans' workspaces and the CUDA
graph pool; `check_headroom` verifies after warmup and capture that this really fitted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from treeverify.engine.kv_cache import KVSpec, bytes_per_token

log = logging.getLogger("treeverify.engine")
GIB = 1024**3


@dataclass
class KVSizing:
    num_pages: int
    tokens: int
    kv_bytes: int
    total_bytes: int  # the device's memory
    used_before_bytes: int  # in use after loading the weights
    fraction: float

    def describe(self) -> str:
        return (
            f"KV cache: {self.tokens} tokens, {self.kv_bytes / GIB:.2f} GiB "
            f"({self.num_pages} pages; mem_fraction_static {self.fraction} of "
            f"{self.total_bytes / GIB:.1f} GiB, {self.used_before_bytes / GIB:.2f} GiB in use "
            f"after load)"
        )


def size_kv_pool(
    spec: KVSpec,
    dtype: torch.dtype,
    page_size: int,
    mem_fraction_static: float,
    device: torch.device,
    *,
    max_pages: int | None = None,
) -> KVSizing:
    """Pages that fit in `mem_fraction_static` of the device after what is loaded now."""
    if not 0.0 < mem_fraction_static < 1.0:
        raise ValueError(
            f"mem_fraction_static: expected a fraction in (0, 1), got {mem_fraction_static}"
        )
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    budget = int(total * mem_fraction_static) - used
    per_page = bytes_per_token(spec, dtype) * page_size
    pages = budget // per_page - 1  # one page is the scratch page
    if max_pages is not None:
        pages = min(pages, max_pages)
    if pages < 1:
        raise ValueError(
            f"mem_fraction_static: {mem_fraction_static} of {total / GIB:.1f} GiB leaves "
            f"{budget / GIB:.2f} GiB after loading ({used / GIB:.2f} GiB in use): not one KV "
            f"page of {per_page} bytes; raise --mem-fraction-static or free the GPU"
        )
    return KVSizing(pages, pages * page_size, (pages + 1) * per_page, total, used,
                    mem_fraction_static)  # fmt: skip


def free_bytes(device: torch.device) -> int | None:
    """Memory free for a new allocation on `device`: the GPU's free memory, or the host's
    available memory (Linux's MemAvailable); None where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_given_pool(spec: KVSpec, dtype: torch.dtype, num_pages: int, page_size: int,
                     device: torch.device) -> None:  # fmt: skip
    """A pool given by num_pages must fit the device's free memory: a ValueError naming
    num_pages / page_size before anything is allocated (num_pages=10**9 got the process
    OOM-killed at 22 GB building the page lists; a new user's audit)."""
    need = (num_pages + 1) * page_size * bytes_per_token(spec, dtype)  # + the scratch page
    free = free_bytes(device)
    if free is not None and need > free:
        raise ValueError(
            f"num_pages: {num_pages} pages x page_size {page_size} need {need / GIB:.2f} GiB of "
            f"KV cache; {device.type} has {free / GIB:.2f} GiB free (lower num_pages, or leave "
            f"it unset on a GPU to size the pool from mem_fraction_static)"
        )


def check_headroom(device: torch.device, reserve_bytes: int = 256 * 1024**2) -> dict:
    """After warmup and capture: how much is free; a warning when under `reserve_bytes`."""
    free, total = torch.cuda.mem_get_info(device)
    peak = torch.cuda.max_memory_reserved(device)
    out = {"free_bytes": free, "total_bytes": total, "peak_reserved_bytes": peak}
    if free < reserve_bytes:
        log.warning(
            "memory: only %.2f GiB free after warmup and graph capture; lower "
            "--mem-fraction-static if requests run out of memory",
            free / GIB,
        )
    return out
