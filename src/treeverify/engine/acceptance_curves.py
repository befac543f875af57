"""Acceptance curves for the adaptive tree budget (engine/budget_controller.py): what a request
is expected to accept at each budget bucket, learnt for free from every round. Torch-free.

A_r(B), the drafts request r is expected to accept in a budget-B tree, is the sum over the
buckets up to B of each bucket's gain over the bucket below (the drafts it adds), each an
exponentially decayed mean over r's rounds. Every round measures the gains of every bucket at or
below the one it used: the budget-B' tree is exactly the first B' nodes of the larger tree
(spec/tree.py) and node indices grow along a path, so the walk in the smaller tree is the
accepted path cut at its first node index > B' (exact at T=0; for sampled walks the same
per-node samples give the same cut, so the estimate is unbiased). A request's gain shrinks
toward its class's engine-wide curve, a prior worth `prior_rounds` rounds, and moves to its own.

Gains, not levels: a bucket above the current one is not measured while the controller stays
below it, and a stale level there would outlive a drop in predictability that the fresh levels
below show (and pull the budget up); a stale gain rides on the fresh levels below it.

The functions here run per request per step or round: they update and read `DecayedMean`s in
place, in one pass over the buckets, with no call a bucket.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class DecayedMean:
    """sum(w_i x_i) / sum(w_i) as (num, den), older observations down-weighted by a decay per
    new one: updated and read in place (no call an entry)."""

    __slots__ = ("num", "den")

    def __init__(self) -> None:
        self.num = self.den = 0.0


Curve = dict[int, DecayedMean]  # bucket -> decayed mean of its gain over the bucket below


@dataclass
class RequestCurve:
    """One request's own rounds: its gains, and the buckets of its acceptance trials."""

    curve: Curve = field(default_factory=dict)
    tried_up: set[int] = field(default_factory=set)


def accepted_at_budgets(path: list[int], buckets: tuple[int, ...]) -> dict[int, int]:
    """Accepted drafts each (smaller) budget would have had: path = node indices along the
    accepted path, root (0) first; the budget-B tree holds nodes 0..B."""
    out = {}
    for b in buckets:
        n = 0
        for node in path[1:]:
            if node > b:
                break
            n += 1
        out[b] = n
    return out


def estimate_curve(buckets: tuple[int, ...], own: RequestCurve | None, prior: Curve,
                   prior_rounds: float) -> list[float | None]:  # fmt: skip
    """A_r(B) for every bucket in order (bucket 0: 0), in one pass over the gains: a bucket's
    gain is the request's own decayed mean shrunk toward the `prior` curve, (own num +
    prior_rounds x prior mean) / (own den + prior_rounds), or the prior's mean where the
    request has no rounds there; None from the first never-measured bucket on. Inlined (no call
    a bucket; the same floats): this runs per request per step (scripts/controller_cost.py
    --rounds, 8 requests: 51-56 -> 48 us)."""
    out: list[float | None] = [0.0]
    total = 0.0
    k = prior_rounds
    mine_curve = own.curve if own else None
    for b in buckets[1:]:
        g = prior.get(b)
        mine = mine_curve.get(b) if mine_curve is not None else None
        if mine is None or not mine.den:
            if g is None or not g.den:
                break
            total += g.num / g.den
        elif g is None or not g.den:
            total += mine.num / mine.den
        else:
            total += (mine.num + k * (g.num / g.den)) / (mine.den + k)
        out.append(total)
    out += [None] * (len(buckets) - len(out))
    return out


def feed_round(buckets: tuple[int, ...], path: list[int], budget: int,
               fed: list[tuple[Curve, float]]) -> None:  # fmt: skip
    """One verified round at `budget` (path = accepted node indices, root first) added to each
    (curve, decay) of `fed`: every bucket's gain over the one below, up to `budget`, in one walk
    (`accepted_at_budgets`' cuts: node indices grow along a path)."""
    nodes, k, prev = path[1:], 0, 0
    for b in buckets[1:]:
        if b > budget:
            break
        while k < len(nodes) and nodes[k] <= b:
            k += 1
        gain, prev = k - prev, k
        for curve, d in fed:
            mean = curve.get(b)
            if mean is None:
                mean = curve[b] = DecayedMean()
            mean.num = mean.num * d + gain
            mean.den = mean.den * d + 1.0


def fade(curve: Curve, d: float) -> None:
    """Every bucket's rounds weigh `d` times less (a plain step measures no acceptance: the
    request's own estimate moves toward its prior)."""
    for mean in curve.values():
        mean.num *= d
        mean.den *= d
