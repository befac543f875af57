"""Error signatures in server logs (stderr of a launched process, ``journalctl -u`` of a unit)."""

from __future__ import annotations

import re

# (name, pattern); checked line by line, case-insensitive.
SIGNATURES: tuple[tuple[str, re.Pattern], ...] = tuple(
    (name, re.compile(pat, re.IGNORECASE))
    for name, pat in (
        ("traceback", r"Traceback \(most recent call last\)"),
        ("illegal memory access", r"illegal memory access"),
        ("out of memory", r"out of memory|\bOOM\b"),
        ("capture failure", r"(cuda ?)?graph capture[^\n]*fail|capture[^\n]*failed"),
        ("CUDA error", r"CUDA error|cudaError\w*|CUBLAS_STATUS_\w+"),
        ("NCCL error", r"NCCL (error|WARN)"),
        ("segfault", r"Segmentation fault|SIGSEGV"),
    )
)


def scan(lines) -> list[dict]:
    """Matches as ``{"signature", "line"}``, in log order, one per (signature, line)."""
    out = []
    for line in lines:
        for name, pat in SIGNATURES:
            if pat.search(line):
                out.append({"signature": name, "line": line.rstrip()[:300]})
    return out


def summarize(found: list[dict], limit: int = 3) -> str:
    """A one-line summary for a verdict: the distinct signatures and the first matching lines."""
    if not found:
        return ""
    names = sorted({f["signature"] for f in found})
    lines = []
    for f in found:
        if f["line"] not in lines:
            lines.append(f["line"])
    return f"log signatures: {', '.join(names)} (e.g. {' | '.join(lines[:limit])})"
