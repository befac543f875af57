"""Programmatic dependent launch (PDL, sm_90+) for the decode path's Triton kernels.

PDL lets a kernel start while the one before it on the stream still runs; the kernel must wait
(griddepcontrol.wait) before it reads what that kernel wrote. Two switches use it here:

- `TREEVERIFY_DECODE_GEMV_PDL` (default on, sm_90+): the decode GEMV goes out by PDL and loads
  its weights before it waits (models/gemv.py); the Triton kernels in front of it signal their
  dependents as they start (griddepcontrol.launch_dependents), so those loads overlap them.
- `TREEVERIFY_TRITON_PDL` (default on, sm_90+; 1.04x on random:mla-moe's decode): the Triton
  kernels themselves (the decode path's, and since the fifty-first session the DFlash
  drafter's, spec/dflash_fused.py) go out by PDL: each program waits for the kernel before it
  as it starts (every program, so that the kernel's completion still implies the previous
  kernel's: stream order for what follows), then signals its own dependents. What overlaps is a
  kernel's launch and scheduling.

A kernel takes `PDL: tl.constexpr`; when set its programs begin with `gdc_wait()` (a no-op in a
normal launch) and `gdc_launch_dependents()`. `flags(x)` gives a launch's keyword arguments
(PDL, and launch_pdl when the kernel itself goes out by PDL); the CPU interpreter: PDL off.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def available() -> bool:
    """Triton's griddepcontrol wrappers exist (Triton >= 3.3)."""
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return True


def gdc():
    """(gdc_wait, gdc_launch_dependents) for a kernel factory to close over, or (None, None)
    without them (flags() then keeps PDL off, so no kernel calls them)."""
    if not available():
        return None, None
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    return gdc_wait, gdc_launch_dependents


def flags(x: torch.Tensor) -> dict:
    """The PDL keyword arguments of a Triton launch on x's device: {"PDL": bool} and, when the
    kernel itself goes out by PDL, "launch_pdl": True."""
    if not x.is_cuda:
        return {"PDL": False}
    return _flags(x.device.index if x.device.index is not None else torch.cuda.current_device())


@functools.cache
def decode_gemv(device_index: int) -> bool:
    """Whether the decode GEMV (models/gemv.py) goes out by PDL on this device:
    TREEVERIFY_DECODE_GEMV_PDL not 0, and sm_90+. Read once per process and device."""
    from treeverify import env

    return env.decode_gemv_pdl() != "0" and torch.cuda.get_device_capability(device_index)[0] >= 9


@functools.cache
def _flags(device_index: int) -> dict:
    from treeverify import env
    from treeverify.models import gemv

    if not available() or torch.cuda.get_device_capability(device_index)[0] < 9:
        return {"PDL": False}
    launch = env.triton_pdl()
    trigger = gemv.enabled() and decode_gemv(device_index)
    out: dict = {"PDL": launch or trigger}
    if launch:
        out["launch_pdl"] = True
    return out


def describe() -> str:
    """One line for the startup log: which kernels of the decode path go out by PDL."""
    if not torch.cuda.is_available() or not available():
        return "PDL: off (no GPU, or no griddepcontrol in this Triton)"
    f = _flags(torch.cuda.current_device())
    if not f["PDL"]:
        return "PDL: off (below sm_90, or TREEVERIFY_DECODE_GEMV_PDL=0)"
    kernels = "the decode GEMV and the Triton kernels" if "launch_pdl" in f else "the decode GEMV"
    return f"PDL: {kernels} (TREEVERIFY_DECODE_GEMV_PDL, TREEVERIFY_TRITON_PDL)"
