"""DeepSeek-V3 MoE: router (scoring, group-limited top-k), routed + shared experts.

Routing (DeepSeek-V3 / Kimi K2, topk_method="noaux_tc", scoring_func="sigmoid"):
  1. scores = sigmoid(x · Wgᵀ) in fp32; choice = scores + e_score_correction_bias.
  2. Experts split into n_group groups; a group's score = the sum of its top-2 `choice`;
     the topk_group best groups stay, the others' experts are excluded (-inf).
  3. top-k experts by `choice`; their weights come from the *unbiased* `scores`;
     normalised to sum 1 when norm_topk_prob (any k, as V3 does); then times routed_scaling_factor.
softmax scoring with "greedy" / "group_limited_greedy" (group score = max) is also provided.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from treeverify import env
from treeverify.kernels.api import triton_available
from treeverify.models import fused_moe, fused_routing, moe_gemv
from treeverify.models.config import DeepseekV3Config
from treeverify.models.layers import MLP


def select_experts(
    logits: torch.Tensor,  # (T, E) fp32 router logits
    cfg: DeepseekV3Config,
    bias: torch.Tensor | None = None,  # (E,) e_score_correction_bias (noaux_tc)
) -> tuple[torch.Tensor, torch.Tensor]:  # (T, k) int64 expert ids, (T, k) fp32 weights
    t, e = logits.shape
    k = cfg.num_experts_per_tok
    scores = logits.sigmoid() if cfg.scoring_func == "sigmoid" else logits.softmax(-1)  # (T, E)
    choice = scores
    if cfg.topk_method == "noaux_tc":
        if bias is None:
            raise ValueError("noaux_tc routing needs e_score_correction_bias")
        choice = scores + bias.float()[None, :]
    if cfg.topk_method != "greedy" and cfg.n_group > 1:
        grouped = choice.view(t, cfg.n_group, e // cfg.n_group)  # (T, G, E/G)
        if cfg.topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (T, G)
        else:
            group_scores = grouped.amax(-1)  # (T, G)
        keep_groups = group_scores.topk(cfg.topk_group, dim=-1).indices  # (T, topk_group)
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
        group_mask.scatter_(1, keep_groups, True)
        expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(t, e)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    idx = choice.topk(k, dim=-1).indices  # (T, k)
    weights = scores.gather(1, idx)  # (T, k) from the unbiased scores
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return idx, weights * cfg.routed_scaling_factor


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """torch._grouped_mm runs here: bf16 CUDA tensors on sm_90 or newer."""
    return (
        x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
        and torch.cuda.get_device_capability(x.device)[0] >= 9
    )  # fmt: skip


class Router(nn.Module):
    def __init__(self, cfg: DeepseekV3Config):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        nn.init.normal_(self.weight, std=0.02)
        if cfg.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(cfg.n_routed_experts), requires_grad=False
            )
        else:
            self.e_score_correction_bias = None
        # one Triton kernel instead of ~15 ops on a GPU (TREEVERIFY_FUSED_ROUTING=0: the ops)
        self.fused = env.fused_routing() and fused_routing.fusable(cfg) and triton_available()

    def forward(self, x: torch.Tensor):  # x (T, hidden)
        if self.fused and x.is_cuda:
            logits = fused_routing.logits(x, self.weight)  # (T, E) fp32
            return fused_routing.route(logits, self.cfg, self.e_score_correction_bias)
        logits = F.linear(x.float(), self.weight.float())  # (T, E)
        return select_experts(logits, self.cfg, self.e_score_correction_bias)


class DeepseekMoE(nn.Module):
    """Routed experts + shared experts. forward returns (out (T, hidden), counts (E,) int64).

    impl="grouped" (default) gathers each expert's tokens (host sync on the counts: eager only;
    inside a CUDA-graph capture it routes as "graph" instead);
    impl="dense" runs every expert on every token with zero weight where unrouted: no sync, no
    data-dependent shapes (CUDA-graph capturable), E times the FLOPs;
    impl="gather" gathers each token's k experts' weights (stacked, see `stack_experts`) and runs
    them as batched GEMVs: no sync, reads only the routed experts (decode-sized batches).
    impl="grouped_mm" sorts the T*k (token, expert) pairs by expert and runs two grouped GEMMs
    with device-side group offsets (torch._grouped_mm, bf16 on sm_90+): no sync, each routed
    expert's weights read once, no E-times FLOPs.
    impl="graph" picks grouped_mm where it runs, else gather when T*k < E, else dense (from the
    static token count): what a captured step uses. (gather copies the k experts' weights per
    token, so it costs ~3x the weight bytes: a fallback.) `valid` (T,) bool leaves padding rows out
    of the counts.
    """

    def __init__(self, cfg: DeepseekV3Config):
        super().__init__()
        self.n_experts = cfg.n_routed_experts
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(
            MLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.n_routed_experts)
        )
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
            if cfg.n_shared_experts > 0
            else None
        )
        self.impl = "grouped"
        self.w_gate_up: torch.Tensor | None = None  # (E, 2I, hidden) once stacked
        self.w_down: torch.Tensor | None = None  # (E, hidden, I) once stacked
        # the stacks with the shared experts' S chunks after the E routed ones (S = 0: the same
        # tensors); S > 0 only under TREEVERIFY_MOE_GEMV_SHARED (the GEMV path runs them)
        self.w_gate_up_all: torch.Tensor | None = None  # (E + S, 2I, hidden)
        self.w_down_all: torch.Tensor | None = None  # (E + S, hidden, I)
        self.stacked_shared = 0  # S
        # grouped_mm's dispatch and combine as two Triton kernels (TREEVERIFY_FUSED_MOE_DISPATCH):
        # "auto" (small batches only, fused_moe.takes), "1", or "0" (also without Triton)
        self.fused_dispatch = env.fused_moe_dispatch() if triton_available() else "0"
        # decode-sized batches' routed experts as two GEMVs (moe_gemv.py, TREEVERIFY_MOE_GEMV)
        self.gemv = env.moe_gemv() if triton_available() else "0"
        # ... and the shared experts as more pairs in those GEMVs (TREEVERIFY_MOE_GEMV_SHARED)
        self.gemv_shared = self.gemv != "0" and env.moe_gemv_shared()

    @torch.no_grad()
    def stack_experts(self) -> None:
        """Move the experts' weights into two stacked tensors; the experts' Linear weights become
        views into them (no second copy), so every impl keeps working. With `gemv_shared` the
        shared experts follow as S = n_shared_experts chunks of the routed experts' size (their
        gate / up rows and down columns j*I .. (j+1)*I): S = 1 (DeepSeek-V3, Kimi K2) moves the
        shared MLP's weights into the stack as views too; S > 1 stacks copies of its chunks."""
        if self.w_gate_up is not None:
            return
        gate_up = [torch.cat((e.gate_proj.weight, e.up_proj.weight)) for e in self.experts]
        down = [e.down_proj.weight for e in self.experts]
        inter = gate_up[0].shape[0] // 2
        sh = self.shared_experts if self.gemv_shared else None
        if sh is not None and (
            sh.gate_proj.weight.shape[0] % inter or sh.gate_proj.bias is not None
        ):
            sh = None  # not whole chunks of the routed size, or biased: its own MLP runs it
        chunks = sh.gate_proj.weight.shape[0] // inter if sh is not None else 0
        for j in range(chunks):
            rows = slice(j * inter, (j + 1) * inter)
            gate_up.append(torch.cat((sh.gate_proj.weight[rows], sh.up_proj.weight[rows])))
            down.append(sh.down_proj.weight[:, rows])
        gate_up_all = torch.stack(gate_up)  # (E + S, 2I, hidden)
        down_all = torch.stack(down)  # (E + S, hidden, I)
        for i, e in enumerate(self.experts):
            e.gate_proj.weight = nn.Parameter(gate_up_all[i, :inter], requires_grad=False)
            e.up_proj.weight = nn.Parameter(gate_up_all[i, inter:], requires_grad=False)
            e.down_proj.weight = nn.Parameter(down_all[i], requires_grad=False)
        if chunks == 1:  # the shared MLP reads its weights from the stack: no second copy
            mine = gate_up_all[self.n_experts]  # (2I, hidden)
            sh.gate_proj.weight = nn.Parameter(mine[:inter], requires_grad=False)
            sh.up_proj.weight = nn.Parameter(mine[inter:], requires_grad=False)
            sh.down_proj.weight = nn.Parameter(down_all[self.n_experts], requires_grad=False)
            if sh.gate_up is not None:  # fused by fuse(): the same (2I, hidden) layout
                sh.gate_up = (mine, sh.gate_up[1])
        self.w_gate_up, self.w_down = gate_up_all[: self.n_experts], down_all[: self.n_experts]
        self.w_gate_up_all, self.w_down_all, self.stacked_shared = gate_up_all, down_all, chunks

    def _gathered(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        self.stack_experts()
        gate_up = self.w_gate_up[idx]  # (T, k, 2I, hidden)
        h = torch.einsum("th,tkih->tki", x, gate_up)  # (T, k, 2I)
        g, u = h.chunk(2, dim=-1)  # (T, k, I) each
        y = torch.einsum("tki,tkhi->tkh", F.silu(g) * u, self.w_down[idx])  # (T, k, hidden)
        return (y.float() * w[..., None]).sum(1)  # (T, hidden)

    def _grouped_mm(self, x, idx, w, counts) -> torch.Tensor:
        from treeverify.models.fused_ops import silu_mul

        self.stack_experts()
        t, k = idx.shape
        order = idx.reshape(-1).argsort(stable=True)  # (T*k,) pairs sorted by expert
        offs = counts.cumsum(0).to(torch.int32)  # (E,) end row of each expert's group
        xs = x[order // k]  # (T*k, hidden)
        h = torch._grouped_mm(xs, self.w_gate_up.transpose(1, 2), offs=offs)  # (T*k, 2I)
        y = torch._grouped_mm(silu_mul(h), self.w_down.transpose(1, 2), offs=offs)  # (T*k, H)
        back = torch.empty_like(y)
        back[order] = y  # unsort (a permutation: deterministic, no atomics)
        return (back.view(t, k, -1).float() * w[..., None]).sum(1)  # (T, hidden)

    def _grouped_mm_fused(self, x, idx, w, valid, shared) -> tuple[torch.Tensor, torch.Tensor]:
        """`_grouped_mm` with its dispatch and combine as two Triton kernels (models/fused_moe.py):
        (out (T, hidden) in x's dtype, + `shared` when given, valid counts (E,))."""
        from treeverify.models.fused_ops import silu_mul

        self.stack_experts()
        xs, pos, _, valid_counts, offs = fused_moe.dispatch(x, idx, valid, self.n_experts)
        h = torch._grouped_mm(xs, self.w_gate_up.transpose(1, 2), offs=offs)  # (T*k, 2I)
        y = torch._grouped_mm(silu_mul(h), self.w_down.transpose(1, 2), offs=offs)  # (T*k, H)
        return fused_moe.combine(y, pos, w, x.dtype, add=shared), valid_counts

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None = None,
                counter: torch.Tensor | None = None):  # fmt: skip
        """(out (T, hidden) in x's dtype, the valid rows' expert counts (E,)); with `counter`
        ((E,) int64, the model's running counts) the counts are added to it in place on every
        path and None is returned (the expert-GEMV path adds them inside its kernel)."""
        t = x.shape[0]
        idx, w = self.gate(x)  # (T, k), (T, k)
        impl = self.impl
        if impl == "grouped" and x.is_cuda and torch.cuda.is_current_stream_capturing():
            # The host-grouped path reads the counts to the host, which no capture allows: a
            # captured forward routes sync-free whoever captures it (the engine, a benchmark).
            impl = "graph"
        if impl == "graph":
            if grouped_mm_supported(x):
                impl = "grouped_mm"
            else:
                impl = "gather" if t * idx.shape[1] < self.n_experts else "dense"
        gemv = impl in ("grouped_mm", "gather") and self._gemv_takes(x, idx)
        fused = not gemv and impl == "grouped_mm" and fused_moe.takes(self.fused_dispatch, x, idx)
        if gemv and self.stacked_shared:  # the shared experts as S more pairs a token
            return moe_gemv.routed(x, idx, w, self.w_gate_up_all, self.w_down_all, valid,
                                   counter, stacked_shared=self.stacked_shared)  # fmt: skip
        # the shared experts first where the combine kernel adds them (no separate add)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        if gemv:
            return moe_gemv.routed(x, idx, w, self.w_gate_up, self.w_down, valid, counter,
                                   shared)  # fmt: skip
        if fused:
            out, valid_counts = self._grouped_mm_fused(x, idx, w, valid, shared)
        else:
            out, valid_counts = self._routed(x, idx, w, valid, impl)
            out = out.to(x.dtype)
            if shared is not None:
                out = out + shared
        if counter is None:
            return out, valid_counts
        counter += valid_counts
        return out, None

    def describe(self) -> str:
        """One line for the startup log: which paths a captured GPU step's routed experts take,
        by batch size (TREEVERIFY_MOE_GEMV, TREEVERIFY_FUSED_MOE_DISPATCH)."""
        bounds = {"auto": "auto", "1": "forced"}
        parts = []
        if self.gemv != "0":
            most = moe_gemv.AUTO_MAX_PAIRS if self.gemv == "auto" else moe_gemv.MAX_PAIRS
            tiles = " / ".join(f"{bn}x{bk} {warps} warps" for bn, bk, warps in
                               (moe_gemv.tile(False), moe_gemv.tile(True)))  # fmt: skip
            shared = ("; the shared experts as more pairs of them (TREEVERIFY_MOE_GEMV_SHARED)"
                      if self.gemv_shared and self.shared_experts is not None else "")  # fmt: skip
            parts.append(f"expert GEMVs up to {most} pairs ({bounds[self.gemv]}; tiles gate_up / "
                         f"down {tiles}{shared})")  # fmt: skip
        if self.fused_dispatch != "0":
            most = (
                fused_moe.AUTO_MAX_PAIRS if self.fused_dispatch == "auto" else fused_moe.MAX_PAIRS
            )
            parts.append(f"grouped GEMMs with the Triton dispatch up to {most} pairs "
                         f"({bounds[self.fused_dispatch]})")  # fmt: skip
        above = " above" if parts else ""
        parts.append(f"grouped GEMMs with the PyTorch dispatch{above} (sm_90+; else gather/dense)")
        return "MoE experts: " + ", ".join(parts)

    def _gemv_takes(self, x: torch.Tensor, idx: torch.Tensor) -> bool:
        """Whether this batch's routed experts run as GEMVs (models/moe_gemv.py) on a GPU."""
        if self.gemv == "0" or not x.is_cuda:
            return False
        self.stack_experts()
        return moe_gemv.takes(self.gemv, x, idx, self.w_gate_up)

    def _routed(self, x, idx, w, valid, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed experts' output (T, hidden) and the valid rows' expert counts (E,) by the
        PyTorch paths (`impl` resolved: gather, grouped_mm, dense or grouped)."""
        t = x.shape[0]
        flat = idx.reshape(-1)  # (T*k,)
        counts = torch.zeros(self.n_experts, dtype=torch.int64, device=x.device)
        counts.index_add_(0, flat, torch.ones_like(flat))  # on device, no sync
        valid_counts = counts  # what the counters report: padding rows left out
        if valid is not None:
            valid_counts = torch.zeros_like(counts).index_add_(
                0, flat, valid.to(torch.int64).repeat_interleave(idx.shape[1])
            )  # (E,)
        if impl == "gather":
            out = self._gathered(x, idx, w)
        elif impl == "grouped_mm":
            out = self._grouped_mm(x, idx, w, counts)
        elif impl == "dense":
            out = torch.zeros_like(x, dtype=torch.float32)  # (T, hidden)
            combine = torch.zeros(t, self.n_experts, device=x.device, dtype=torch.float32)
            combine.scatter_add_(1, idx, w)  # (T, E)
            for e, expert in enumerate(self.experts):
                out += combine[:, e : e + 1] * expert(x).float()
        else:
            # Each (token, expert) pair's output goes back to its own slot and a token's k slots
            # are summed in a fixed order: index_add_'s float atomics made eager greedy decoding
            # non-reproducible (a bf16 near-tie flipped between identical runs on the H200).
            k = idx.shape[1]
            order = flat.argsort(stable=True)  # (T*k,) pairs sorted by expert
            token_of = order // k  # (T*k,) token row of each sorted slot
            back = torch.zeros(t * k, x.shape[1], device=x.device, dtype=torch.float32)
            start = 0
            for e, n in enumerate(counts.tolist()):
                if n:
                    pairs = order[start : start + n]
                    back[pairs] = self.experts[e](x[token_of[start : start + n]]).float()
                start += n
            out = (back.view(t, k, -1) * w[..., None]).sum(1)  # (T, hidden)
        return out, valid_counts
