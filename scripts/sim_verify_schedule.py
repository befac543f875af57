"""A model of the GQA verify kernel's schedule on the GPU for one SGLang harness batch: which
request's CTAs set the forward's time, with and without balanced splits, in microseconds of CPU.

The batch is scripts/sglang_backend_compare.py's timed draw (its fifth, for --seed), the split
plan the launcher's (kernels/splits.py), and each CTA takes its 64-key tiles at a fixed time
per tile plus a fixed cost (measured on the H200 by the CTA trace's phase marks, twenty-second
session: ~9.7 us a CTA, ~6.3 us before its first tile lands and ~2.6 us after its last, and a
128-row tile 1.43 us at page 1, 1.26 us at page 16; a 256-row tile ~2.65 us at page 16,
nineteenth session, and at page 1 assumed slower in the same ratio); CTAs are dispatched in
the grid's order onto one slot an SM (the ping-pong kernels run one CTA an SM). The merge
(kernel or in-forward) and the rest of the replay are not modelled: compare the printed times
with each other and with the trace's spans, not with a replay. (Before the phase marks the
model took ~1 us of fixed cost a CTA and predicted balanced plans 20 us too fast.)

    PYTHONPATH=src python3 scripts/sim_verify_schedule.py [--seed 2026] [--page 16]
"""

from __future__ import annotations

import argparse
import heapq
import math
import random

from treeverify.kernels.splits import (
    choose_splits,
    longest_first_order,
    num_splits,
    split_chunk,
)


