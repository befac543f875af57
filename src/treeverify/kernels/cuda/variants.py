"""Which compiled instance of tree_attention.cu serves which problem, on which GPU arch.

A variant is one template instantiation; its name encodes every template argument, so the name
is also the JIT cache key's readable half. Selection is pure Python (no GPU needed), so
`treeverify kernels build` and the tests can enumerate exactly what a GPU would run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Largest dynamic shared memory one block may opt into, per arch (bytes).
SMEM_LIMIT = {
    "sm_80": 166912,  # A100: 163 KB
    "sm_86": 101376,  # 99 KB: RTX 30, A-series
    "sm_89": 101376,  # Ada
    "sm_90a": 232448,  # H100/H200: 227 KB
    "sm_100a": 232448,  # B200
    "sm_120": 101376,  # RTX PRO 6000 Blackwell / RTX 50
}
ALL_ARCHES = tuple(SMEM_LIMIT)
GQA_HEAD_DIMS = (64, 128, 256)
# The few-row kernel's instances (n8 tiles of x rows) that models/gemv.py `skinny_tiles` picks:
# 9..16 rows take three tiles, two measured slower (H100, 21feabf), so two are not built.
SKINNY_TILE_COUNTS = (1, 3, 4)
MLA_DIMS = (576, 512)
DTYPES = ("bf16", "fp16")


@dataclass(frozen=True)
class FwdVariant:
    """tree_attn_fwd<DQK, DV, BM, BN, WN, STAGES, BF16, MLA>."""

    dqk: int
    dv: int
    bm: int  # packed (node, head) rows per CTA
    bn: int  # KV tokens per tile
    wn: int  # warps sharing the same 16 rows (split the S columns and the V columns)
    stages: int  # cp.async pipeline depth
    dtype: str  # "bf16" | "fp16"
    mla: bool

    @property
    def name(self) -> str:
        fam = "mla" if self.mla else "gqa"
        return (
            f"fwd_{fam}_d{self.dqk}v{self.dv}_m{self.bm}n{self.bn}w{self.wn}s{self.stages}"
            f"_{self.dtype}"
        )

    @property
    def expr(self) -> str:
        bf16 = "true" if self.dtype == "bf16" else "false"
        mla = "true" if self.mla else "false"
        return (
            f"treeverify::tree_attn_fwd<{self.dqk},{self.dv},{self.bm},{self.bn},{self.wn},"
            f"{self.stages},{bf16},{mla}>"
        )

    @property
    def threads(self) -> int:
        return (self.bm // 16) * self.wn * 32

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory; must equal Cfg::SMEM_BYTES in tree_attention.cu."""
        sq = self.dqk + 8
        sv = sq if self.mla else self.dv + 8
        q = self.bm * sq
        k = self.bn * sq
        v = 0 if self.mla else self.bn * sv
        p = self.bm * (self.bn + 8) if self.wn > 1 else 0
        ptrs = 8 * 2 * self.bn * (1 if self.mla else 2)
        return 2 * (q + self.stages * (k + v) + p) + 4 * 2 * self.wn * self.bm + ptrs

    defines: tuple[str, ...] = ()


MLA_SCHEDULES = ("pair", "split")


