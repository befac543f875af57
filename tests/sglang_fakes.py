"""Fake but faithful SGLang objects for the integration's CPU tests (SGLang is not installed).

They carry exactly the fields treeverify's backend reads, with SGLang 0.5.23's names, shapes and
dtypes (shared/design/sglang-backend.md): ForwardBatch, ForwardMode, the token pools, a layer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch


class Mode:
    """ForwardMode's predicates for one mode name."""

    def __init__(self, name: str):
        self.name = name

    def is_target_verify(self) -> bool:
        return self.name == "TARGET_VERIFY"

    def is_decode(self) -> bool:
        return self.name == "DECODE"

    def is_extend(self) -> bool:
        return self.name in ("EXTEND", "TARGET_VERIFY")


class MHAPool:
    """MHATokenToKVPool: per layer K and V of [size + page_size, Hkv, D]."""

    def __init__(self, layers, slots, hkv, d, dtype):
        self.k = [torch.zeros(slots, hkv, d, dtype=dtype) for _ in range(layers)]
        self.v = [torch.zeros(slots, hkv, d, dtype=dtype) for _ in range(layers)]

    def get_key_buffer(self, layer_id):
        return self.k[layer_id]

    def get_value_buffer(self, layer_id):
        return self.v[layer_id]

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, k_scale=None, v_scale=None):
        self.k[layer.layer_id][loc] = cache_k
        self.v[layer.layer_id][loc] = cache_v


class MLAPool:
    """MLATokenToKVPool: one [size + page_size, 1, 576] buffer per layer; V is its first 512."""

    def __init__(self, layers, slots, d, dv, dtype):
        self.kv = [torch.zeros(slots, 1, d, dtype=dtype) for _ in range(layers)]
        self.dv = dv

    def get_key_buffer(self, layer_id):
        return self.kv[layer_id]

    def get_value_buffer(self, layer_id):
        return self.kv[layer_id][..., : self.dv]

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, k_scale=None, v_scale=None):
        self.kv[layer.layer_id][loc] = cache_k  # k only: V is a view of it


def random_parents(n: int, rng: random.Random) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def naive_full_mask(parents: list[list[int]], prefix: list[int]) -> list[int]:
    """SGLang's FULL_MASK flat layout from first principles: per request [N, P+N], row-major."""
    flat = []
    for row, p in zip(parents, prefix, strict=True):
        for i in range(len(row)):
            seen, j = {i}, row[i]
            while j >= 0:
                seen.add(j)
                j = row[j]
            flat += [1] * p + [int(j in seen) for j in range(len(row))]
    return flat


@dataclass
class VerifyCase:
    """One random target-verify step laid out the way SGLang lays it out."""

    batch: SimpleNamespace  # the ForwardBatch
    parents: list[list[int]]
    prefix: list[int]
    slots: list[list[int]]  # per request: slot of every position 0..P+N-1
    k_draft: torch.Tensor  # (B*N, Hkv, Dqk)
    v_draft: torch.Tensor  # (B*N, Hkv, Dv)
    extra: dict = field(default_factory=dict)


def make_verify_case(
    rng: random.Random, *, page_size: int, mla: bool, n: int, prefix: list[int],
    hkv: int = 2, d: int = 16, dv: int = 16, layers: int = 1, rows: int = 6, ctx: int = 160,
    dtype=torch.float32,
) -> VerifyCase:  # fmt: skip
    bsz = len(prefix)
    pages_each = [-(-(p + n) // page_size) for p in prefix]
    num_pages = sum(pages_each) + 5
    page_ids = list(range(1, num_pages))  # page 0 left free, as SGLang keeps slot 0 for padding
    rng.shuffle(page_ids)
    slots_total = (num_pages + 1) * page_size  # size + page_size
    if mla:
        pool = MLAPool(layers, slots_total, d, dv, dtype)
    else:
        pool = MHAPool(layers, slots_total, hkv, d, dtype)
    req_to_token = torch.randint(0, slots_total, (rows, ctx), dtype=torch.int32)  # stale junk
    pool_rows = rng.sample(range(rows), bsz)
    slots, out_loc = [], []
    for b in range(bsz):
        pages = [page_ids.pop() for _ in range(pages_each[b])]
        s = [pages[t // page_size] * page_size + t % page_size for t in range(prefix[b] + n)]
        if page_size == 1:
            rng.shuffle(s)  # a token pool hands out any free slots
        req_to_token[pool_rows[b], : len(s)] = torch.tensor(s, dtype=torch.int32)
        slots.append(s)
        out_loc += s[prefix[b] :]
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    for layer in range(layers):
        kb = pool.get_key_buffer(layer)
        kb.copy_(torch.randn(kb.shape, generator=g, dtype=torch.float32).to(dtype))
        if not mla:
            vb = pool.get_value_buffer(layer)
            vb.copy_(torch.randn(vb.shape, generator=g, dtype=torch.float32).to(dtype))
    parents = [random_parents(n, rng) for _ in range(bsz)]
    mask = torch.tensor(naive_full_mask(parents, prefix), dtype=torch.bool)
    k_draft = torch.randn(bsz * n, 1 if mla else hkv, d, generator=g).to(dtype)
    v_draft = k_draft[..., :dv] if mla else torch.randn(bsz * n, hkv, dv, generator=g).to(dtype)
    batch = SimpleNamespace(
        forward_mode=Mode("TARGET_VERIFY"),
        batch_size=bsz,
        req_pool_indices=torch.tensor(pool_rows, dtype=torch.int64),
        seq_lens=torch.tensor(prefix, dtype=torch.int64),
        out_cache_loc=torch.tensor(out_loc, dtype=torch.int64),
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
        token_to_kv_pool=pool,
        spec_info=SimpleNamespace(custom_mask=mask, draft_token_num=n),
    )
    return VerifyCase(batch, parents, prefix, slots, k_draft, v_draft)


def brute_force_attention(case: VerifyCase, q, layer_id, hq, dv, scale, mla):
    """float64 dense attention of every tree node over its prefix and ancestors-or-self."""
    pool = case.batch.token_to_kv_pool
    kb = pool.get_key_buffer(layer_id).double()
    vb = pool.get_value_buffer(layer_id).double()
    n = len(case.parents[0])
    out = torch.zeros(q.shape[0], hq, dv, dtype=torch.float64)
    for b, (row, p) in enumerate(zip(case.parents, case.prefix, strict=True)):
        for i in range(n):
            seen, j = {i}, row[i]
            while j >= 0:
                seen.add(j)
                j = row[j]
            pos = list(range(p)) + [p + j for j in sorted(seen)]
            sl = torch.tensor([case.slots[b][t] for t in pos])
            k, v = kb[sl], vb[sl]  # (S, Hkv, D)
            group = hq // k.shape[1]
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
            qi = q[b * n + i].double()  # (Hq, D)
            s = torch.einsum("hd,shd->hs", qi, k) * scale
            out[b * n + i] = torch.einsum("hs,shd->hd", s.softmax(-1), v)
    return out
