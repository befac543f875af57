"""DDTree speculative-decoding algorithms as capture-safe tensor code (CPU or GPU, no host sync).

* ``tree``: ``build_tree`` (Algorithm 1, node for node equal to the heap) and ``DraftTree``;
* ``tree_oracle``: ``build_tree_host``, the literal host heap, kept as the test oracle;
* ``mask``: ancestor-or-self ``tree_mask`` bits, depths and positions from parent arrays;
* ``accept``: greedy and lossless sample-and-walk acceptance on the device;
* ``sglang_layout``: conversion to and from SGLang's target-verify layout.
"""

from .accept import Acceptance, accept_greedy, accept_sampled, sample_per_node, walk_tree
from .mask import (
    depths_from_parents,
    pack_bits,
    parents_to_tree_mask,
    tree_positions,
    unpack_tree_mask,
)
from .sglang_layout import (
    SGLangVerifyLayout,
    from_sglang_verify,
    next_token_sibling_to_parents,
    sglang_mask_to_tree_mask,
    to_sglang_verify,
)
from .tree import DraftTree, build_tree, build_tree_from_topk, draft_topk
from .tree_oracle import build_tree_host, build_tree_host_from_topk

__all__ = [
    "Acceptance",
    "DraftTree",
    "SGLangVerifyLayout",
    "accept_greedy",
    "accept_sampled",
    "build_tree",
    "build_tree_from_topk",
    "build_tree_host",
    "build_tree_host_from_topk",
    "depths_from_parents",
    "draft_topk",
    "from_sglang_verify",
    "next_token_sibling_to_parents",
    "pack_bits",
    "parents_to_tree_mask",
    "sample_per_node",
    "sglang_mask_to_tree_mask",
    "to_sglang_verify",
    "tree_positions",
    "unpack_tree_mask",
    "walk_tree",
]
