"""Shared by the DFlash fused-kernel tests (CPU interpreter and GPU): a small bf16 drafter with
fused projections, rings in any state, and an fp64 reference of the ring attention."""

from __future__ import annotations

import torch

from treeverify.models.config import LlamaConfig
from treeverify.models.layers import apply_rope_tables
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


def qk_fused_and_torch(d, b: int, max_pos: int, g: torch.Generator, device="cpu") -> dict:
    """Layer 0's block projection of b random blocks at random positions through the fused
    q/k norm + rope kernel (outputs poisoned first) and through torch's ops: the inputs
    (qkv, cos2, sin2), the kernel's (q, kv) and torch's (want_q, want_kv)."""
    from treeverify.spec import dflash_fused

    attn, t = d.layers[0].self_attn, d.block_size
    x = torch.randn(b * t, d.config.hidden_size, generator=g, device=device).to(BF16)
    pos = torch.randint(0, max_pos, (b * t,), generator=g, device=device)
    cos2, sin2 = d.rope.rotate_half_tables(pos, BF16)  # (B*T, D) each
    qkv = torch.nn.functional.linear(x, *attn.qkv).view(b * t, -1, attn.d)
    nan = dict(dtype=BF16, device=device)
    out = (torch.full((b * t, attn.hq, attn.d), float("nan"), **nan),
           torch.full((b, t, 2, attn.hkv, attn.d), float("nan"), **nan))  # fmt: skip
    q, kv = dflash_fused.qk_norm_rope(qkv, attn.q_norm, attn.k_norm, cos2, sin2, attn.hq,
                                      attn.hkv, b, out=out)  # fmt: skip
    want_q = apply_rope_tables(attn.q_norm(attn.q_proj(x).view(b * t, attn.hq, -1)), cos2, sin2)
    want_kv = attn.keys_values(x, cos2, sin2).view(b, t, 2, attn.hkv, -1)
    return dict(qkv=qkv, cos2=cos2, sin2=sin2, q=q, kv=kv, want_q=want_q, want_kv=want_kv)
