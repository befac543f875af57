"""The host side of the GQA kernel's TMA producer (kernels/cuda/tma.py), on the CPU: which page
sizes get TMA boxes and how many rows, and the rank-4 view of both pool layouts that the
tensor map encodes. The maps themselves need the CUDA driver: tests/test_gqa_pingpong_gpu.py."""

from __future__ import annotations

import pytest
import torch

from treeverify.kernels.cuda import tma


@pytest.mark.parametrize(
    "page, rows", [(1, 0), (4, 0), (8, 8), (16, 16), (32, 32), (64, 64), (128, 64), (48, 0)]
)
def test_box_rows_default_min_page(page, rows, monkeypatch):
    monkeypatch.delenv("TREEVERIFY_CUDA_TMA_MIN_PAGE", raising=False)
    assert tma.box_rows(page, 128) == rows


def test_box_rows_min_page_and_head_dims(monkeypatch):
    monkeypatch.setenv("TREEVERIFY_CUDA_TMA_MIN_PAGE", "1")
    assert [tma.box_rows(p, 64) for p in (1, 2, 4, 3, 96, 256)] == [1, 2, 4, 0, 0, 64]
    assert tma.box_rows(16, 96) == 0  # only 64- and 128-wide heads
    monkeypatch.setenv("TREEVERIFY_CUDA_TMA_MIN_PAGE", "zero")
    with pytest.raises(ValueError, match="TREEVERIFY_CUDA_TMA_MIN_PAGE"):
        tma.box_rows(16, 128)


def test_pool_geometry_of_both_layouts():
    paged = torch.empty(10, 16, 8, 128, dtype=torch.bfloat16)  # (pages, page_size, H, D)
    dims, strides = tma.pool_geometry(paged)
    assert dims == [128, 8, 16, 10] and strides == [256, 8 * 256, 16 * 8 * 256]
    slots = torch.empty(500, 4, 64, dtype=torch.float16)  # SGLang's (slots, H, D)
    dims, strides = tma.pool_geometry(slots)
    assert dims == [64, 4, 1, 500] and strides == [128, 4 * 128, 4 * 128]
    with pytest.raises(ValueError, match="k cache"):
        tma.pool_geometry(torch.empty(3, 4))


def test_encodable_wants_16_byte_strides_and_a_contiguous_row():
    assert tma.encodable(torch.empty(10, 16, 8, 128, dtype=torch.bfloat16))
    # A head-sliced view: strides stay multiples of 16 bytes, the base moves by 256 bytes.
    assert tma.encodable(torch.empty(10, 16, 8, 128, dtype=torch.bfloat16)[:, :, 2:4])
    assert not tma.encodable(torch.empty(10, 16, 8, 132, dtype=torch.bfloat16)[..., :128])
    assert not tma.encodable(torch.empty(10, 16, 8, 128, dtype=torch.bfloat16).transpose(2, 3))


def test_tensor_map_is_none_for_a_pool_tma_cannot_read_and_caches_the_answer(monkeypatch):
    """A pool with 264-byte rows cannot be a tensor map: None (the launcher then loads every
    tile by cp.async), decided without the CUDA driver and remembered for the next step."""
    pool = torch.empty(10, 16, 8, 132, dtype=torch.bfloat16)[..., :128]
    assert tma.tensor_map(pool, 16) is None
    monkeypatch.setattr(tma, "encodable", lambda cache: pytest.fail("not cached"))
    assert tma.tensor_map(pool, 16) is None
    assert tma.box_rows(4, 128, min_page=1) == 4 and tma.box_rows(4, 128, min_page=8) == 0
