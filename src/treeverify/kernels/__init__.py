"""Tree-verify attention kernels: one public op, ``tree_attention``, with ``backend=``.

``TreeAttentionPlan`` (capture-safe plan/run) is loaded from ``treeverify.kernels.plan`` on first
access, so this package imports even where that module is absent.
"""

from __future__ import annotations

from treeverify.kernels.api import BACKENDS, resolve_backend, tree_attention
from treeverify.kernels.reference import tree_attention_reference
from treeverify.kernels.validate import TreeAttentionFacts, validate_tree_attention_args

__all__ = [
    "BACKENDS",
    "TreeAttentionFacts",
    "TreeAttentionPlan",
    "resolve_backend",
    "tree_attention",
    "tree_attention_reference",
    "validate_tree_attention_args",
]


def __getattr__(name: str):
    if name == "TreeAttentionPlan":
        from treeverify.kernels.plan import TreeAttentionPlan

        return TreeAttentionPlan
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
