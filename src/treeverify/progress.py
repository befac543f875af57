"""Progress bars for long startup phases (model load, CUDA-graph capture, benchmark runs).

Shown only when stderr is a terminal and tqdm is installed (it is in the ``server`` extra):
logs, systemd's journal and CI stay free of carriage-return noise, and the phase timings are
logged either way.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress(
    items: Iterable[T], desc: str, total: int | None = None, unit: str = "it"
) -> Iterator[T]:
    """``items``, with a tqdm bar on an interactive stderr; the plain iterable otherwise."""
    if not sys.stderr.isatty():
        yield from items
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield from items
        return
    yield from tqdm(items, desc=desc, total=total, unit=unit, leave=False, file=sys.stderr)