@dataclass(frozen=True)
class MlaSm90Variant:
    """The wgmma (sm_90a) MLA kernels, 64 rows, 2 warpgroups, two 64-key KV buffers.

    schedule "pair" (v10, tree_attn_mla_pair_sm90): each warpgroup takes whole tiles, even and
    odd, handing over through named barriers; "split" (v2-v9, tree_attn_mla_sm90): both
    warpgroups take half of every tile in lockstep. TREEVERIFY_CUDA_MLA_SCHEDULE picks one.
    """

    bn: int
    dtype: str
    schedule: str = "pair"
    bm: int = 64
    threads: int = 256
    mla: bool = True
    defines: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.schedule not in MLA_SCHEDULES:
            raise ValueError(f"schedule: expected one of {MLA_SCHEDULES}, got {self.schedule!r}")

    @property
    def name(self) -> str:
        kind = "pair" if self.schedule == "pair" else "wgmma"
        return f"fwd_mla_sm90_{kind}_m{self.bm}n{self.bn}_{self.dtype}"

    @property
    def expr(self) -> str:
        bf16 = "true" if self.dtype == "bf16" else "false"
        fn = "tree_attn_mla_pair_sm90" if self.schedule == "pair" else "tree_attn_mla_sm90"
        return f"treeverify::{fn}<{self.bn},{bf16}>"

    @property
    def smem_bytes(self) -> int:
        """Must equal MlaPairCfg / MlaSm90Cfg::SMEM_BYTES (tree_attention_*sm90.cuh)."""
        q, kv = self.bm * 576 * 2, self.bn * 576 * 2
        if self.schedule == "pair":  # P lives in the buffers' rope blocks; maxima x 2 + sums
            return 1024 + q + 2 * kv + 24 * self.bm + 16 * self.bn
        pt = self.bm * self.bn * 2
        return 1024 + q + 2 * kv + pt + 8 * self.bm + 16 * self.bn


GQA_SCHEDULES = (  # the default (TREEVERIFY_CUDA_GQA_SCHEDULE unset) first
    "pingpong-auto",
    "tile",
    "pingpong",
    "pingpong-direct",
    "pingpong-shfl",
    "pingpong-tma",
    "pingpong-tma2",
    "pingpong-persist",
)
# kProducerAuto's crossover (gqa_pp_common.cuh, kAutoDirectMaxKeys): the direct producer on
# batches of at most this many keys.
AUTO_DIRECT_MAX_KEYS = 32768
# The default schedule's 256-row CTAs (v21; fwd_variant's `gqa_wide`, TREEVERIFY_CUDA_GQA_256):
# not a schedule of its own in the environment, a shape the default takes where it pays.
GQA_WIDE = "pingpong-256"
# The ping-pong kernel's PRODUCER template argument per schedule (tree_attention_gqa_pp_sm90.cuh;
# pingpong-tma, 3, has its own entry point, which takes the K and V tensor maps too).
PP_PRODUCERS = {
    "pingpong": 0,
    "pingpong-direct": 1,
    "pingpong-shfl": 2,
    "pingpong-auto": 4,
    "pingpong-persist": 4,  # the auto choice, per launch
    GQA_WIDE: 1,  # the direct producer: the shared one spills in the 40 registers left to it
}


def gqa_wide_pays(
    mode: str, rows: int, ctas: int, num_sms: int, page_size: int = 16, batch_keys: int = 0
) -> bool:
    """Whether the default GQA schedule takes 256-row CTAs (v21): `rows` = tree nodes x group
    (the packed rows of one KV head), `ctas` = batch x KV heads x 256-row tiles (the grid before
    any split), `batch_keys` = batch x the plan's KV capacity. Mode (TREEVERIFY_CUDA_GQA_256)
    "1": wherever rows reach 256; "0": never; "auto": where those CTAs alone fill the GPU, except
    at page size 1 on batches of more than kAutoDirectMaxKeys keys (the 256-row CTA's direct
    producer copies scattered 16-byte pieces of single-row pages there; the 128-row kernel
    switches to its shared producer). Measured (H200, 86685da and 6ed4d37): page 16 B32 N=64
    1.10-1.21x (256 CTAs), 0.69-0.85x where a small batch needs splits to fill 132 SMs (B1/B8
    at L1024-8192), 1.04-1.07x on B1/B8 at L >= 8192 (left out with the losses); page 1 B32
    L1024 1.27x, L32768 0.91x."""
    if rows < 256 or mode == "0":
        return False
    if mode == "1":
        return True
    return ctas >= num_sms and (page_size > 1 or batch_keys <= AUTO_DIRECT_MAX_KEYS)


