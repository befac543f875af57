"""kernels/bits.py: the packed mask layout (bit j of word j // 32, bit 31 = sign) round-trips,
and chain rows see exactly their predecessors (prefill chunks, SGLang's causal mode)."""

from __future__ import annotations

import pytest
import torch

from treeverify.kernels.bits import chain_bits, pack_bits, unpack_tree_mask


@pytest.mark.parametrize("t", [1, 31, 32, 33, 64, 100])
def test_pack_unpack_round_trip(t):
    dense = torch.rand(7, t, generator=torch.Generator().manual_seed(t)) < 0.5  # (7, t)
    words = pack_bits(dense)
    assert words.dtype == torch.int32 and words.shape == (7, (t + 31) // 32)
    assert torch.equal(unpack_tree_mask(words, t), dense)


def test_bit_31_is_the_sign_bit():
    dense = torch.zeros(1, 32, dtype=torch.bool)
    dense[0, 31] = True
    assert int(pack_bits(dense)[0, 0]) == -(2**31)


@pytest.mark.parametrize("n", [1, 5, 32, 33, 70])
def test_chain_rows_see_their_predecessors(n):
    assert torch.equal(unpack_tree_mask(chain_bits(n), n), torch.ones(n, n).tril().bool())
