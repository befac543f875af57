"""The shapes a treeverify verify plan needs, read from an SGLang ModelRunner (or given)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VerifyGeometry:
    """One model's attention shapes on this rank and its KV pool's layout."""

    num_qo_heads: int  # query heads on this rank (after TP / DP-attention split)
    num_kv_heads: int  # 1 for MLA
    head_dim_qk: int  # 576 for DeepSeek/Kimi MLA (latent 512 + rope 64)
    head_dim_v: int  # 512 for MLA (V = the first 512 of the K row)
    mla: bool
    page_size: int
    max_context_len: int  # columns of req_to_token
    dtype: torch.dtype
    device: torch.device
    draft_tokens: int | None = None  # N per request, when the server args say it

    def __post_init__(self) -> None:
        for name in ("num_qo_heads", "num_kv_heads", "head_dim_qk", "head_dim_v", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(
                f"num_qo_heads: {self.num_qo_heads} is not a multiple of num_kv_heads "
                f"{self.num_kv_heads}"
            )
        if self.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(
                f"dtype: treeverify's verify kernels read bf16/fp16 KV caches, got {self.dtype} "
                "(an fp8 KV cache is not supported; use --kv-cache-dtype auto)"
            )

    @property
    def max_pages(self) -> int:
        return -(-self.max_context_len // self.page_size)


def geometry_from_runner(runner) -> VerifyGeometry:
    """Read the shapes from an SGLang ModelRunner (attribute names of SGLang 0.5.23).

    The KV pool is the ground truth for head counts and dims on this rank; the query heads come
    from the model config divided by the attention TP size.
    """
    # SGLang 0.5.23 keeps the attention TP width in its process context (published at startup);
    # dp_attention.get_attention_tp_size of older releases is gone.
    from sglang.srt.runtime_context import get_parallel

    pool = runner.token_to_kv_pool
    first = getattr(pool, "start_layer", 0) or 0
    k_buf = pool.get_key_buffer(first)  # (slots, Hkv, Dqk)
    v_buf = pool.get_value_buffer(first)  # (slots, Hkv, Dv)
    # Our kernels' MLA mode means "V is the first Dv columns of the K row": exactly when the pool's
    # value buffer is a view of its key buffer (SGLang's MLATokenToKVPool).
    shared = v_buf.untyped_storage().data_ptr() == k_buf.untyped_storage().data_ptr()
    mla = shared or bool(getattr(runner, "use_mla_backend", False))
    hq = runner.model_config.num_attention_heads // get_parallel().attn_tp_size
    args = getattr(runner, "server_args", None)
    n = getattr(args, "speculative_num_draft_tokens", None)
    return VerifyGeometry(
        num_qo_heads=hq,
        num_kv_heads=int(k_buf.shape[1]),
        head_dim_qk=int(k_buf.shape[2]),
        head_dim_v=int(v_buf.shape[-1]),
        mla=mla,
        page_size=int(runner.page_size),
        max_context_len=int(runner.req_to_token_pool.req_to_token.shape[1]),
        dtype=k_buf.dtype,
        device=torch.device(runner.device),
        draft_tokens=int(n) if n else None,
    )