def harness_prefixes(page: int, seed: int, batch: int = 8, n: int = 64, max_prefix: int = 4096):
    """The prefixes of the harness's fifth draw (eager, capture, three replays: the last one is
    timed), consuming its random stream the way Step.draw does."""
    rng = random.Random(seed)
    num_pages = batch * -(-(max_prefix + n) // page) + 2
    prefix: list[int] = []
    for _ in range(5):
        prefix = [rng.randint(1, max_prefix) for _ in range(batch)]
        rng.shuffle(list(range(1, num_pages)))
        for _ in range(batch):
            [rng.randrange(i) for i in range(1, n)]
    return prefix


def forward_us(
    prefix: list[int],
    *,
    n: int,
    hkv: int,
    m_tiles: int,
    balance: int,
    tile_us: float,
    fixed_us: float = 9.7,
    sms: int = 132,
    max_kv: int = 8192,
    single_share: float | None = None,
    merge_us: float = 0.0,
    longest_first: bool = False,
) -> tuple[float, int]:
    """The modelled forward time and the plan's split count; `single_share`: choose_splits'
    (None: its default, 1: the v12 rule); `merge_us` added when some request was split;
    `longest_first`: a balanced plan's later splits serve the requests longest first
    (TREEVERIFY_CUDA_SPLIT_ORDER=longest), else in request order."""
    pol = choose_splits(batch=len(prefix), hkv=hkv, m_tiles=m_tiles, max_kv=max_kv, bn=64,
                        num_sms=sms, ctas_per_sm=1, balance=balance,
                        single_share=single_share)  # fmt: skip
    kv = [p + n for p in prefix]
    total = sum(kv)
    rank = {b: i for i, b in enumerate(longest_first_order(kv))}  # a later split's grid row
    ctas = []
    split = False
    for b, k in enumerate(kv):
        args = dict(kv_batch=total, balance_div=pol.balance_div)
        ns = num_splits(k, pol.max_splits, pol.chunk, **args)
        split |= ns > 1
        c = split_chunk(k, pol.max_splits, pol.chunk, **args)
        for s in range(pol.max_splits):
            keys = min(k, (s + 1) * c) - s * c if s < ns else 0
            dur = math.ceil(keys / 64) * tile_us + fixed_us if keys > 0 else 0.3
            for h in range(hkv):
                for x in range(m_tiles):  # balanced plans dispatch splits last (cta_split)
                    row = rank[b] if longest_first and s > 0 else b
                    key = (s, row, h, x) if pol.balance_div else (b, h, s, x)
                    ctas.append((key, dur))
    slots = [0.0] * sms
    end = 0.0
    for _, dur in sorted(ctas):
        t = heapq.heappop(slots) + dur
        heapq.heappush(slots, t)
        end = max(end, t)
    return end + (merge_us if split else 0.0), pol.max_splits


def random_batches(count: int, seed: int) -> None:
    """Geomean over `count` random batches of 8 (prefixes uniform in 1..L, N = 64, 128-row
    CTAs, page 16's tile cost, 4 us of merge when a request splits) of each balanced rule's
    modelled time over the unbalanced plan's (v26's evidence: kernels/splits.py)."""
    rng = random.Random(seed)
    print(f"{count} random batches of 8 per length, time / unbalanced (geomean, worst):")
    for length in (4096, 8192, 32768):
        batches = [[rng.randint(1, length) for _ in range(8)] for _ in range(count)]
        kw = dict(n=64, hkv=8, m_tiles=2, tile_us=1.26, max_kv=max(8192, length + 64),
                  merge_us=4.0)  # fmt: skip
        base = [forward_us(b, balance=1, **kw)[0] for b in batches]
        cells = []
        rules = (("v12 rule", 1.0, False), ("v26 rule", None, False),
                 ("v26, longest first", None, True))  # fmt: skip
        for name, share, lpt in rules:
            r = [forward_us(b, balance=2, single_share=share, longest_first=lpt, **kw)[0] / t
                 for b, t in zip(batches, base, strict=True)]  # fmt: skip
            geo = math.exp(sum(map(math.log, r)) / len(r))
            cells.append(f"{name} {geo:.3f} ({max(r):.3f})")
        print(f"  L = {length}: " + ", ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--fixed-us", type=float, default=9.7,
                    help="a CTA's fixed cost (what if it were smaller?)")  # fmt: skip
    ap.add_argument("--random", type=int, default=0, metavar="N",
                    help="also: both balanced rules, N random batches of 8 a length")  # fmt: skip
    args = ap.parse_args()
    prefix = harness_prefixes(args.page, args.seed)
    print(f"page {args.page}, seed {args.seed}: prefixes {prefix}")
    t128 = 1.43 if args.page == 1 else 1.26
    shapes = (("128-row CTAs", 2, t128), ("256-row CTAs", 1, 2.65 * t128 / 1.26))
    print(f"  a CTA's fixed cost {args.fixed_us} us")
    for name, m_tiles, tile_us in shapes:
        runs = ((1, None, False), (2, 1.0, False), (2, None, False), (2, None, True),
                (3, None, False), (4, None, False))  # fmt: skip
        for balance, share, lpt in runs:
            us, splits = forward_us(prefix, n=64, hkv=8, m_tiles=m_tiles, balance=balance,
                                    tile_us=tile_us, fixed_us=args.fixed_us,
                                    single_share=share, longest_first=lpt)  # fmt: skip
            rule = " (v12 rule)" if share == 1.0 else ""
            rule += ", later splits longest first" if lpt else ""
            print(f"  {name}, balance {balance}{rule}: {splits} splits a plan, "
                  f"forward ~{us:.1f} us")  # fmt: skip
        # No plan beats every SM busy to the end: the batch's CTA-tiles spread over 132 SMs.
        tiles = sum(math.ceil((p + 64) / 64) for p in prefix) * 8 * m_tiles
        print(f"  {name}: work bound {tiles} CTA-tiles x {tile_us:.2f} us / 132 SMs = "
              f"{tiles * tile_us / 132:.1f} us")  # fmt: skip
    print(
        "  measured on the H200 (CTA traces' spans, 128-row CTAs): balance 1 80.9 us (page 16), "
        "95.3 us (page 1) (twenty-second session); balance 2 76.8-81.2 us at page 16 "
        "(twenty-first, twenty-second), the merge not included"
    )
    if args.random:
        random_batches(args.random, args.seed)


if __name__ == "__main__":
    main()
