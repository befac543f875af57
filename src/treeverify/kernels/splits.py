"""Split-KV policy shared by the CUDA and Triton backends (pure Python, no GPU, no triton).

One rule for both backends, mirrored by the device-side functions of both kernels
(``split_chunk``/``num_splits`` in tree_attention.cu and the Triton kernels), so one plan's
capacities mean the same grid whichever backend runs it:

    c_b        = max(chunk, ceil((P_b + T_b) / max_splits))
    c_b        = max(c_b, ceil(sum_r (P_r + T_r) / balance_div))   (balanced plans only)
    chunk_b    = ceil(c_b / chunk) * chunk
    n_splits_b = max(1, ceil((P_b + T_b) / chunk_b))
    split s covers KV positions [s * chunk_b, min(P_b + node_hi, (s + 1) * chunk_b))

`chunk` is the split granularity (a multiple of the KV tile, at least MIN_SPLIT_TOKENS), not the
bucket's maximum split length: a request shorter than the bucket's capacity spreads its own keys
over the same number of CTAs (a batch-1 decode of 520 keys in a bucket sized for 32k keys used
one split per KV head before, 24 us per layer on the H200; 9 splits now).

Balanced plans (v12). Sized from capacities alone, a plan gives every request of a full batch
the same split count, `uniform` = the count that fills one wave when all requests are as long.
In a batch of mixed lengths the longest request then sets the kernel's time alone (SGLang's
batch path, 8 requests of 1..4096 keys at N=64 GQA: one split each, the 4096-key request ~2x
the mean). A balanced plan's grid has room for `balance` x `uniform` splits, and the device rule
makes no split shorter than sum(P_r + T_r) / (max_batch * uniform), the batch's mean share: a
uniform full batch splits exactly as before (each request's keys / uniform), while long
requests of a mixed batch take the spare splits. The cost is the spare grid (CTAs that exit at
once) and a larger partials workspace.

Where the uniform count is one (the batch's requests unsplit fill a wave: SGLang's GQA batch,
8 requests x 8 KV heads x 2 row tiles), the divisor is batch / SINGLE_SPLIT_SHARE instead of
batch (v26): a request is split only past ~8/7 of the mean. A later split starts only when a
short request's CTAs free their SMs and pays a CTA's fixed cost (~10 us, the CTA trace) plus
the merge, so splitting a request barely longer than the mean loses; splitting the long ones
keeps a large first piece, whose remainder, run late, is short. The schedule model
(`scripts/sim_verify_schedule.py --random 200`, CTA costs from the trace) puts this rule at
0.86 / 0.76 / 0.69x the unbalanced time on random mixed batches of 8 at 4k / 8k / 32k keys,
against 0.96 / 0.85 / 0.74x for the v12 rule, and SGLang's page-1 batch at ~75 us (the merge
not included) against 88 (v12) and 94 (unbalanced). Measured on the H200 (fe57828, seed 2026):
87.8 us against 100.1 (v12) and 93.9 (unbalanced); Kimi TP8 103.6 -> 87.7; the mixed-length
grid 1.012x over v12 (docs/performance.md, twenty-third session).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_SPLITS = 64
MIN_SPLIT_TOKENS = 64  # the split granularity: splits are whole multiples of it
SINGLE_SPLIT_SHARE = 8 / 7  # balanced plans of one split a request: no split under this x mean
SINGLE_SPLIT_MIN_BATCH = 4  # below it the divisor would round to about the whole batch
# Largest read (fp32 partials of every split of one row tile) that the last split CTA of a tile
# merges itself, in the forward (CUDA backend): one SM reading more is slower than a merge
# kernel spread over the GPU; below it the saved launch is the bigger win. Decided per tile on
# the device from its own split count, so a plan sized for long contexts still fuses short ones.
FUSED_MERGE_MAX_BYTES = 64 * 1024
MERGE_MODES = ("auto", "forward", "kernel")


@dataclass(frozen=True)
class SplitPolicy:
    max_splits: int  # grid.y; requests use ceil((P+T)/chunk) <= max_splits of them
    chunk: int  # split granularity in KV tokens, a multiple of the KV tile
    balance_div: int = 0  # > 0: no split shorter than the batch's keys / balance_div


def choose_splits(
    *,
    batch: int,
    hkv: int,
    m_tiles: int,
    max_kv: int,
    bn: int,
    num_sms: int,
    ctas_per_sm: int,
    balance: int = 1,
    single_share: float | None = None,
) -> SplitPolicy:
    """Enough CTAs to fill about one wave of the GPU, splits of whole MIN_SPLIT_TOKENS units.

    Decided on the host from the bucket's capacities only, so a captured grid stays valid for
    every length in the bucket; each request's split length follows its own length on the
    device (shorter requests: shorter splits, down to one unit; very short ones: fewer splits).
    `balance` > 1 (batch > 1): a grid with room for that many times the uniform split count,
    taken by the long requests of a mixed batch (the module's docstring); `single_share`
    (default SINGLE_SPLIT_SHARE; 1 = the v12 rule): where the uniform count is one, no split
    shorter than that multiple of the batch's mean keys.
    """
    if balance < 1:
        raise ValueError(f"balance: expected >= 1, got {balance}")
    share = SINGLE_SPLIT_SHARE if single_share is None else single_share
    if not 1.0 <= share <= 4.0:
        raise ValueError(f"single_share: expected a number in 1..4, got {single_share}")
    base = max(1, batch * hkv * m_tiles)
    wave = num_sms * ctas_per_sm
    # Fill one wave without spilling into a second: 144 CTAs on 132 slots take two full waves.
    want = max(1, wave // base)
    by_len = max(1, math.ceil(max_kv / MIN_SPLIT_TOKENS))
    splits = max(1, min(want, by_len, MAX_SPLITS))
    unit = math.lcm(bn, MIN_SPLIT_TOKENS)
    room = max(1, min(splits * balance, by_len, MAX_SPLITS))
    if batch > 1 and room > splits:
        div = batch * splits
        if splits == 1 and batch >= SINGLE_SPLIT_MIN_BATCH:
            div = math.floor(batch / share + 1e-9)  # 8 / (8/7) is 7, not 6.999; >= 1
        return SplitPolicy(room, unit, balance_div=div)
    return SplitPolicy(splits, unit)


def split_chunk(
    kv_total: int, max_splits: int, chunk: int, *, kv_batch: int = 0, balance_div: int = 0
) -> int:
    """KV tokens per split of a request with kv_total = P_b + T_b keys (the device rule);
    `kv_batch`: the batch's keys, sum of P_r + T_r (read by balanced policies only)."""
    c = max(chunk, -(-kv_total // max_splits))
    if balance_div > 0:
        c = max(c, -(-kv_batch // balance_div))
    return -(-c // chunk) * chunk


def num_splits(
    kv_total: int, max_splits: int, chunk: int, *, kv_batch: int = 0, balance_div: int = 0
) -> int:
    """Splits a request with kv_total = P_b + T_b keys uses (the device rule, on the host)."""
    c = split_chunk(kv_total, max_splits, chunk, kv_batch=kv_batch, balance_div=balance_div)
    return max(1, -(-kv_total // c))


def policy_splits(policy: SplitPolicy, kv_totals: list[int]) -> list[int]:
    """Each request's split count under `policy` for a batch of kv_totals (P_b + T_b), the
    plan's padding requests included as 0 (they count towards nothing)."""
    kv_batch = sum(kv_totals)
    return [
        num_splits(kv, policy.max_splits, policy.chunk, kv_batch=kv_batch,
                   balance_div=policy.balance_div)
        for kv in kv_totals
    ]  # fmt: skip


LONGEST_FIRST_MAX_BATCH = 32  # the device ranks a batch in one warp, a lane a request


def split_request(kv_totals: list[int], row: int, split: int, *, longest_first: bool) -> int:
    """The request that grid row `row` (request x KV head // KV heads) of split `split` serves
    in a balanced plan (the device's cta_request_head, device_common.cuh): split 0 in request
    order; later splits, with `longest_first` (v27, TREEVERIFY_CUDA_SPLIT_ORDER=longest) and a
    batch of at most LONGEST_FIRST_MAX_BATCH, the request with `row` requests longer than it
    (ties: the lower index first). `kv_totals`: every request's P_b + T_b, padding included."""
    if split == 0 or not longest_first or len(kv_totals) > LONGEST_FIRST_MAX_BATCH:
        return row
    order = longest_first_order(kv_totals)
    return order[row] if row < len(order) else row


def longest_first_order(kv_totals: list[int]) -> list[int]:
    """Request indices longest first, ties by index: the order a later split's rows take."""
    return sorted(range(len(kv_totals)), key=lambda b: (-kv_totals[b], b))


def fused_merge_limit(mode: str = "auto") -> int:
    """Bytes a row tile's merge may read to run in the forward: `mode` is
    TREEVERIFY_CUDA_SPLIT_MERGE (auto; forward: every tile; kernel: none, for tests and A/B; a
    whole number of KiB: that limit, for A/B of FUSED_MERGE_MAX_BYTES itself, e.g. "128": the
    twenty-third session measured GQA's 128 KB two-split tiles faster merged in the forward on
    SGLang's batch, Kimi's 256 KB ones slower)."""
    if mode.isdigit() and int(mode) < 2**21:
        return int(mode) * 1024
    if mode not in MERGE_MODES:
        raise ValueError(
            f"TREEVERIFY_CUDA_SPLIT_MERGE: expected one of {MERGE_MODES} or a number of KiB "
            f"below 2097152, got {mode!r}"
        )
    return {"auto": FUSED_MERGE_MAX_BYTES, "forward": 2**31 - 1, "kernel": 0}[mode]


# GQA plans whose largest tile merge (every split of a row tile: max splits x tile rows x Dv x 4)
# reads at most this merge every tile in the forward, whatever the context: no merge kernel is
# launched, where under FUSED_MERGE_MAX_BYTES alone it ran every step with nothing to do at short
# contexts. Measured (H200, forty-ninth session, tiny-code's 17-row verify: 16 splits x 34 rows
# x 64 x 4 = 139 KB): the DDTREE-16 round step 0.315 -> 0.301 ms in the engine, DDTree 1.84x ->
# 1.89-1.93x plain at b=1 on code; the 1B decode (4-row tiles) 1.037 -> 1.031 ms. MLA plans keep
# the kernel (the twenty-ninth session: the forward merge 0.85-0.91x on random:mla-moe).
# The 16 splits hold because the engine sizes its plans' split grids for the model's positions
# (TreeAttentionPlan split_kv_len, engine/paged_attention.py); sized by its KV pool (32768 keys in
# bench_pair: 64 splits, 557 KB) the rule never fired (fiftieth session, H100: DDTREE 16 1.927x
# plain as planned, 2.004x with every tile forced into the forward).
SMALL_PLAN_MERGE_BYTES = 160 * 1024


def plan_merge_limit(
    mode: str, *, max_splits: int, tile_rows: int, dv: int, mla: bool, batch: int = 1
) -> int:
    """The forward-merge byte limit a plan launches with: `fused_merge_limit(mode)`, raised under
    `auto` to the plan's largest tile merge when that is at most SMALL_PLAN_MERGE_BYTES (a GQA
    plan of small tiles: every tile merges in the forward, no merge kernel). Batch-1 plans only:
    the rule was measured at b=1; at b=8 the forward merge doubles the attention kernel (tiny-
    code's DDTREE 16 round on an H100, fifty-sixth session: 0.051 -> 0.105 ms a step where the
    merge kernel took 0.059; the round's GPU time -1.3%, inside the noise), as the eighth
    session had measured with older merge code."""
    limit = fused_merge_limit(mode)
    worst = merge_bytes(max_splits, tile_rows, dv)
    small = not mla and batch == 1 and max_splits > 1 and worst <= SMALL_PLAN_MERGE_BYTES
    if mode == "auto" and small:
        return max(limit, worst)
    return limit


def merge_bytes(splits: int, tile_rows: int, dv: int) -> int:
    """fp32 partial bytes one row tile's merge reads (the device rule's left side)."""
    return splits * tile_rows * dv * 4


BALANCE_MIN_KV = 8192  # plans for shorter contexts never balance (measured: they lose)


def balance_pays(
    *, max_kv: int, max_tree: int, hq: int, hkv: int, dqk: int, dv: int, mla: bool
) -> bool:
    """Whether a plan should balance its splits (capacities only, so capture-safe).

    Measured on the H200 (v12, `bench kernel --lengths mixed`, docs/performance.md): balanced
    plans gained 1.08-1.51x on mixed batches at 8k-32k keys but lost 0.6-0.8x at 1k (and up to
    0.75x on the equal-length 1k cases): a balanced plan launches the merge kernel and a
    larger grid on every step, which short contexts cannot amortise. They also lost 0.9x where
    one split's fp32 partials (tree rows x Hq x Dv x 4 bytes, written and read again) outweigh
    the keys it saves reading: MLA at TP1 with N=64, 17 MB of partials a request against 5 MB
    of latent KV for 4k keys. So: contexts of at least BALANCE_MIN_KV keys, and partials of a
    request at most the KV bytes of half its capacity.
    """
    partial_bytes = max_tree * hq * dv * 4
    kv_bytes_per_token = hkv * (dqk if mla else dqk + dv) * 2
    return max_kv >= BALANCE_MIN_KV and partial_bytes <= (max_kv // 2) * kv_bytes_per_token


# The merge kernel's grid bound: 2048 CTAs took the grid 1.008x (equal lengths) / 1.009x (mixed)
# over 8192 on the H200 (sixteenth session, one pass; no case under 0.97x); 512 helped MLA more
# (up to 1.13x) but cost GQA up to 0.82x, whose 32 heads a token then crowd each CTA.
MERGE_MAX_CTAS = 2048


def merge_heads_per_cta(total_q_cap: int, hq: int, max_ctas: int | None = None) -> int:
    """Heads one merge-kernel CTA merges: the fewest (a power of two) that keep its grid of
    total_q_cap x ceil(hq / heads) CTAs within `max_ctas` (default MERGE_MAX_CTAS; 1 for every
    plan under it). A CTA looks its token's request up once for all its heads (a binary search
    over qo_indptr), then exits when the request was not split: fewer, wider CTAs pay fewer
    lookups."""
    max_ctas = max_ctas or MERGE_MAX_CTAS
    heads = 1
    while heads < hq and total_q_cap * -(-hq // heads) > max_ctas:
        heads *= 2
    return heads


def split_lanes_pay(mode: str, *, max_splits: int, merge_ctas: int, num_sms: int) -> bool:
    """Whether the merge kernel takes a head's splits in 4 lanes (TREEVERIFY_CUDA_MERGE_SPLIT_LANES;
    the kernel's own rule: only plans of more than 8 splits). `mode` 1: always (v30); auto (v31):
    only where the merge grid of `merge_ctas` CTAs is at most one wave: there the merge's time is
    one CTA's dependent loads, which the lanes cut 4x; a grid of several waves is bound by its
    loads in total, which 4x the threads only crowd (v30's N=64 cases, 0.76-0.94x)."""
    if max_splits <= 8 or mode == "0":
        return False
    return mode == "1" or merge_ctas <= num_sms


def merged_in_forward(splits: int, tile_rows: int, dv: int, limit: int, shaped: bool) -> bool:
    """The device rule (split_merge.cuh): a tile of `splits` splits is merged by the forward's
    last CTA when its read is at most `limit`, twice that for 2 splits when `shaped`
    (TREEVERIFY_CUDA_FUSED_MERGE_ILP: such a merge loads 4 rows at a time instead of 2)."""
    return merge_bytes(splits, tile_rows, dv) <= limit * (2 if shaped and splits <= 2 else 1)


def merge_kernel_needed(
    *, max_splits: int, tile_rows: int, dv: int, limit: int, shaped: bool = False
) -> bool:
    """Whether some tile of a plan can exceed the limit (then the merge kernel is launched; it
    skips the tiles the forward merged). `tile_rows` = min(BM, the bucket's packed rows)."""
    return any(
        not merged_in_forward(n, tile_rows, dv, limit, shaped) for n in range(2, max_splits + 1)
    )
