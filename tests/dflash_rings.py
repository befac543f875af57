"""Shared by the DFlash fused-kernel tests (CPU interpreter and GPU): a small bf16 drafter with
fused projections, rings in any state, and an fp64 reference of the ring attention."""

from __future__ import annotations

import torch

from treeverify.models.config import LlamaConfig
from treeverify.spec.dflash import ring_valid
from treeverify.spec.dflash_io import tiny_dflash

BF16 = torch.bfloat16


def drafter(block_size: int = 8, hidden: int = 64, vocab: int = 96, seed: int = 0, device="cpu"):
    """A seeded random bf16 drafter (4 query / 2 KV heads of 32) on a random target embedding and
    lm_head, its projections fused (what the fused path needs)."""
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=hidden // 2)  # fmt: skip
    torch.manual_seed(seed)
    embed = torch.nn.Embedding(vocab, hidden)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    torch.nn.init.normal_(embed.weight, std=1.0)
    torch.nn.init.normal_(head.weight, std=hidden**-0.5)
    embed, head = embed.to(device, BF16), head.to(device, BF16)  # the target's: not moved by d.to
    d = tiny_dflash(cfg, seed, target_embed=embed, target_lm_head=head, block_size=block_size,
                    dtype=BF16)  # fmt: skip
    for layer in d.layers:  # non-trivial norm weights: a swapped q/k weight must show
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            norm.weight.data = (1 + 0.5 * torch.randn_like(norm.weight.float())).to(BF16)
    return d.to(device).fuse_for_inference()


def rings(d, width: int, counts: list[int], ends: list[int], seed: int, device="cpu"):
    """A store of len(counts) + 1 random rings (the extra one unused, a wrong slot must show)
    and the (4, B) meta a draft reads; slots in reverse order."""
    g = torch.Generator().manual_seed(seed)
    cfg = d.config
    shape = (len(counts) + 1, width, cfg.num_hidden_layers, 2, cfg.num_key_value_heads,
             cfg.head_dim)  # fmt: skip
    store = torch.randn(shape, generator=g).to(BF16)
    b = len(counts)
    roots = torch.randint(0, cfg.vocab_size, (b,), generator=g)
    slots = torch.arange(b, 0, -1)
    meta = torch.stack([torch.tensor(counts), roots, torch.tensor(ends), slots])  # (4, B)
    return store.to(device), meta.to(device)


def reference_attention(q, store, layer, meta, rows, block_kv, scale):
    """fp64 softmax attention of each block query over its valid ring rows and the block."""
    counts, _, ends, slots = meta
    bsz, t, _, hkv, d = block_kv.shape
    hq = q.shape[1]
    valid = ring_valid(counts, ends, store.shape[1], rows)  # (B, rows)
    out = torch.empty(bsz, t, hq, d, dtype=torch.float64, device=q.device)
    for b in range(bsz):
        ring = store[slots[b], :rows, layer][valid[b]].double()  # (n, 2, Hkv, D)
        kv = torch.cat([ring, block_kv[b].double()])  # (n + T, 2, Hkv, D)
        for h in range(hq):
            k, v = kv[:, 0, h * hkv // hq], kv[:, 1, h * hkv // hq]  # (n + T, D)
            qh = q.view(bsz, t, hq, d)[b, :, h].double()  # (T, D)
            out[b, :, h] = torch.softmax(qh @ k.T * scale, -1) @ v
    return out.view(bsz * t, hq * d)
