"""engine/ring_projection.py: feed-ring rows projected into the DFlash context store with the
gather inside the graph. Against the drafter's own `context_kv` on the same rows, fresh random
inputs, the store poisoned first: every named row gets its keys/values, padding writes only the
scratch ring, every other row is left as it was. The engine-level equivalence (ring ids vs
copies through random histories) is tests/test_feed_ring.py; the engine under CUDA graphs,
tests/test_decode_ahead_gpu.py and tests/test_round_graphs_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from treeverify.engine.ring_projection import RingProjection, buckets_up_to, project_from_ring
from treeverify.models.tiny import build_tiny
from treeverify.spec.dflash_io import tiny_dflash

POISON = 1e4  # far from any key or value a projection writes


def _drafter(device: str, dtype: torch.dtype):
    cfg, model, _ = build_tiny("tiny-llama", seed=0)
    d = tiny_dflash(cfg, seed=1, target_embed=model.model.embed_tokens,
                    target_lm_head=model.lm_head).eval()  # fmt: skip
    return d.to(device=device, dtype=dtype)


def _store(drafter, slots: int, width: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    cfg = drafter.config
    shape = (slots * width, cfg.num_hidden_layers, 2, cfg.num_key_value_heads, cfg.head_dim)
    return torch.full(shape, POISON, dtype=dtype, device=device)


def test_buckets_are_powers_of_two_up_to_the_rows_capped():
    assert buckets_up_to(1) == [16]
    assert buckets_up_to(16) == [16]
    assert buckets_up_to(17) == [16, 32]
    assert buckets_up_to(1056) == [16, 32, 64, 128, 256, 512, 1024]  # chunked beyond
    assert buckets_up_to(100, smallest=8, largest=32) == [8, 16, 32]


def test_eager_projection_writes_exactly_the_named_rows():
    g = torch.Generator().manual_seed(11)
    drafter = _drafter("cpu", torch.float32)
    ring = torch.randn(40, drafter.config.context_features, generator=g)  # (rows, F)
    store = _store(drafter, 4, 16, "cpu", torch.float32)
    ids = torch.randperm(40, generator=g)[:23]
    pos = torch.randint(0, 500, (23,), generator=g)
    dest = torch.randperm(64, generator=g)[:23]
    project_from_ring(drafter, ring, store, torch.stack([ids, pos, dest]))
    with torch.inference_mode():
        want = drafter.context_kv(ring[ids], pos)
    torch.testing.assert_close(store[dest], want)
    others = torch.ones(64, dtype=torch.bool)
    others[dest] = False
    assert bool((store[others] == POISON).all())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (captured graphs)")
@pytest.mark.parametrize("rows", [5, 16, 37, 100])
def test_captured_projection_matches_context_kv(rows):
    """Buckets 16 and 32 so that 37 and 100 rows are chunked (two and four replays), 5 padded:
    the graphs read the index block uploaded for each chunk, not a stale one."""
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator().manual_seed(1000 + rows)
    drafter = _drafter(dev, dt)
    slots, width = 5, 32  # the last slot is scratch
    ring = torch.randn(128, drafter.config.context_features, generator=g).to(dev, dt)
    store = _store(drafter, slots, width, dev, dt)
    scratch = range((slots - 1) * width, slots * width)
    proj = RingProjection(drafter, ring, store, scratch, [16, 32])
    store.fill_(POISON)  # the capture's warm-up wrote the scratch ring
    ids = torch.randperm(128, generator=g)[:rows].numpy()
    pos = torch.randint(0, 4000, (rows,), generator=g).numpy()
    dest = torch.randperm((slots - 1) * width, generator=g)[:rows].numpy()  # not the scratch
    proj(ids.astype(np.int64), pos.astype(np.int64), dest.astype(np.int64))
    torch.cuda.synchronize()
    with torch.inference_mode():
        idx, at = torch.from_numpy(ids).to(dev), torch.from_numpy(pos).to(dev)
        want = drafter.context_kv(ring[idx], at)
    got = store[torch.from_numpy(dest).to(dev)]
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    untouched = torch.ones((slots - 1) * width, dtype=torch.bool)
    untouched[torch.from_numpy(dest)] = False
    assert bool((store[: (slots - 1) * width][untouched.to(dev)] == POISON).all())
    assert proj.replays == -(-rows // 32)
