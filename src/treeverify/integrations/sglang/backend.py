"""`TreeverifyAttnBackend`: SGLang's attention-backend interface, owning only target-verify.

Target-verify batches (EAGLE trees with topk > 1, DDTree) run treeverify's `TreeAttentionPlan`:
SGLang's verify metadata (req_to_token rows, prefix lengths, the flat custom mask) is converted
once per step into the plan's fixed-address buffers (verify_metadata.py), then every layer only
launches. Every other mode (prefill, decode, idle, draft extend) goes to a stock SGLang backend,
`fallback`, unchanged; attributes we do not define are read from it, since SGLang's model code
probes backends with getattr.

CUDA graphs (SGLang 0.5.23): `init_forward_metadata_out_graph` runs outside the graph before
capture and before every replay, so that is where a verify step's metadata is written (device
copies into fixed buffers, no host reads); `init_forward_metadata_in_graph` has nothing to record
for verify. One plan per captured batch size (created at capture, outside the graph), one per
eager batch bucket. The pre-0.5.23 hooks (`init_forward_metadata_capture_cuda_graph` /
`..._replay_cuda_graph`) are kept as thin adapters onto the same fill.

Limits (each raises a ValueError naming it): logit capping, sliding windows, attention sinks, fp8
KV caches. Two-batch overlap is not supported (layers share one output buffer per plan).
"""

from __future__ import annotations

import logging

import torch

from treeverify import env
from treeverify.integrations.sglang.geometry import VerifyGeometry
from treeverify.integrations.sglang.verify_metadata import (
    FULL_MASK,
    MASK_MODES,
    fill_verify_metadata,
)
from treeverify.kernels.split_arena import SplitArena

log = logging.getLogger(__name__)

KERNELS = ("cuda", "triton", "torch")


def draft_tokens_per_request(spec_info) -> int:
    """N, the verified tokens per request, from an EAGLE/DDTree verify input."""
    for name in ("num_tokens_per_req", "draft_token_num"):
        value = getattr(spec_info, name, None)
        if value is not None and int(value) > 0:  # SGLang's -1 means "not filled in yet"
            return int(value)
    raise ValueError(
        "spec_info: a target-verify batch needs num_tokens_per_req or draft_token_num, got "
        f"{type(spec_info).__name__}"
    )


def _is_verify(forward_mode) -> bool:
    return forward_mode is not None and bool(forward_mode.is_target_verify())


