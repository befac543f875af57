"""The split-KV policy (kernels/splits.py, pure Python, no GPU or NVRTC needed): split counts
that fill one wave, balanced plans for mixed batches (v12) and the one-split share (v26), where
balancing pays, the merge grid and the merge-in-forward limit."""

from __future__ import annotations

import math

import pytest

from treeverify.kernels.splits import (
    MIN_SPLIT_TOKENS,
    SINGLE_SPLIT_MIN_BATCH,
    SINGLE_SPLIT_SHARE,
    choose_splits,
    num_splits,
    policy_splits,
    split_chunk,
)


@pytest.mark.parametrize("batch,m_tiles,max_kv", [(1, 1, 32784), (1, 2, 1040), (32, 64, 32832),
                                                  (8, 1, 100), (4, 4, 8256)])  # fmt: skip
def test_split_policy_fills_one_wave_without_short_chunks(batch, m_tiles, max_kv):
    pol = choose_splits(batch=batch, hkv=8, m_tiles=m_tiles, max_kv=max_kv, bn=64, num_sms=132,
                        ctas_per_sm=2)  # fmt: skip
    assert pol.max_splits >= 1 and pol.chunk % 64 == 0 and pol.chunk >= MIN_SPLIT_TOKENS
    base = batch * 8 * m_tiles
    assert base * pol.max_splits <= max(base, 264)  # never a second, mostly empty wave
    for kv in sorted({1, 63, 64, 65, 520, max_kv // 3, max_kv - 1, max_kv}):
        c, n = split_chunk(kv, pol.max_splits, pol.chunk), num_splits(kv, pol.max_splits, pol.chunk)
        assert c % pol.chunk == 0 and n <= pol.max_splits and n * c >= kv  # all keys covered
        assert (n - 1) * c < kv  # no empty split
        if kv >= 2 * pol.max_splits * pol.chunk:
            assert n > pol.max_splits // 2  # a long request uses most splits


def _uniform(pol, batch, kv):
    return policy_splits(pol, [kv] * batch)


@pytest.mark.parametrize("batch,m_tiles,max_kv,cps", [
    (8, 2, 8256, 1), (8, 1, 1040, 2), (4, 4, 8256, 2), (32, 2, 1088, 1), (2, 1, 32832, 2),
    (3, 8, 4160, 1),
])  # fmt: skip
def test_balanced_policy_splits_a_uniform_batch_as_before(batch, m_tiles, max_kv, cps):
    """Balancing adds room, never splits: a full batch of equal lengths (and a batch of one)
    gets exactly the unbalanced policy's splits at every length; the grid only grows."""
    kw = dict(batch=batch, hkv=8, m_tiles=m_tiles, max_kv=max_kv, bn=64, num_sms=132,
              ctas_per_sm=cps)  # fmt: skip
    plain, balanced = choose_splits(**kw), choose_splits(**kw, balance=2)
    assert plain.balance_div == 0 and balanced.max_splits >= plain.max_splits
    if balanced.max_splits > plain.max_splits:
        single = plain.max_splits == 1 and batch >= SINGLE_SPLIT_MIN_BATCH
        div = math.floor(batch / SINGLE_SPLIT_SHARE + 1e-9) if single else batch * plain.max_splits
        assert balanced.balance_div == div
    for kv in sorted({1, 63, 64, 65, 520, max_kv // 3, max_kv - 1, max_kv}):
        assert _uniform(balanced, batch, kv) == _uniform(plain, batch, kv)
    one = dict(kw, batch=1)
    assert choose_splits(**one, balance=2) == choose_splits(**one)  # nothing to balance
    with pytest.raises(ValueError, match="balance"):
        choose_splits(**kw, balance=0)


def test_balanced_policy_spreads_a_mixed_batch():
    """SGLang's batch path at N=64 GQA (8 requests of 1..4096 keys, plan sized for 8192): one
    split each without balancing, so the longest request alone sets the time; balanced, the long
    ones split, every split is at most about the batch's mean length, and the CTAs stay near one
    wave."""
    kw = dict(batch=8, hkv=8, m_tiles=2, max_kv=8256, bn=64, num_sms=132, ctas_per_sm=1)
    plain, balanced = choose_splits(**kw), choose_splits(**kw, balance=2)
    assert plain.max_splits == 1 and balanced.max_splits == 2 and balanced.balance_div == 7
    kv = [4160, 3000, 2100, 1500, 900, 400, 120, 65]
    n = policy_splits(balanced, kv)
    kv_batch = sum(kv)
    chunks = [split_chunk(k, balanced.max_splits, balanced.chunk, kv_batch=kv_batch,
                          balance_div=balanced.balance_div) for k in kv]  # fmt: skip
    assert n == [2, 2, 2, 1, 1, 1, 1, 1] and policy_splits(plain, kv) == [1] * 8
    longest = max(min(c, k) for c, k in zip(chunks, kv, strict=True))
    assert longest <= 2112  # vs 4160 unbalanced (the grid has room for 2 splits)
    for k, c, s in zip(kv, chunks, n, strict=True):
        assert c % balanced.chunk == 0 and s * c >= k and (s - 1) * c < k  # covered, none empty
    assert sum(n) * kw["hkv"] * kw["m_tiles"] <= 2 * 132  # about a wave, never the whole grid


def test_balance_only_where_it_paid_on_the_h200():
    from treeverify.kernels.splits import balance_pays

    gqa = dict(max_tree=64, hq=32, hkv=8, dqk=128, dv=128, mla=False)
    mla_tp1 = dict(max_tree=64, hq=128, hkv=1, dqk=576, dv=512, mla=True)
    mla_tp8 = dict(max_tree=64, hq=8, hkv=1, dqk=576, dv=512, mla=True)
    assert not balance_pays(max_kv=1088, **gqa)  # short contexts lost 0.6-0.8x
    assert balance_pays(max_kv=8256, **gqa) and balance_pays(max_kv=8256, **mla_tp8)
    assert not balance_pays(max_kv=8256, **mla_tp1)  # 17 MB of partials vs 5 MB of KV
    assert balance_pays(max_kv=32832, **mla_tp1)


def test_merge_heads_per_cta_bounds_the_merge_grid():
    from treeverify.kernels.splits import MERGE_MAX_CTAS, merge_heads_per_cta

    assert merge_heads_per_cta(16, 128) == 1  # 2048 (token, head) CTAs: one head each
    assert merge_heads_per_cta(64, 128) == 4  # 8192 -> 2048
    assert merge_heads_per_cta(2048, 128) == 128  # 262k -> 2048: all 128 heads in one CTA
    assert merge_heads_per_cta(16384, 8) == 8  # never more heads than the model has
    for q, h in [(16, 4), (512, 32), (2048, 32), (4096, 128), (100, 3)]:
        heads = merge_heads_per_cta(q, h)
        assert heads <= h or heads == 1
        assert q * -(-h // heads) <= MERGE_MAX_CTAS or heads >= h
    assert merge_heads_per_cta(2048, 32, max_ctas=2048) == 32  # a tighter bound: wider CTAs
    assert merge_heads_per_cta(512, 32, max_ctas=4096) == 4


def test_split_lanes_only_where_the_merge_grid_is_one_wave():
    """TREEVERIFY_CUDA_MERGE_SPLIT_LANES auto (v31): a plan of more than 8 splits whose merge
    grid fits the SMs (MLA-TP8 B1 N=16: 16 tokens x 8 heads = 128 CTAs) takes the split lanes;
    one of several waves (N=64: 512) keeps the plain merge; 1 takes them regardless, 0 never,
    and no mode gives them to plans of 8 or fewer splits (the kernel's own rule)."""
    from treeverify.kernels.splits import split_lanes_pay

    one_wave = dict(max_splits=64, merge_ctas=128, num_sms=132)
    waves = dict(max_splits=16, merge_ctas=512, num_sms=132)
    assert split_lanes_pay("auto", **one_wave) and not split_lanes_pay("auto", **waves)
    assert split_lanes_pay("1", **waves) and not split_lanes_pay("0", **one_wave)
    for mode in ("0", "1", "auto"):
        assert not split_lanes_pay(mode, max_splits=8, merge_ctas=16, num_sms=132)
    assert split_lanes_pay("auto", max_splits=9, merge_ctas=132, num_sms=132)
    assert not split_lanes_pay("auto", max_splits=9, merge_ctas=133, num_sms=132)


def test_two_split_tiles_get_twice_the_limit_when_shaped():
    """TREEVERIFY_CUDA_FUSED_MERGE_ILP (v28): a 2-split tile's merge loads 4 rows at a time, so
    it merges in the forward up to twice the byte limit (SGLang's GQA batch: 128-row d128 tiles,
    128 KiB); 3+ splits keep the limit, so a plan that can split 3 ways still needs the kernel.
    The device rule (split_merge.cuh) is the same expression."""
    from treeverify.kernels.splits import (
        FUSED_MERGE_MAX_BYTES,
        merge_kernel_needed,
        merged_in_forward,
    )

    lim = FUSED_MERGE_MAX_BYTES
    assert merged_in_forward(2, 128, 128, lim, shaped=True)
    assert not merged_in_forward(2, 128, 128, lim, shaped=False)
    assert not merged_in_forward(2, 64, 512, lim, shaped=True)  # Kimi's tiles: 256 KiB
    assert not merged_in_forward(3, 128, 128, lim, shaped=True)
    assert merged_in_forward(3, 32, 128, lim, shaped=True) == merged_in_forward(
        3, 32, 128, lim, False
    )
    assert not merge_kernel_needed(max_splits=2, tile_rows=128, dv=128, limit=lim, shaped=True)
    assert merge_kernel_needed(max_splits=2, tile_rows=128, dv=128, limit=lim, shaped=False)
    # 48-row tiles: 2 splits (48 KiB) and 3 (72 KiB > 64) — the kernel is needed for 3 splits
    assert merge_kernel_needed(max_splits=3, tile_rows=48, dv=128, limit=lim, shaped=True)
    assert not merge_kernel_needed(max_splits=2, tile_rows=48, dv=128, limit=lim, shaped=True)


def test_split_merge_limits_and_launch_rule():
    """A row tile merges in the forward when its read (splits x rows x dv x 4 B) is at most the
    limit; the merge kernel is launched only when some tile of the plan can exceed it."""
    from treeverify.kernels.splits import (
        FUSED_MERGE_MAX_BYTES,
        fused_merge_limit,
        merge_bytes,
        merge_kernel_needed,
    )

    auto = fused_merge_limit("auto")
    assert auto == FUSED_MERGE_MAX_BYTES and fused_merge_limit("kernel") == 0
    assert merge_bytes(64, 128, 512) <= fused_merge_limit("forward")  # the largest tile fits
    assert not merge_kernel_needed(max_splits=1, tile_rows=64, dv=64, limit=0)  # never split
    assert not merge_kernel_needed(max_splits=64, tile_rows=2, dv=64, limit=auto)  # decodes
    assert merge_kernel_needed(max_splits=64, tile_rows=34, dv=64, limit=auto)  # 17-node trees
    rows = auto // (8 * 128 * 4)
    assert not merge_kernel_needed(max_splits=8, tile_rows=rows, dv=128, limit=auto)
    assert merge_kernel_needed(max_splits=8, tile_rows=rows + 1, dv=128, limit=auto)
    assert merge_kernel_needed(max_splits=2, tile_rows=1, dv=64, limit=0)
    with pytest.raises(ValueError, match="TREEVERIFY_CUDA_SPLIT_MERGE"):
        fused_merge_limit("both")
    # A limit in KiB (an A/B of FUSED_MERGE_MAX_BYTES): GQA's two-split 128-row tiles (128 KiB)
    # merge in the forward at "128", MLA's 64-row ones (256 KiB) still by the kernel.
    assert fused_merge_limit("128") == 128 * 1024 == merge_bytes(2, 128, 128)
    assert merge_bytes(2, 64, 512) > fused_merge_limit("128")
    for bad in ("-1", "2097152", "12.5"):
        with pytest.raises(ValueError, match="TREEVERIFY_CUDA_SPLIT_MERGE"):
            fused_merge_limit(bad)


def test_one_split_plans_split_only_past_the_share():
    """v26: where one split a request fills the wave, a request is split only past
    SINGLE_SPLIT_SHARE (8/7) of the batch's mean keys; single_share=1 is the v12 rule, which
    splits anything past the mean (its second piece a few tiles, run late at a CTA's full cost).
    Plans of more splits a request keep the v12 divisor (a uniform batch then splits as before)."""
    kw = dict(batch=8, hkv=8, m_tiles=2, max_kv=8256, bn=64, num_sms=132, ctas_per_sm=1)
    new, v12 = choose_splits(**kw, balance=2), choose_splits(**kw, balance=2, single_share=1.0)
    assert (new.balance_div, v12.balance_div) == (7, 8)
    mean = 2048
    # 1.1x the mean: v12 splits it (2048 + 205), v26 does not; 1.5x: both split.
    kv = [int(mean * 1.1), int(mean * 1.5)] + [mean - 50] * 6
    assert policy_splits(v12, kv)[:2] == [2, 2] and policy_splits(new, kv)[:2] == [1, 2]
    with pytest.raises(ValueError, match="single_share"):
        choose_splits(**kw, balance=2, single_share=0.5)
    # Two splits a request (N = 16, one row tile): the divisor stays batch x splits.
    two = choose_splits(**dict(kw, m_tiles=1), balance=2)
    assert two.max_splits == 4 and two.balance_div == 16
    # Small batches keep the v12 divisor (batch / share would round to about the whole batch).
    small = choose_splits(**dict(kw, batch=3, m_tiles=8), balance=2)
    assert small.balance_div == 3


def test_later_splits_serve_the_longest_requests_first():
    """v27's grid mapping on the host (split_request, the device's cta_request_head): split 0
    and plans that do not order keep request order; later splits take the longest request first,
    ties by index, padding (0 keys) last, rows past the batch unchanged, and batches over one
    warp's 32 lanes keep request order."""
    from treeverify.kernels.splits import LONGEST_FIRST_MAX_BATCH, split_request

    kv = [300, 900, 0, 900, 4000, 64]
    rows = range(len(kv))
    assert [split_request(kv, r, 0, longest_first=True) for r in rows] == list(rows)
    assert [split_request(kv, r, 1, longest_first=False) for r in rows] == list(rows)
    assert [split_request(kv, r, 1, longest_first=True) for r in rows] == [4, 1, 3, 0, 5, 2]
    assert [split_request(kv, r, 3, longest_first=True) for r in rows] == [4, 1, 3, 0, 5, 2]
    assert split_request(kv, 7, 1, longest_first=True) == 7
    wide = list(range(LONGEST_FIRST_MAX_BATCH + 1))
    assert split_request(wide, 0, 1, longest_first=True) == 0
    assert split_request(wide[:-1], 0, 1, longest_first=True) == LONGEST_FIRST_MAX_BATCH - 1


def test_small_gqa_plans_merge_every_tile_in_the_forward():
    """Under auto a GQA plan whose largest tile merge reads at most SMALL_PLAN_MERGE_BYTES merges
    every tile in the forward (no merge kernel): tiny-code's 17-row verify over its 1024
    positions (16 splits of 34 rows, 139 KB); a larger plan, an MLA plan, one split, or another
    mode keeps the limit it had."""
    from treeverify.kernels.splits import (
        FUSED_MERGE_MAX_BYTES,
        SMALL_PLAN_MERGE_BYTES,
        fused_merge_limit,
        merge_bytes,
        merge_kernel_needed,
        plan_merge_limit,
    )

    tiny = dict(max_splits=16, tile_rows=34, dv=64)
    assert merge_bytes(16, 34, 64) == 139264 <= SMALL_PLAN_MERGE_BYTES
    limit = plan_merge_limit("auto", **tiny, mla=False)
    assert limit == 139264 and not merge_kernel_needed(**tiny, limit=limit)
    # under the old rule the kernel ran every step (its tiles past 7 splits exceed 64 KB)
    assert merge_kernel_needed(**tiny, limit=FUSED_MERGE_MAX_BYTES)
    # the 1B decode's 4-row tiles: 64 splits x 4 x 128 x 4 = 128 KB, all in the forward
    assert plan_merge_limit("auto", max_splits=64, tile_rows=4, dv=128, mla=False) == 131072
    # left as they were: a long-context verify, MLA, one split, the explicit modes
    big = dict(max_splits=64, tile_rows=34, dv=64)
    assert plan_merge_limit("auto", **big, mla=False) == FUSED_MERGE_MAX_BYTES
    assert plan_merge_limit("auto", max_splits=4, tile_rows=16, dv=512,
                            mla=True) == FUSED_MERGE_MAX_BYTES  # fmt: skip
    assert plan_merge_limit("auto", max_splits=1, tile_rows=34, dv=64,
                            mla=False) == FUSED_MERGE_MAX_BYTES  # fmt: skip
    for mode in ("kernel", "forward", "32"):
        assert plan_merge_limit(mode, **tiny, mla=False) == fused_merge_limit(mode)
    # batch-1 plans only (measured there): a b=8 plan of the same tiles keeps the limit
    assert plan_merge_limit("auto", **tiny, mla=False, batch=8) == FUSED_MERGE_MAX_BYTES