@dataclass(frozen=True)
class GqaSm90Variant:
    """tree_attn_gqa_sm90<D, BN, NWG, STAGES, BF16>: wgmma (sm_90a) GQA, 64 rows per warpgroup
    (schedule "tile"); or, schedule "pingpong" (NWG = 2 only), tree_attn_gqa_pp_sm90<D, BN,
    STAGES, BF16>: a producer warpgroup and two consumer warpgroups taking turns on the MMAs;
    "pingpong-direct": the same with each producer thread looking its own KV row up (v15);
    "pingpong-shfl": each producer warp looking its rows up, pointers handed over by shuffles
    (v16); "pingpong-auto": the direct producer on batches of <= 32k keys, the shared one
    above (v20); "pingpong-tma": whole tiles of paged keys by TMA (v17; `tma`: the launch passes the
    K and V pools' tensor maps after the parameters, kernels/cuda/tma.py); "pingpong-tma2": the
    same launched as 2-CTA clusters whose pair shares each TMA tile by multicast (v19; `cluster`
    2: grid x rounded up to even); GQA_WIDE ("pingpong-256", not an environment choice: the
    default's shape where gqa_wide_pays): 256-row CTAs (each consumer warpgroup two 64-row
    halves, the direct producer; v21, H = 2); "pingpong-persist": tree_attn_gqa_pp_persist_sm90,
    the ping-pong kernel as one CTA an SM walking an equal share of the batch's key tiles (v23,
    gqa_pp_persist.cuh; the launcher sizes its grid and slots). `q_regs` (ping-pong schedules
    but the persistent one, v18): QK as register-A wgmma, Q's fragments loaded once."""

    d: int
    nwg: int
    dtype: str
    bn: int = 64
    stages: int = 4
    mla: bool = False
    defines: tuple[str, ...] = ()
    schedule: str = "tile"
    q_regs: bool = False

    def __post_init__(self):
        if self.schedule not in (*GQA_SCHEDULES, GQA_WIDE):
            raise ValueError(f"schedule: expected one of {GQA_SCHEDULES}, got {self.schedule!r}")
        if self.pingpong and self.nwg != 2:
            raise ValueError("schedule: pingpong runs 128-row CTAs (nwg=2) only")
        if self.q_regs and not self.pingpong:
            raise ValueError("q_regs: only the ping-pong schedules keep Q in registers")
        if self.q_regs and self.persist:
            raise ValueError("q_regs: the persistent kernel reads Q from shared memory")
        if self.q_regs and self.schedule == GQA_WIDE:
            raise ValueError("q_regs: the 256-row CTA reads Q from shared memory")

    @property
    def pingpong(self) -> bool:
        return self.schedule.startswith("pingpong")

    @property
    def tma(self) -> bool:
        return self.schedule in ("pingpong-tma", "pingpong-tma2")

    @property
    def persist(self) -> bool:
        """One CTA an SM walking an equal share of the batch's key tiles (v23)."""
        return self.schedule == "pingpong-persist"

    @property
    def cluster(self) -> int:
        """CTAs a cluster along grid x (1: no cluster launch)."""
        return 2 if self.schedule == "pingpong-tma2" else 1

    @property
    def bm(self) -> int:
        return 256 if self.schedule == GQA_WIDE else 64 * self.nwg

    @property
    def threads(self) -> int:
        return 128 * self.nwg + (128 if self.pingpong else 0)

    @property
    def name(self) -> str:
        pp = {
            "tile": "",
            "pingpong": "_pp",
            "pingpong-direct": "_ppd",
            "pingpong-shfl": "_pps",
            "pingpong-tma": "_ppt",
            "pingpong-tma2": "_ppt2",
            "pingpong-auto": "_ppa",
            "pingpong-persist": "_ppp",
            GQA_WIDE: "_pp2",
        }[self.schedule] + ("q" if self.q_regs else "")
        # Diagnostic builds (scripts/cta_trace.py): their defines in the name, so a compile
        # cache keyed by name never hands one out for another or for the shipped kernel.
        trace = "_trace" if "TV_CTA_TRACE" in self.defines else ""
        trace += "".join(
            "_" + re.sub(r"[^0-9a-z]+", "", d.lower()) for d in self.defines if d != "TV_CTA_TRACE"
        )
        return (
            f"fwd_gqa_sm90_wgmma{pp}_d{self.d}_m{self.bm}n{self.bn}s{self.stages}_{self.dtype}"
            + trace
        )

    @property
    def expr(self) -> str:
        bf16 = "true" if self.dtype == "bf16" else "false"
        q = ",true" if self.q_regs else ""
        if self.tma:
            mc = ("" if self.q_regs else ",false") + ",true" if self.cluster == 2 else ""
            return (
                f"treeverify::tree_attn_gqa_pp_tma_sm90<{self.d},{self.bn},{self.stages},{bf16}"
                f"{q}{mc}>"
            )
        if self.persist:
            return (
                f"treeverify::tree_attn_gqa_pp_persist_sm90<{self.d},{self.bn},{self.stages},"
                f"{bf16},{PP_PRODUCERS[self.schedule]}>"
            )
        if self.pingpong:
            prod = PP_PRODUCERS[self.schedule]
            h = ",false,2" if self.schedule == GQA_WIDE else ""
            return (
                f"treeverify::tree_attn_gqa_pp_sm90<{self.d},{self.bn},{self.stages},{bf16},"
                f"{prod}{q}{h}>"
            )
        return f"treeverify::tree_attn_gqa_sm90<{self.d},{self.bn},{self.nwg},{self.stages},{bf16}>"

    @property
    def smem_bytes(self) -> int:
        """Must equal GqaSm90Cfg::SMEM_BYTES (GqaPpCfg's for pingpong: + the mbarriers)."""
        tile = self.bn * self.d * 2
        base = 1024 + self.bm * self.d * 2 + 2 * self.stages * tile + 16 * self.stages * self.bn
        q2 = self.bm * self.d * 2 if self.persist else 0  # the persistent kernel's second Q
        return base + q2 + (24 * self.stages if self.pingpong else 0)


