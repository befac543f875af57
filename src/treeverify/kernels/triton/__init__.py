"""The Triton backend of tree_attention (triton >= 3.6 on a GPU; the CPU interpreter for tests).

`tree_attention_triton` is the eager entry (called by `treeverify.kernels.tree_attention` after
it validated the arguments); `TritonTreeAttention` is the capture-safe launcher a plan holds.
Importing this package imports triton and decorates the kernels: to use the CPU interpreter, set
TRITON_INTERPRET=1 before the first import. `splits` (the shared split policy) needs no triton.
"""

from __future__ import annotations

from treeverify.kernels.triton.runner import (
    TritonConfig,
    TritonTreeAttention,
    choose_config,
    tree_attention_triton,
)
from treeverify.kernels.triton.splits import SplitPolicy, choose_splits, num_splits

__all__ = [
    "SplitPolicy",
    "TritonConfig",
    "TritonTreeAttention",
    "choose_config",
    "choose_splits",
    "num_splits",
    "tree_attention_triton",
]
