"""Random DDTree trees with posteriors that walk deep, for the greedy-walk kernels' GPU tests
(tests/test_spec_capture.py, tests/test_fused_accept_gpu.py)."""

from __future__ import annotations

import torch

from treeverify import spec


def tree_and_posterior(gen: torch.Generator, budget: int, bsz: int, dev: torch.device):
    """(tree, posterior (B, T), drafted depth L): a DDTree of `budget` nodes over random
    logits (L 1..15, vocab 2..49), and a posterior naming a random child of each node where one
    was picked (else a random token), so walks go deep; padding nodes (parent -1) never match."""
    n_depth = int(torch.randint(1, 16, (1,), generator=gen))
    vocab = int(torch.randint(2, 50, (1,), generator=gen))
    logits = (torch.randn(bsz, n_depth, vocab, generator=gen) * 2).to(dev)  # (B, L, V)
    roots = torch.randint(0, vocab, (bsz,), generator=gen).to(dev)
    tree = spec.build_tree(logits, budget, roots)
    t = tree.tokens.shape[1]
    post = torch.randint(0, vocab, (bsz, t), generator=gen).to(dev)  # (B, T)
    kids = torch.randint(0, t, (bsz, t), generator=gen).to(dev)
    follow = (tree.parents.gather(1, kids) == torch.arange(t, device=dev)) & (kids > 0)
    post = torch.where(follow, tree.tokens.gather(1, kids), post)
    return tree, post, n_depth