@dataclass(frozen=True)
class MergeVariant:
    """tree_attn_merge<DV, BF16, HI, U>, a CTA per token and heads: combine split partials (fp32
    O + log2 LSE), each thread with HI heads x U splits of loads in flight (merge_variant)."""

    dv: int
    dtype: str
    hi: int = 1
    u: int = 8
    w: int = 1  # head lanes a CTA (v28, TREEVERIFY_CUDA_MERGE_WIDE)
    s: int = 1  # split lanes a head (v30, TREEVERIFY_CUDA_MERGE_SPLIT_LANES)

    @property
    def name(self) -> str:
        ilp = "" if (self.hi, self.u) == (1, 8) else f"_h{self.hi}u{self.u}"
        wide = "" if self.w == 1 else f"_w{self.w}"
        lanes = "" if self.s == 1 else f"_s{self.s}"
        return f"merge_v{self.dv}{ilp}{wide}{lanes}_{self.dtype}"

    @property
    def expr(self) -> str:
        bf16 = "true" if self.dtype == "bf16" else "false"
        if self.s > 1:  # its own kernel (merge_and_mask.cuh): its own launch bounds
            return f"treeverify::tree_attn_merge_split_lanes<{self.dv},{bf16},{self.s}>"
        args = "" if (self.hi, self.u, self.w) == (1, 8, 1) else f",{self.hi},{self.u}"
        args += "" if self.w == 1 else f",{self.w}"
        return f"treeverify::tree_attn_merge<{self.dv},{bf16}{args}>"

    @property
    def threads(self) -> int:
        return self.dv // 4 * self.w * self.s

    smem_bytes: int = 0
    defines: tuple[str, ...] = ()


# The merge kernel's loads in flight (v22, TREEVERIFY_CUDA_MERGE_ILP=1): four heads of four
# splits where a CTA merges several heads, 16 splits of one head where plans split more than 8
# ways; (1, 8), one head of 8 splits, otherwise and by default.
MERGE_ILP_SHAPES = ((4, 4), (1, 16))
MERGE_WIDE_THREADS = 256  # a wide merge CTA's threads: head lanes of dv / 4 threads each


def merge_head_lanes(dv: int) -> int:
    """Head lanes of the wide merge kernel (TREEVERIFY_CUDA_MERGE_WIDE) for value width dv."""
    return MERGE_WIDE_THREADS // (dv // 4)


