"""One grid case in SGLang's target-verify layout, and SGLang's own Triton kernel if installed.

`sglang_layout` re-expresses `make_inputs`' tensors (paged cache, block table, packed tree bits)
as SGLang's `extend_attention_fwd` takes them (facts: shared/design/tree-attention.md): the same
cache memory viewed as a token pool `[slots, Hkv, D]`, prefix slot ids in `kv_indices`, the draft
tokens' K/V as `k_extend`/`v_extend`, the tree as the flat FULL_MASK bytes. So SGLang's kernel,
our drop-in and our plan read identical data. SGLang is an optional import (never a dependency);
`load_sglang_extend_attention` says in one line why it is missing.
"""

from __future__ import annotations

import importlib
import inspect

import torch

from treeverify.kernels.bits import unpack_tree_mask

# Where SGLang keeps its Triton extend kernel: 0.5.23's layout first, then older releases'.
EXTEND_ATTENTION_MODULES = (
    "sglang.kernels.ops.attention.extend_attention",
    "sglang.srt.layers.attention.triton_ops.extend_attention",
)


def sglang_layout(inp: dict, page_size: int) -> dict:
    """`make_inputs`' dict -> SGLang's verify arguments over the same cache memory.

    Needs every request to have the same tree size N (SGLang's qo_indptr is arange(0, (B+1)N, N)).
    """
    q, k_cache, v_cache = inp["q"], inp["k_cache"], inp["v_cache"]
    dev = q.device
    qo = inp["qo_indptr"].to("cpu", torch.int64)
    sizes = (qo[1:] - qo[:-1]).tolist()
    n = sizes[0]
    if any(s != n for s in sizes):
        raise ValueError(f"qo_indptr: SGLang's verify layout needs equal trees, got {sizes}")
    bsz = len(sizes)
    _, ps, hkv, dqk = k_cache.shape
    if ps != page_size:
        raise ValueError(f"page_size: {page_size} differs from the cache's {ps}")
    prefix = inp["prefix_lens"].to("cpu", torch.int64)
    table = inp["block_table"].to(torch.int64)  # (B, pages)
    k_buffer = k_cache.view(-1, hkv, dqk)  # (slots, Hkv, Dqk): the same memory
    mla = v_cache is None
    dv = inp["v_head_dim"] if mla else v_cache.shape[-1]
    v_buffer = k_buffer[..., :dv] if mla else v_cache.view(-1, hkv, dv)
    kv_indices, draft = [], []
    for b in range(bsz):
        t = torch.arange(int(prefix[b]) + n, device=dev)
        slots = table[b, t // ps] * ps + t % ps  # (P+N,) token-slot ids
        kv_indices.append(slots[: int(prefix[b])])
        draft.append(slots[int(prefix[b]) :])
    out_cache_loc = torch.cat(draft)  # (B*N,)
    dense = unpack_tree_mask(inp["tree_mask"], n).to(torch.uint8)  # (B*N, N)
    blocks = []
    for b in range(bsz):  # request b: [N, P_b + N] rows, prefix columns 1
        ones = torch.ones(n, int(prefix[b]), dtype=torch.uint8, device=dev)
        blocks.append(torch.cat([ones, dense[b * n : (b + 1) * n]], dim=1).reshape(-1))
    seq_mask = n * (prefix + n)
    zero = torch.zeros(1, dtype=torch.int64)
    return {
        "q_extend": q,
        "k_extend": k_buffer[out_cache_loc],
        "v_extend": v_buffer[out_cache_loc],
        "k_buffer": k_buffer,
        "v_buffer": v_buffer,
        "qo_indptr": torch.arange(0, (bsz + 1) * n, n, dtype=torch.int32, device=dev),
        "kv_indptr": torch.cat([zero, prefix.cumsum(0)]).to(dev, torch.int32),
        "kv_indices": torch.cat(kv_indices),
        "custom_mask": torch.cat(blocks),
        "mask_indptr": torch.cat([zero, seq_mask.cumsum(0)]).to(dev),
        "max_len_extend": n,
        "sm_scale": inp["sm_scale"],
        "out_cache_loc": out_cache_loc,
        "v_head_dim": dv,
    }


def load_sglang_extend_attention():
    """(SGLang's extend_attention_fwd, its module name); ImportError with one line of why."""
    reasons = []
    for name in EXTEND_ATTENTION_MODULES:
        try:
            return importlib.import_module(name).extend_attention_fwd, name
        except (ImportError, AttributeError) as exc:
            reasons.append(f"{name}: {type(exc).__name__}: {exc}")
    raise ImportError("SGLang's extend_attention_fwd not importable (" + "; ".join(reasons) + ")")


def call_extend_attention(fn, lay: dict, out: torch.Tensor, page_size: int) -> torch.Tensor:
    """Call an `extend_attention_fwd` (SGLang's or our drop-in) on `sglang_layout`'s dict.

    Keyword arguments the function does not take are left out (our drop-in has no page_size or
    descales); SGLang's descales, when required, are 1.0.
    """
    params = inspect.signature(fn).parameters
    kwargs = {"sm_scale": lay["sm_scale"]}
    if "page_size" in params:
        kwargs["page_size"] = page_size
    for name in ("k_scale", "v_scale"):
        if name in params and params[name].default is inspect.Parameter.empty:
            kwargs[name] = 1.0
    fn(
        lay["q_extend"], lay["k_extend"], lay["v_extend"], out, lay["k_buffer"], lay["v_buffer"],
        lay["qo_indptr"], lay["kv_indptr"], lay["kv_indices"], lay["custom_mask"], True,
        lay["mask_indptr"], lay["max_len_extend"], **kwargs,
    )  # fmt: skip
    return out
