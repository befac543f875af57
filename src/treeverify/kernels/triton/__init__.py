"""The Triton backend of tree_attention (triton >= 3.6 on a GPU; the CPU interpreter for tests).

`tree_attention_triton` is the eager entry (called by `treeverify.kernels.tree_attention` after
it validated the arguments); `TritonTreeAttention` is the capture-safe launcher a plan holds.

Names that need triton are loaded on first access, so `treeverify.kernels.splits` (the
split policy shared with the CUDA backend) imports without triton; `from
treeverify.kernels.triton import tree_attention_triton` raises ImportError where triton is
missing. Loading the kernels decorates them: to use the CPU interpreter, set TRITON_INTERPRET=1
before that first access.
"""

from __future__ import annotations

from treeverify.kernels.splits import SplitPolicy, choose_splits, num_splits

_LAZY = {"TritonConfig", "TritonTreeAttention", "choose_config", "tree_attention_triton"}

__all__ = [
    "SplitPolicy",
    "TritonConfig",
    "TritonTreeAttention",
    "choose_config",
    "choose_splits",
    "num_splits",
    "tree_attention_triton",
]


def __getattr__(name: str):
    if name in _LAZY:
        from treeverify.kernels.triton import runner

        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