MERGE_SPLIT_LANES = 4  # the split-lane merge's groups (v30): 2 round trips for 64 splits
# Where it is built (and the runner picks it): its 512 threads a CTA for MLA leave 128 registers a
# thread, which sm_100a / sm_120 code spilled (16 bytes); measured on sm_90a only.
MERGE_SPLIT_LANES_ARCHES = ("sm_80", "sm_86", "sm_89", "sm_90a")


def merge_variant(
    dv: int,
    dtype: str,
    ilp: bool,
    merge_heads: int,
    max_splits: int,
    wide: bool = False,
    split_lanes: bool = False,
) -> MergeVariant:
    """The merge kernel for a plan: `merge_heads` heads a CTA, at most `max_splits` splits a row.
    ILP off by default: 0.994x on the grid (H200, 670a014; the small MLA cases 0.92-1.06x) and no
    gain on SGLang's balanced GQA batch (101.1 -> 104.2 us): the merge was not the gap. Wide
    (v28): where a CTA merges at least merge_head_lanes(dv) heads, that many warps (groups) take
    them in turns, one head each at a time (one head x 8 splits of loads a thread). Split lanes
    (v30): where a row can have more than 8 splits, MERGE_SPLIT_LANES groups take a head's
    splits in turns and merge their shares through shared memory."""
    if split_lanes and max_splits > 8:
        return MergeVariant(dv, dtype, s=MERGE_SPLIT_LANES)
    if wide and merge_heads >= merge_head_lanes(dv):
        return MergeVariant(dv, dtype, w=merge_head_lanes(dv))
    if not ilp:
        return MergeVariant(dv, dtype)
    if merge_heads >= 4:
        return MergeVariant(dv, dtype, 4, 4)
    if max_splits > 8:
        return MergeVariant(dv, dtype, 1, 16)
    return MergeVariant(dv, dtype)


@dataclass(frozen=True)
class MaskVariant:
    """sglang_mask_to_bits: SGLang's byte mask -> our packed tree mask."""

    name: str = "sglang_mask_to_bits"
    expr: str = "treeverify::sglang_mask_to_bits"
    threads: int = 64
    smem_bytes: int = 0
    defines: tuple[str, ...] = ("TV_SGLANG_MASK_KERNEL",)


@dataclass(frozen=True)
class _OneKernel:
    """A kernel with one instance (no template parameters): static shared memory only, no
    defines, no fast math (these kernels' roundings or integer work are contracts)."""

    smem_bytes: int = 0
    defines: tuple[str, ...] = ()
    fast_math: bool = False


@dataclass(frozen=True)
class DDTreeHeapVariant(_OneKernel):
    """ddtree_heap_build (ddtree_heap.cu, not tree_attention.cu): DDTree's best-first heap, one
    CTA per request. Exact fp32 rounding, so no fast math (no FMA, no flush-to-zero)."""

    name: str = "ddtree_heap"
    expr: str = "treeverify::ddtree_heap_build"
    threads: int = 32
    source_file: str = "ddtree_heap.cu"


@dataclass(frozen=True)
class DDTreeWalkVariant(_OneKernel):
    """ddtree_greedy_walk (ddtree_walk.cu): the greedy acceptance walk, one CTA per request."""

    name: str = "ddtree_walk"
    expr: str = "treeverify::ddtree_greedy_walk"
    threads: int = 128
    source_file: str = "ddtree_walk.cu"


@dataclass(frozen=True)
class DDTreeWalkPackVariant(_OneKernel):
    """ddtree_walk_pack (ddtree_walk.cu): the greedy walk, the round's packed result and the
    K/V move's indices in one launch, one CTA per request (TREEVERIFY_FUSED_ACCEPT)."""

    name: str = "ddtree_walk_pack"
    expr: str = "treeverify::ddtree_walk_pack"
    threads: int = 128
    source_file: str = "ddtree_walk.cu"


@dataclass(frozen=True)
class KvMoveVariant(_OneKernel):
    """kv_move_rows (kv_move.cu): a round's accepted K/V rows moved for every layer of a stacked
    cache, one CTA per (request, layer); its (dynamic) shared memory is sized per launch."""

    name: str = "kv_move_rows"
    expr: str = "treeverify::kv_move_rows"
    threads: int = 128
    source_file: str = "kv_move.cu"


