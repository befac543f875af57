"""Split-KV policy shared by the CUDA and Triton backends (pure Python, no GPU, no triton).

One rule for both backends, mirrored by the device-side functions of both kernels
(``split_chunk``/``num_splits`` in tree_attention.cu and the Triton kernels), so one plan's
capacities mean the same grid whichever backend runs it:

    chunk_b    = ceil(max(chunk, ceil((P_b + T_b) / max_splits)) / chunk) * chunk
    n_splits_b = max(1, ceil((P_b + T_b) / chunk_b))
    split s covers KV positions [s * chunk_b, min(P_b + node_hi, (s + 1) * chunk_b))

`chunk` is the split granularity (a multiple of the KV tile, at least MIN_SPLIT_TOKENS), not the
bucket's maximum split length: a request shorter than the bucket's capacity spreads its own keys
over the same number of CTAs (a batch-1 decode of 520 keys in a bucket sized for 32k keys used
one split per KV head before, 24 us per layer on the H200; 9 splits now).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_SPLITS = 64
MIN_SPLIT_TOKENS = 64  # the split granularity: splits are whole multiples of it
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


def choose_splits(
    *, batch: int, hkv: int, m_tiles: int, max_kv: int, bn: int, num_sms: int, ctas_per_sm: int
) -> SplitPolicy:
    """Enough CTAs to fill about one wave of the GPU, splits of whole MIN_SPLIT_TOKENS units.

    Decided on the host from the bucket's capacities only, so a captured grid stays valid for
    every length in the bucket; each request's split length follows its own length on the
    device (shorter requests: shorter splits, down to one unit; very short ones: fewer splits).
    """
    base = max(1, batch * hkv * m_tiles)
    wave = num_sms * ctas_per_sm
    # Fill one wave without spilling into a second: 144 CTAs on 132 slots take two full waves.
    want = max(1, wave // base)
    by_len = max(1, math.ceil(max_kv / MIN_SPLIT_TOKENS))
    splits = max(1, min(want, by_len, MAX_SPLITS))
    unit = math.lcm(bn, MIN_SPLIT_TOKENS)
    return SplitPolicy(splits, unit)


def split_chunk(kv_total: int, max_splits: int, chunk: int) -> int:
    """KV tokens per split of a request with kv_total = P_b + T_b keys (the device rule)."""
    c = max(chunk, -(-kv_total // max_splits))
    return -(-c // chunk) * chunk


def num_splits(kv_total: int, max_splits: int, chunk: int) -> int:
    """Splits a request with kv_total = P_b + T_b keys uses (the device rule, on the host)."""
    c = split_chunk(kv_total, max_splits, chunk)
    return max(1, -(-kv_total // c))


def fused_merge_limit(mode: str = "auto") -> int:
    """Bytes a row tile's merge may read to run in the forward: `mode` is
    TREEVERIFY_CUDA_SPLIT_MERGE (auto; forward: every tile; kernel: none, for tests and A/B)."""
    if mode not in MERGE_MODES:
        raise ValueError(
            f"TREEVERIFY_CUDA_SPLIT_MERGE: expected one of {MERGE_MODES}, got {mode!r}"
        )
    return {"auto": FUSED_MERGE_MAX_BYTES, "forward": 2**31 - 1, "kernel": 0}[mode]


def merge_bytes(splits: int, tile_rows: int, dv: int) -> int:
    """fp32 partial bytes one row tile's merge reads (the device rule's left side)."""
    return splits * tile_rows * dv * 4


def merge_kernel_needed(*, max_splits: int, tile_rows: int, dv: int, limit: int) -> bool:
    """Whether some tile of a plan can exceed the limit (then the merge kernel is launched; it
    skips the tiles the forward merged). `tile_rows` = min(BM, the bucket's packed rows)."""
    return max_splits > 1 and merge_bytes(max_splits, tile_rows, dv) > limit
