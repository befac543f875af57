"""The hand-written CUDA backend of tree_attention (NVRTC-compiled at warmup, cached on disk).

`tree_attention_cuda` is the eager entry (called by `treeverify.kernels.tree_attention` after it
validated the arguments); `TreeAttentionPlan` in treeverify.kernels.plan is the capture-safe one.
Importing this package needs cuda-python (the `cuda` extra); it needs no GPU.
"""

from __future__ import annotations

import cuda.bindings.driver  # noqa: F401  (fail at import when the cuda extra is missing)

from treeverify.kernels.cuda.eager import tree_attention_cuda

__all__ = ["tree_attention_cuda"]