@dataclass(frozen=True)
class DDTreeTopkVariant:
    """ddtree_topk (ddtree_topk.cu): the draft table (log-softmax + top-k) for small k, one CTA
    per (request, depth) row, on fp32 or bf16 logits (`dtype` "fp32" / "bf16": the drafter's
    lm_head output read as it is). No fast math: expf/logf as precise as torch's."""

    dtype: str = "fp32"
    kernel: str = "ddtree_topk"
    threads: int = 256  # kTopkThreads
    source_file: str = "ddtree_topk.cu"
    smem_bytes: int = 0
    defines: tuple[str, ...] = ()
    fast_math: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"dtype: expected 'fp32' or 'bf16', got {self.dtype!r}")

    @property
    def name(self) -> str:
        return self.kernel if self.dtype == "fp32" else f"{self.kernel}_bf16"

    @property
    def expr(self) -> str:
        element = "float" if self.dtype == "fp32" else "unsigned short"
        return f"treeverify::{self.kernel}<{element}>"


@dataclass(frozen=True)
class DDTreeTopkWarpVariant(DDTreeTopkVariant):
    """ddtree_topk_warp (ddtree_topk.cu): the same table for V <= 8192 by warps first (each
    warp's k best by shuffles, then warp 0 over their candidates; TREEVERIFY_DDTREE_WARP_TOPK).
    ddtree_topk's launch shape and file."""

    kernel: str = "ddtree_topk_warp"


@dataclass(frozen=True)
class RoundStateVariant(_OneKernel):
    """whole_round_state (round_state.cu): a whole round's node slots (phase 0) and the next
    round's inputs (phase 1), one CTA per request."""

    name: str = "round_state"
    expr: str = "treeverify::whole_round_state"
    threads: int = 64
    source_file: str = "round_state.cu"


@dataclass(frozen=True)
class RoundStageVariant(RoundStateVariant):
    """round_stage_trees (round_state.cu): a whole round's trees into its verify stage and its
    node slots, one CTA per request (TREEVERIFY_ROUND_GLUE)."""

    name: str = "round_stage"
    expr: str = "treeverify::round_stage_trees"


@dataclass(frozen=True)
class RoundPathVariant(RoundStateVariant):
    """round_path_rows (round_state.cu): a whole round's accepted rows for the drafter's
    context and the next round's inputs, one CTA per request (TREEVERIFY_ROUND_GLUE)."""

    name: str = "round_path"
    expr: str = "treeverify::round_path_rows"


@dataclass(frozen=True)
class DecodeGemvVariant:
    """decode_gemv<M, BF16> (decode_gemv.cu): y = x W^T for M (1) rows, one warp per weight
    row (models/gemv.py). No fast math: plain FMAs, rounding like any fp32 accumulation."""

    m: int
    dtype: str  # "bf16" | "fp16"
    act: bool = False  # x is a gate|up output, the input silu(gate) * up (models/gemv.py)
    norm: bool = False  # the input rmsnorm(x + residual) (models/norm_linear.py)
    threads: int = 256  # kGemvWarps x 32
    smem_bytes: int = 0
    defines: tuple[str, ...] = ()
    source_file: str = "decode_gemv.cu"
    fast_math: bool = False

    @property
    def name(self) -> str:
        return f"decode_gemv_m{self.m}_{self.dtype}" + _prologue(self.act, self.norm)

    @property
    def expr(self) -> str:
        bf16, act, norm = (_cpp_bool(b) for b in (self.dtype == "bf16", self.act, self.norm))
        return f"treeverify::decode_gemv<{self.m},{bf16},{act},{norm}>"