class TreeverifyAttnBackend:
    """SGLang attention backend: target-verify on treeverify's kernel, the rest on `fallback`."""

    def __init__(
        self,
        fallback,
        geometry: VerifyGeometry,
        *,
        kernel: str = "cuda",
        mask_mode: str = FULL_MASK,
        req_to_token: torch.Tensor | None = None,
    ):
        if kernel not in KERNELS:
            raise ValueError(f"kernel: expected one of {KERNELS}, got {kernel!r}")
        if mask_mode not in MASK_MODES:
            raise ValueError(f"mask_mode: expected one of {MASK_MODES}, got {mask_mode!r}")
        self.fallback = fallback
        self.geometry = geometry
        self.kernel = kernel
        self.mask_mode = mask_mode
        self.req_to_token = req_to_token  # (R, C) int32; a batch's own pool wins when it has one
        self._graph_plans: dict[int, object] = {}  # captured batch size -> plan
        self._eager_plans: dict[int, object] = {}  # batch bucket (power of 2) -> plan
        self._outs: dict[int, torch.Tensor] = {}  # id(plan) -> (max_total_q, Hq, Dv) output
        # Split partials shared by every plan (one verify step runs at a time): the largest
        # plan's bytes instead of their sum over captured batch sizes.
        self._split_arena = SplitArena(geometry.device) if kernel == "cuda" else None
        self._active = None  # the plan the last verify metadata went into

    # Attributes we do not define (needs_cpu_seq_lens, support_triton, ...) are the fallback's.
    def __getattr__(self, name: str):
        fallback = self.__dict__.get("fallback")
        if fallback is None:
            raise AttributeError(name)
        return getattr(fallback, name)

    # The worker writes a fresh FULL_MASK tensor when a backend exposes no VerifyMask buffer.
    verify_mask = None
    supports_ragged_verify_graph = False

    def get_verify_buffers_to_fill_after_draft(self):
        """No buffer of ours for the drafter to write (older releases' hook): the worker's mask
        tensor is read when the verify metadata is written."""
        return [None, None]

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs) -> None:
        """Nothing to do: the mask is converted when the verify metadata is written."""

    # -- plans ---------------------------------------------------------------------------------
    def _new_plan(self, max_batch: int, n: int):
        from treeverify.kernels.plan import TreeAttentionPlan

        g = self.geometry
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"treeverify backend: no plan for a verify batch of {max_batch} x {n} tokens "
                "inside CUDA graph capture; metadata must be initialised before capture"
            )
        plan = TreeAttentionPlan(
            num_qo_heads=g.num_qo_heads, num_kv_heads=g.num_kv_heads, head_dim_qk=g.head_dim_qk,
            head_dim_v=g.head_dim_v, mla=g.mla, page_size=g.page_size, max_batch=max_batch,
            max_tree=n, max_pages_per_request=g.max_pages, max_kv_len=g.max_context_len,
            sm_scale=g.head_dim_qk**-0.5, dtype=g.dtype, device=g.device, backend=self.kernel,
            split_balance=env.cuda_split_balance(), split_arena=self._split_arena,
        )  # fmt: skip
        self._outs[id(plan)] = torch.empty(
            plan.max_total_q, g.num_qo_heads, g.head_dim_v, dtype=g.dtype, device=g.device
        )
        arena = self._split_arena
        log.info(
            "treeverify: verify plan for %d requests x %d tokens, %.1f MB of device buffers, "
            "split partials shared by all plans: %.1f MB", max_batch, n,
            plan.workspace_bytes / 2**20, (arena.nbytes if arena else 0) / 2**20,
        )  # fmt: skip
        return plan

    def _plan_for(self, batch: int, n: int, *, capture: bool):
        """The plan a verify batch's metadata goes into.

        At capture: the captured batch size's own plan (made now, outside the graph). Otherwise
        (a replay, or an eager step: SGLang 0.5.23 also runs the out-of-graph hook eagerly) the
        smallest captured size that holds the batch, which is the graph a padded replay runs;
        a batch no graph holds gets an eager plan per power-of-two bucket.
        """
        if capture:
            if batch not in self._graph_plans or self._graph_plans[batch].max_tree < n:
                self._graph_plans[batch] = self._new_plan(batch, n)
            return self._graph_plans[batch]
        fits = [b for b, p in self._graph_plans.items() if b >= batch and p.max_tree >= n]
        if fits:
            return self._graph_plans[min(fits)]
        bucket = 1 << max(0, batch - 1).bit_length()
        plan = self._eager_plans.get(bucket)
        if plan is None or plan.max_tree < n:
            plan = self._eager_plans[bucket] = self._new_plan(bucket, n)
        return plan

    def _fill(
        self, req_pool_indices, seq_lens, spec_info, req_to_token, *, capture: bool,
        out_cache_loc=None,
    ):  # fmt: skip
        n = draft_tokens_per_request(spec_info)
        mask = getattr(spec_info, "custom_mask", None)
        if mask is None:
            raise ValueError("spec_info: a target-verify batch needs custom_mask (the tree)")
        table = req_to_token if req_to_token is not None else self.req_to_token
        if table is None:
            raise ValueError("req_to_token: neither the batch nor the backend has one")
        plan = self._plan_for(req_pool_indices.shape[0], n, capture=capture)
        fill_verify_metadata(
            plan, req_to_token=table, req_pool_indices=req_pool_indices, seq_lens=seq_lens,
            custom_mask=mask, n=n, page_size=self.geometry.page_size, mask_mode=self.mask_mode,
            out_cache_loc=out_cache_loc,
        )  # fmt: skip
        self._active = plan

    def _fill_from_batch(self, forward_batch, *, capture: bool = False) -> None:
        pool = getattr(forward_batch, "req_to_token_pool", None)
        self._fill(
            forward_batch.req_pool_indices, forward_batch.seq_lens, forward_batch.spec_info,
            getattr(pool, "req_to_token", None), capture=capture,
            out_cache_loc=getattr(forward_batch, "out_cache_loc", None),
        )  # fmt: skip

    # -- metadata hooks ------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch) -> None:
        if _is_verify(forward_batch.forward_mode):
            self._fill_from_batch(forward_batch)
        else:
            self.fallback.init_forward_metadata(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        if _is_verify(forward_batch.forward_mode):
            self._fill_from_batch(forward_batch, capture=in_capture)
        else:
            self.fallback.init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        if not _is_verify(forward_batch.forward_mode):  # verify: the buffers are already filled
            self.fallback.init_forward_metadata_in_graph(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, *args, **kwargs) -> None:
        # Our plans are made per captured batch size at capture (out_graph, in_capture=True).
        self.fallback.init_cuda_graph_state(max_bs, max_num_tokens, *args, **kwargs)

    def get_cuda_graph_seq_len_fill_value(self):
        return self.fallback.get_cuda_graph_seq_len_fill_value()

    # Pre-0.5.23 graph hooks (argument order of those releases), onto the same fill.
    def init_forward_metadata_capture_cuda_graph(
        self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens, forward_mode, spec_info
    ) -> None:
        if _is_verify(forward_mode):
            self._fill(req_pool_indices[:bs], seq_lens[:bs], spec_info, None, capture=True)
        else:
            self.fallback.init_forward_metadata_capture_cuda_graph(
                bs, num_tokens, req_pool_indices, seq_lens, encoder_lens, forward_mode, spec_info
            )

    def init_forward_metadata_replay_cuda_graph(
        self, bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens, forward_mode, spec_info,
        seq_lens_cpu=None, *args, **kwargs,
    ) -> None:  # fmt: skip
        if _is_verify(forward_mode):
            self._fill(req_pool_indices[:bs], seq_lens[:bs], spec_info, None, capture=False)
        else:
            self.fallback.init_forward_metadata_replay_cuda_graph(
                bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens, forward_mode,
                spec_info, seq_lens_cpu, *args, **kwargs,
            )  # fmt: skip

    # -- forward -------------------------------------------------------------------------------
    def forward(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        if _is_verify(forward_batch.forward_mode):
            return self._forward_verify(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        return self.fallback.forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        if _is_verify(forward_batch.forward_mode):
            return self._forward_verify(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        return self.fallback.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self.fallback.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def _forward_verify(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs):
        """One layer of a verify step: store the draft tokens' K/V, then run the planned kernel."""
        g = self.geometry
        plan = self._active
        if plan is None:
            raise RuntimeError(
                "treeverify backend: forward on a target-verify batch before its metadata "
                "(init_forward_metadata / init_forward_metadata_out_graph) was initialised"
            )
        q_rope, k_rope = kwargs.pop("q_rope", None), kwargs.pop("k_rope", None)
        unused = sorted(name for name, value in kwargs.items() if value is not None)
        if unused:
            raise ValueError(f"forward: argument(s) {unused} not supported by treeverify's verify")
        if getattr(layer, "logit_cap", 0):
            raise ValueError(
                f"layer.logit_cap: not supported in tree verify, got {layer.logit_cap}"
            )
        window = getattr(layer, "sliding_window_size", -1)
        if window is not None and window > 0:
            raise ValueError(f"layer.sliding_window_size: not supported in tree verify ({window})")
        if q_rope is not None:  # absorbed-MLA callers that pass the rope part apart
            q = torch.cat([q.reshape(*q_rope.shape[:-1], -1), q_rope], dim=-1)
            if k is not None and k_rope is not None:
                k = torch.cat([k.reshape(*k_rope.shape[:-1], -1), k_rope], dim=-1)
        q3 = q.reshape(-1, g.num_qo_heads, g.head_dim_qk)  # (B*N, Hq, Dqk)
        pool = forward_batch.token_to_kv_pool
        if save_kv_cache and k is not None:
            pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        ps = g.page_size
        k_buf = pool.get_key_buffer(layer.layer_id)  # (slots, Hkv, Dqk)
        if k_buf.shape[0] % ps:
            raise ValueError(
                f"token_to_kv_pool: {k_buf.shape[0]} slots are not whole pages of {ps}"
            )
        k_cache = k_buf.view(-1, ps, g.num_kv_heads, g.head_dim_qk)
        v_cache = None
        if not g.mla:
            v_cache = pool.get_value_buffer(layer.layer_id).view(
                -1, ps, g.num_kv_heads, g.head_dim_v
            )
        out = self._outs[id(plan)][: q3.shape[0]]  # (B*N, Hq, Dv)
        plan.sm_scale = float(layer.scaling)
        plan.run(q3, k_cache, v_cache, out)
        return out.reshape(q3.shape[0], g.num_qo_heads * g.head_dim_v)
