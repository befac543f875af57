"""Host -> device copies that do not stall the host.

A `.to("cuda")` of an ordinary (pageable) CPU tensor returns only after the copy, and the copy
waits for everything already queued on the stream: the host stops until the GPU drains, every
time. Staging through pinned memory with non_blocking=True queues the copy and returns at once
(PyTorch's pinned allocator keeps the staging block alive until the copy has run). Measured on
the H200: ~0.1 ms per call and the GPU idle behind it (scripts/profile_round.py).
"""

from __future__ import annotations

import torch


def to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`data` (a list or a CPU tensor) on `device`, queued asynchronously on a GPU."""
    if device.type != "cuda":
        return torch.as_tensor(data, dtype=dtype, device=device)
    host = torch.as_tensor(data, dtype=dtype)
    return host.pin_memory().to(device, non_blocking=True)


def pinned(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`data` as a CPU tensor, in pinned memory when `device` is a GPU (for copy_ sources)."""
    host = torch.as_tensor(data, dtype=dtype)
    return host.pin_memory() if device.type == "cuda" else host