@dataclass(frozen=True)
class SkinnyGemmVariant:
    """skinny_gemm<NT, BF16> (skinny_gemm.cu): y = x W^T for 2..8*NT rows, one CTA per sixteen
    outputs, its four warps splitting K over m16n8k16 MMAs (models/gemv.py)."""

    nt: int  # n8 tiles of x rows, one of SKINNY_TILE_COUNTS (M <= 8 NT)
    dtype: str  # "bf16" | "fp16"
    act: bool = False  # x is a gate|up output, the input silu(gate) * up (models/gemv.py)
    norm: bool = False  # the input rmsnorm(x + residual) (models/norm_linear.py)
    threads: int = 128  # kSkinnyWarps x 32
    smem_bytes: int = 0  # static: the warps' partial tiles
    defines: tuple[str, ...] = ()
    source_file: str = "skinny_gemm.cu"
    fast_math: bool = False

    @property
    def name(self) -> str:
        return f"skinny_gemm_nt{self.nt}_{self.dtype}" + _prologue(self.act, self.norm)

    @property
    def expr(self) -> str:
        bf16, act, norm = (_cpp_bool(b) for b in (self.dtype == "bf16", self.act, self.norm))
        return f"treeverify::skinny_gemm<{self.nt},{bf16},{act},{norm}>"


def _cpp_bool(value: bool) -> str:
    return "true" if value else "false"


def _prologue(act: bool, norm: bool) -> str:
    """A linear kernel's name suffix for what it makes of x on the load (one at most)."""
    if act and norm:
        raise ValueError("act, norm: a linear kernel takes one prologue, not both")
    return "_silu" if act else "_norm" if norm else ""


Variant = (
    FwdVariant
    | MlaSm90Variant
    | GqaSm90Variant
    | MergeVariant
    | MaskVariant
    | DDTreeHeapVariant
    | DDTreeWalkVariant
    | DDTreeWalkPackVariant
    | KvMoveVariant
    | DDTreeTopkVariant
    | DDTreeTopkWarpVariant
    | RoundStateVariant
    | RoundStageVariant
    | RoundPathVariant
    | DecodeGemvVariant
    | SkinnyGemmVariant
)


