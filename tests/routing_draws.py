"""Fresh router logits and biases for the fused-routing tests with no near-tie deciding a row.

The kernel (models/fused_routing.py) takes the lowest index among equal choices, torch.topk
orders exact ties either way, and the kernel's exp and sigmoid may round an ulp away from
torch's: on a row where two deciding values lie within NEAR_TIE the two may rightly pick other
experts or another order. Such rows (0-5 in a thousand) are drawn again. Exact ties alone came
in 0.5-2e-5 of the rows of these layouts (CPU, 1e6 rows each), and torch.topk ordered about
half of the ties other than the kernel: ~2e-4 of the interpreter test's runs, and by the same
rates a few percent of the GPU test's (2082 rows a layout; not measured on a GPU)."""

from __future__ import annotations

import torch

from treeverify.models.config import DeepseekV3Config

NEAR_TIE = 1e-5


def decisive_gaps(logits: torch.Tensor, cfg: DeepseekV3Config, bias: torch.Tensor) -> torch.Tensor:
    """(T,) per row the smallest gap between two values that decide its experts or their order:
    its top k + 1 choices in the kept groups, and its top topk_group + 1 group scores."""
    t, e = logits.shape
    scores = logits.sigmoid() if cfg.scoring_func == "sigmoid" else logits.softmax(-1)
    choice = scores + bias[None, :] if cfg.topk_method == "noaux_tc" else scores
    gaps = []
    if cfg.topk_method != "greedy" and cfg.n_group > 1:
        grouped = choice.view(t, cfg.n_group, e // cfg.n_group)
        if cfg.topk_method == "noaux_tc":
            group = grouped.topk(2, dim=-1).values.sum(-1)  # (T, G)
        else:
            group = grouped.amax(-1)
        best = group.topk(min(cfg.topk_group + 1, cfg.n_group), dim=-1)
        gaps.append(-best.values.diff(dim=-1))
        kept = torch.zeros_like(group, dtype=torch.bool)
        kept.scatter_(1, best.indices[:, : cfg.topk_group], True)
        choice = choice.masked_fill(~kept.repeat_interleave(e // cfg.n_group, 1), float("-inf"))
    top = choice.topk(min(cfg.num_experts_per_tok + 1, e), dim=-1).values
    gaps.append(-top.diff(dim=-1))  # -inf past the kept experts: an infinite gap
    return torch.cat(gaps, dim=-1).amin(-1)


def router_inputs(
    cfg: DeepseekV3Config, tokens: int, g: torch.Generator, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, E) logits ~ 2 N(0, 1) and an (E,) bias ~ 0.3 N(0, 1) from `g`, each row whose
    routing a near-tie decides drawn again."""
    e = cfg.n_routed_experts
    logits = 2 * torch.randn(tokens, e, device=device, generator=g)
    bias = 0.3 * torch.randn(e, device=device, generator=g)
    while (near := decisive_gaps(logits, cfg, bias) <= NEAR_TIE).any():
        logits[near] = 2 * torch.randn(int(near.sum()), e, device=device, generator=g)
    return logits, bias
