"""Split-KV policy shared by the CUDA and Triton backends (pure Python, no GPU, no triton).

One rule for both backends, mirrored by the device-side functions of both kernels
(``split_chunk``/``num_splits`` in tree_attention.cu and the Triton kernels), so one plan's
capacities mean the same grid whichever backend runs it:

    chunk_b    = max(chunk, ceil((P_b + T_b) / max_splits))
    n_splits_b = max(1, ceil((P_b + T_b) / chunk_b))
    split s covers KV positions [s * chunk_b, min(P_b + node_hi, (s + 1) * chunk_b))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_SPLITS = 64
MIN_CHUNK_TOKENS = 256  # a split shorter than this costs more in merge traffic than it saves


@dataclass(frozen=True)
class SplitPolicy:
    max_splits: int  # grid.y; requests use ceil((P+T)/chunk) <= max_splits of them
    chunk: int  # KV tokens per split, a multiple of the KV tile


def choose_splits(
    *, batch: int, hkv: int, m_tiles: int, max_kv: int, bn: int, num_sms: int, ctas_per_sm: int
) -> SplitPolicy:
    """Enough CTAs to fill about one wave of the GPU, never splits shorter than MIN_CHUNK_TOKENS.

    Decided on the host from the bucket's capacities only, so a captured grid stays valid for
    every length in the bucket; shorter requests get fewer splits on the device.
    """
    base = max(1, batch * hkv * m_tiles)
    wave = num_sms * ctas_per_sm
    # Fill one wave without spilling into a second: 144 CTAs on 132 slots take two full waves.
    want = max(1, wave // base)
    by_len = max(1, math.ceil(max_kv / MIN_CHUNK_TOKENS))
    splits = max(1, min(want, by_len, MAX_SPLITS))
    chunk = math.ceil(math.ceil(max_kv / splits) / bn) * bn
    return SplitPolicy(splits, max(chunk, bn))


def split_chunk(kv_total: int, max_splits: int, chunk: int) -> int:
    """KV tokens per split of a request with kv_total = P_b + T_b keys (the device rule)."""
    return max(chunk, -(-kv_total // max_splits))


def num_splits(kv_total: int, max_splits: int, chunk: int) -> int:
    """Splits a request with kv_total = P_b + T_b keys uses (the device rule, on the host)."""
    c = split_chunk(kv_total, max_splits, chunk)
    return max(1, -(-kv_total // c))
