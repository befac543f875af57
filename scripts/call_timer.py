"""Wall time of chosen calls inside a running engine: a wrapper on an object's method that adds
each call's seconds and count under a key (scripts/plain_step_host.py,
scripts/controller_engine_cost.py). Inclusive: a call's time holds the calls inside it."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable


def wrap(obj, name: str, key: str, acc: collections.Counter,
         calls: collections.Counter) -> Callable[[], None]:  # fmt: skip
    """obj.name timed into acc[key] and calls[key]; returns the undo (an instance's method:
    the shadowing attribute deleted; a class's own attribute, e.g. torch.cuda.CUDAGraph.replay:
    put back)."""
    f = getattr(obj, name)
    own = name in vars(obj)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[key] += time.perf_counter() - t0
            calls[key] += 1

    setattr(obj, name, wrapper)
    return (lambda: setattr(obj, name, f)) if own else (lambda: delattr(obj, name))