def fwd_variant(
    arch: str,
    dqk: int,
    dv: int,
    mla: bool,
    dtype: str,
    rows: int = 64,
    portable: bool = False,
    mla_schedule: str = "pair",
    gqa_schedule: str = "pingpong-auto",
    gqa_q_regs: bool = False,
    gqa_wide: bool = False,
) -> FwdVariant | MlaSm90Variant | GqaSm90Variant:
    """The forward instance for a problem family on an arch (tiles sized to its shared memory).

    `rows` = tree nodes x query heads per KV head (the packed rows one KV tile can serve): GQA
    takes 128-row CTAs (8 warps) when there are that many, halving KV tile loads per FLOP, and
    with `gqa_wide` (the default schedule only; gqa_wide_pays decides) 256-row CTAs from 256
    rows on.
    """
    if arch not in SMEM_LIMIT:
        raise ValueError(f"arch: expected one of {', '.join(ALL_ARCHES)}, got {arch!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: the cuda backend takes bf16 or fp16, got {dtype!r}")
    limit = SMEM_LIMIT[arch]
    if mla:
        if (dqk, dv) != MLA_DIMS:
            raise ValueError(f"MLA head dims: expected Dqk=576, Dv=512, got Dqk={dqk}, Dv={dv}")
        if arch == "sm_90a" and not portable:
            return MlaSm90Variant(64, dtype, mla_schedule)
        # 64 rows x 576 of Q plus 32-token latent tiles; V is a view of the same tile.
        candidates = [
            FwdVariant(576, 512, 64, 32, 2, 2, dtype, True),
            FwdVariant(576, 512, 16, 32, 2, 2, dtype, True),  # 99 KB parts
        ]
    else:
        if dqk != dv or dqk not in GQA_HEAD_DIMS:
            raise ValueError(
                f"GQA head dims: the cuda backend takes Dqk == Dv in {GQA_HEAD_DIMS}, "
                f"got Dqk={dqk}, Dv={dv}"
            )
        if arch == "sm_90a" and not portable and dqk in (64, 128):
            # 128 rows: one CTA per SM anyway (registers), so 4 stages deep; 64 rows (the
            # memory-bound small trees): 2 stages keep two CTAs per SM in flight instead.
            if gqa_wide and rows >= 256 and gqa_schedule == GQA_SCHEDULES[0]:
                return GqaSm90Variant(dqk, 2, dtype, stages=4, schedule=GQA_WIDE)
            if rows >= 128:
                q_regs = gqa_q_regs and gqa_schedule not in ("tile", "pingpong-persist")
                return GqaSm90Variant(dqk, 2, dtype, stages=4, schedule=gqa_schedule, q_regs=q_regs)
            return GqaSm90Variant(dqk, 1, dtype, stages=2)
        bn = 32 if dqk == 256 else 64
        candidates = [FwdVariant(dqk, dv, 128, bn, 1, 2, dtype, False)] if rows >= 128 else []
        candidates += [
            FwdVariant(dqk, dv, 64, bn, 1, 2, dtype, False),
            FwdVariant(dqk, dv, 64, bn // 2, 1, 2, dtype, False),
        ]
    for v in candidates:
        if v.smem_bytes <= limit:
            return v
    raise ValueError(f"no tree_attn_fwd tile fits {limit} B of shared memory on {arch}")


def all_variants(arch: str) -> list[Variant]:
    """Every instance `treeverify kernels build` compiles for one arch."""
    out: list[Variant] = []
    for dtype in DTYPES:
        for d in GQA_HEAD_DIMS:
            for rows in (64, 128):
                for portable in (True, False):
                    v = fwd_variant(arch, d, d, False, dtype, rows, portable=portable)
                    if v not in out:
                        out.append(v)
        out.append(fwd_variant(arch, *MLA_DIMS, True, dtype, portable=True))
        if arch == "sm_90a":
            for schedule in MLA_SCHEDULES:
                out.append(fwd_variant(arch, *MLA_DIMS, True, dtype, mla_schedule=schedule))
            for d in (64, 128):  # the other GQA schedules (TREEVERIFY_CUDA_GQA_SCHEDULE)
                for schedule in GQA_SCHEDULES[1:]:  # every one but the default
                    out.append(fwd_variant(arch, d, d, False, dtype, 128, gqa_schedule=schedule))
                out.append(fwd_variant(arch, d, d, False, dtype, 256, gqa_wide=True))  # v21
                # TREEVERIFY_CUDA_GQA_Q_REGS=1 with the default and three other schedules
                for schedule in ("pingpong-auto", "pingpong", "pingpong-tma", "pingpong-tma2"):
                    out.append(
                        fwd_variant(
                            arch, d, d, False, dtype, 128, gqa_schedule=schedule, gqa_q_regs=True
                        )
                    )
        for dv in (*GQA_HEAD_DIMS, MLA_DIMS[1]):
            out.append(MergeVariant(dv, dtype))
            out += [MergeVariant(dv, dtype, hi, u) for hi, u in MERGE_ILP_SHAPES]
            out.append(MergeVariant(dv, dtype, w=merge_head_lanes(dv)))
            if arch in MERGE_SPLIT_LANES_ARCHES:
                out.append(MergeVariant(dv, dtype, s=MERGE_SPLIT_LANES))
    out.append(MaskVariant())
    out.append(DDTreeHeapVariant())
    out.append(DDTreeWalkVariant())
    out.append(DDTreeWalkPackVariant())
    out.append(KvMoveVariant())
    out += [DDTreeTopkVariant(dt) for dt in ("fp32", "bf16")]
    out += [DDTreeTopkWarpVariant(dt) for dt in ("fp32", "bf16")]
    out.append(RoundStateVariant())
    out.append(RoundStageVariant())
    out.append(RoundPathVariant())
    # models/gemv.py: GEMV_MAX_ROWS; 32 rows in n8 tiles; plain, activation and norm prologues
    for act, norm in ((False, False), (True, False), (False, True)):
        out += [DecodeGemvVariant(1, dtype, act, norm) for dtype in DTYPES]
        out += [SkinnyGemmVariant(nt, dtype, act, norm) for nt in SKINNY_TILE_COUNTS
                for dtype in DTYPES]  # fmt: skip
    return out
