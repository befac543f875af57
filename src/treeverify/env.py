"""The one place treeverify reads environment variables.

Every variable the package honours is listed in ``VARIABLES`` (name -> what it does, default) and
read here, at call time, so tests can set them with ``monkeypatch.setenv``.

- ``TREEVERIFY_CACHE_DIR``: on-disk cache (compiled kernels and other build products);
  default ``~/.cache/treeverify``.
- ``TREEVERIFY_LOG_LEVEL``: level of the ``treeverify`` logger (DEBUG, INFO, WARNING, ERROR or a
  number); default WARNING.
- ``CUDA_HOME``: a CUDA toolkit to take headers from when compiling kernels, if set (the
  pip-installed nvidia-* headers are used otherwise).
- ``TREEVERIFY_CUDA_PORTABLE``: ``1`` runs the portable mma.sync CUDA kernels even where sm_90a
  wgmma ones exist (tests, comparisons).
- ``TREEVERIFY_CUDA_SPLIT_MERGE``: where the CUDA backend merges split-KV partials: ``auto``
  (default: in the forward when the read is small, and every tile of a batch-1 GQA plan whose
  largest tile merge reads <= 160 KiB, kernels/splits.py plan_merge_limit), ``forward``,
  ``kernel`` or a limit in KiB (tests, A/B runs).
- ``TREEVERIFY_CUDA_SPLIT_BALANCE``: how many times a uniform batch's split count the CUDA
  backend's grid leaves room for, so the long requests of a batch of mixed lengths take more
  splits (kernels/splits.py; only plans where ``balance_pays``); default 2, ``1`` turns
  balancing off (A/B runs).
- ``TREEVERIFY_CUDA_PDL``: the CUDA backend's split-merge kernel by programmatic dependent
  launch on sm_90+: ``auto`` (default; where the forward grid fits in one wave, v13b: 1.04-1.09x
  on the small cases, while on multi-wave grids the merge's early CTAs took SM slots from the
  forward, 0.93x), ``1`` (always) or ``0`` (never).
- ``TREEVERIFY_SKINNY_GEMM``: ``1`` runs linear layers of 2..32 rows on small weights with the
  few-row tensor-core kernel (models/gemv.py, kernels/cuda/skinny_gemm.cu) instead of cuBLAS
  (default; measured on the H100: the b=1 round -6.5%); ``0`` keeps cuBLAS.
- ``TREEVERIFY_SKINNY_MAX_ROWS``: the most rows the few-row kernel takes, ``32`` (default),
  ``24``, ``16`` or ``8``; more go to cuBLAS. An A/B knob: at 25-32 rows the kernel's four-tile
  instance measured 0.54-0.90x cuBLAS per call (H100, forty-sixth session) and a budget-31
  round dearer than a budget-32 one (fiftieth session); not changed until measured in the engine.
- ``TREEVERIFY_NORM_LINEAR``: ``1`` folds a Llama layer's two residual adds + RMSNorms into
  the projections after them (qkv, gate|up) where the decode GEMV or the few-row kernel takes
  them (models/norm_linear.py: the norm made on the kernel's load, 16 launches fewer a tiny-code
  forward); default ``0`` until measured. Read when a model is fused for inference.
- ``TREEVERIFY_DDTREE_WARP_TOPK``: ``1`` takes DDTree's draft table (vocabularies <= 8192) by
  warps first, shuffle-only rounds with no block barrier (kernels/cuda/ddtree_topk.cu
  ddtree_topk_warp; the block-wide rounds took ~12.6 us of the b=1 round on the H200); the same
  table; default ``0`` until measured.
- ``TREEVERIFY_ROUND_GLUE``: ``1`` stages a whole round's trees (ids, positions, mask, node
  slots) and makes its accepted rows' context indices plus the next round's inputs by one
  kernel each (engine/round_state.py, kernels/cuda/round_state.cu), and a DFlash draft's block
  rows (embedding + rotary rows) by one (spec/dflash_fused.py block_rows): ~17 launches fewer a
  round; the same values; default since the forty-eighth session (H100: the b=1 round graph
  0.3385 -> 0.3169 ms, the DFlash draft 58.7 -> 48.8 us); ``0``: the torch ops (A/B).
- ``TREEVERIFY_DDTREE_WARP_HEAP``: ``1`` pops a DDTree of budget <= 32 by the whole warp (one
  candidate a lane, a pop one warp maximum) instead of thread 0's shared-memory heap
  (kernels/cuda/ddtree_heap.cu); the same trees; default since the forty-seventh session (H200:
  the b=1 round's tree build 36.8 -> 21.9 us with the fused accept); ``0``: the thread's heap.
- ``TREEVERIFY_FUSED_ACCEPT``: ``1`` runs a round's greedy walk, its packed result and the K/V
  move's indices as one kernel and the K/V move as one kernel a cache tensor (engine/
  speculative.py, kernels/cuda/ddtree_walk.cu and kv_move.cu; ~12 launches -> 3); default
  since the forty-seventh session (H200: the b=1 accept graph 24.0 -> 6.5 us, the whole round
  0.363 -> 0.336 ms with the warp heap); ``0``: the PyTorch ops.
- ``TREEVERIFY_ROPE_TABLE``: ``1`` (default) keeps a GPU model's rotary tables for every
  position and reads a forward's rows from them by one kernel (models/layers.py
  ``Rope.tabulate``); ``0`` computes them each forward (~10 small kernels).
- ``TREEVERIFY_FUSED_SILU_DOWN``: ``1`` makes a SwiGLU MLP's activation on the load of its
  down projection where the decode GEMV or the few-row kernel runs it (models/gemv.py
  ``down_of_silu``); default ``0`` until measured.
- ``TREEVERIFY_DECODE_GEMV_PDL``: the decode GEMV (models/gemv.py) by programmatic dependent
  launch on sm_90+, its weight loads overlapping the kernel before it: ``auto`` (default, on),
  ``1`` or ``0`` (plain launches, A/B runs).
- ``TREEVERIFY_TRITON_PDL``: ``1`` launches the decode path's Triton kernels (and the DFlash
  drafter's, spec/dflash_fused.py) by programmatic dependent launch on sm_90+ (models/pdl.py);
  default ``1`` (measured 1.04x on random:mla-moe's decode, 1.02x on the 1B, H200); ``0``
  plain launches (A/B runs).
- ``TREEVERIFY_DECODE_LOOKAHEAD``: ``1`` launches each plain greedy decode step before the
  previous one is read, where graphs are captured (engine/decode_ahead.py); default ``1``
  (measured 1.09-1.45x at b=1 on the H200); ``0`` reads every step first (A/B runs).
  ``EngineConfig.decode_lookahead`` overrides it.
- ``TREEVERIFY_FUSED_DECODE_STEP``: ``1`` picks the tokens of a decode step launched ahead and
  of a whole round in Triton (engine/pick_kernels.py; the step's end with the advance of its
  inputs in two launches, engine/decode_step_end.py, instead of ~7 PyTorch kernels), greedy or
  sampled: sampled plain steps are then launched ahead and sampled rounds run whole, each draw
  hashed on the device; default ``1`` since the thirty-sixth session (H100, ada42ed: greedy
  decode steps 2-6% faster on all six rows of `bench engine decode`, plain sampled decoding
  2.7-3.1x faster at b=1 on tiny-code, and with the adaptive controller's step paths it leaves
  sampled rounds that do not pay; docs/performance.md); ``0``: the PyTorch end, sampled steps
  read first and sampled rounds on the general path (A/B runs).
- ``TREEVERIFY_FEED_RING``: ``1`` (the default since the fortieth session) has a DFlash engine's
  plain steps launched ahead copy their tapped hidden rows into one device ring and hand the
  drafter's context row ids (engine/feed_ring.py: no clone, split or view per request a step,
  one gather a flush); ``0``: a clone a step, a view a request (A/B). On an H100 (227d96f,
  `step_kinds --warm` at T=1 after greedy passes, off and on in turns): adaptive at b=8
  18477 / 19748 -> 19797 / 20520 tok/s (+4-7%: the plain steps read first after a round
  610-808 -> 520-525 us), b=1 +0.7%, plain steps alone equal.
- ``TREEVERIFY_RING_IN_GRAPH``: ``1`` has those steps' graphs write the rows into the feed ring
  themselves (engine/ring_put.py: one more kernel in the graph, the ring's head kept on the
  device too) instead of a copy after each replay (~22 us a step back to back at b=8 on the
  H100); default since the forty-fourth session (H100: the DFlash engine's plain step at b=1
  as fast as plain decoding's); ``0``: the copy (A/B). Read when an engine is built.
- ``TREEVERIFY_STAGE_UNPACK``: ``1`` has every graph bucket unpack its staged inputs (ids,
  positions, slots, valid rows, each attention plan's metadata) with one kernel at the start of
  the graph (engine/stage_unpack.py) instead of a copy node per buffer (9 for a one-plan model,
  ~11 us of a tiny-code decode forward on the H100); default since the forty-eighth session
  (H100: decode forward -5.8%, verify forward -3.8%, plain decoding b=1 +6%); ``0``: the
  copies (A/B). Read when a graph is captured.
- ``TREEVERIFY_PREFILL_REPLAYS``: ``1`` (default, forty-first session) runs a step of up to 8
  short prefill chunks (requests arriving together, each within the largest prefill graph
  size, 512 by default) as one padded (1, n) prefill graph replay per chunk
  (engine/model_runner.py; with graphs off the same padded chains run eagerly, so graphs on and
  off give the same numbers, as for one prefill); ``0``: such a step runs one eager forward
  (A/B). Read when an engine is built.
- ``TREEVERIFY_RING_PROJECTION``: ``1`` (default, forty-first session) projects the feed ring's
  pending rows into the DFlash context by one captured replay per chunk that gathers them from
  the ring itself (engine/ring_projection.py: one upload of ring row, position and store row per
  row); ``0``: the general path (a host-built gather, per-request index tensors, the captured
  projection's input copies per bucket), A/B. Read when an engine is built.
- ``TREEVERIFY_AHEAD_HOLES``: ``1`` lets a plain decode step launched ahead keep going when some
  of its requests finish: their rows become holes of the bucket and the next step is launched
  ahead at once (engine/decode_ahead.py); ``0`` (default until measured): the step after a
  finish is staged by the host and read first. Read when an engine is built.
- ``TREEVERIFY_CONTEXT_LAZY``: ``1`` (default, forty-third session) keeps the DFlash context's
  feed-ring rows pending until a round needs them or the ring would overwrite them
  (engine/draft_context.py): on text no round pays for, a request's rows are then never
  projected (H100, b=8 prose sampled at T=1: 0.910x -> 0.984x plain, code 1.167x -> 1.228x);
  ``0``: a request's rows are projected every 256 (a batch's every 768), A/B. Read when an
  engine is built.
- ``TREEVERIFY_MAPPED_READBACK``: ``1`` has a plain decode step launched ahead and a whole round
  write their result into pinned host memory from the graph's last kernel
  (engine/mapped_readback.py) instead of a copy to the host after each replay; default since
  the forty-fourth session (H100: tiny-code's plain step b=1 0.187 -> 0.179 ms); ``0``: the copy
  (A/B). Read when an engine is built.
- ``TREEVERIFY_COST_WHOLE_STEP``: ``1`` teaches the adaptive controller a steady step's cost as
  the whole engine step (schedule, run, postprocess), the span calibration times; ``0`` (default
  until measured on a GPU): `run_batch` alone, so live entries run ~50 us (b=8, H100) under the
  calibrated ones they are compared with. Read when an engine is built.
- ``TREEVERIFY_CALIBRATE_RUN_BATCH``: ``1`` has calibration time each step by the span a steady
  step teaches the controller (`run_batch` alone, or the whole step with
  ``TREEVERIFY_COST_WHOLE_STEP=1``), so calibrated and live entries share one unit; ``0``
  (default until measured on a GPU): calibration times the whole step. Read when an engine is
  built.
- ``TREEVERIFY_MOE_GEMV_SHARED``: ``1`` runs the shared experts on the expert-GEMV path as
  more pairs of the same two GEMVs; default ``1`` (measured 1.03x on random:mla-moe's decode,
  H200); ``0`` their own GEMM + GEMV (A/B runs).
- ``TREEVERIFY_CUDA_SPLIT_ORDER``: which requests a balanced plan's later splits serve first:
  ``longest`` (default since v27: longest first, batches of <= 32; the longest remainders
  start as the first splits end; SGLang's page-1 GQA batch 1.09x, mixed-length grid 1.014x)
  or ``request`` (request order, A/B runs).
- ``TREEVERIFY_CUDA_MERGE_MAX_CTAS``: the bound on the token merge kernel's grid (default
  2048; kernels/splits.py ``merge_heads_per_cta``): smaller makes each CTA merge more heads
  after one request lookup (8192, the earlier default, measured 0.99x on the grid).
- ``TREEVERIFY_CUDA_GQA_SCHEDULE``: the sm_90a GQA kernel for 128-row CTAs: ``pingpong-auto``
  (default since v20: the ping-pong kernel with v15's direct producer on batches of at most 32k keys
  and the shared-pointer one above, chosen per launch on the device: grid 1.00x, SGLang's GQA batch
  path 1.22x at page 1, 1.10x at page 16), ``pingpong`` (v14b: a producer warpgroup and two
  consumers taking turns on the MMAs, 1.12x on the GQA N=64 cases; its producer shares row pointers
  through shared memory), ``tile`` (one warpgroup per 64 rows, each loading and computing; kept for
  A/B runs), ``pingpong-direct`` (the ping-pong kernel whose producer threads look their own KV rows
  up: v15, 1.09-1.13x on short contexts at page size 1, 0.47-0.94x where the KV streams from DRAM)
  or ``pingpong-shfl`` (each producer warp looks its rows up and hands the pointers over by
  shuffles, pingpong's copy pattern kept: v16, 1.02x) or ``pingpong-tma`` (whole tiles of paged keys
  by TMA, one box a page: v17, 1.01x) or ``pingpong-tma2`` (the same in 2-CTA clusters sharing each
  tile by multicast: v19, 0.93x) or ``pingpong-persist`` (one CTA an SM, each walking an equal
  share of the batch's key tiles, cut units merged by their last piece: v23, 0.83x on the GQA
  grid, 1.10x on its long mixed-length case; an option).
- ``TREEVERIFY_CUDA_GQA_256``: the default GQA schedule's 256-row CTAs (v21: one KV tile serves
  256 rows, half the KV an SM takes in per FLOP; 1.11-1.21x on the grid's B32 N=64 cases,
  0.69-0.85x on small batches) where trees x group reach 256 rows: ``auto`` (default since
  2026-12-03: where batch x KV heads x 256-row tiles reach the SM count, not at page size 1 past
  32k batch keys: grid 1.018x at page 16, 0.997x at page 1; every GPU test file passed with it),
  ``0`` (never: 128-row CTAs) or ``1`` (always).
- ``TREEVERIFY_CUDA_MERGE_ILP``: ``1`` gives the split-merge kernel 4 heads x 4 splits (CTAs
  that merge several heads) or 16 splits (plans of more than 8 splits) of loads in flight a
  thread instead of one head's 8 (v22; its heads were a chain of L2 round trips). Default ``0``:
  measured 0.994x on the grid (small MLA cases 0.92-1.06x) and no gain on SGLang's GQA batch.
- ``TREEVERIFY_CUDA_MERGE_WIDE``: ``1`` gives each merge-kernel CTA that merges several heads
  one warp (a group of dv / 4 threads) per head, up to 256 threads, so its heads' L2 round trips
  overlap instead of running one after another in one warp (v28). Default ``0``.
- ``TREEVERIFY_CUDA_FUSED_MERGE_ILP``: ``1`` makes the forward's own merge of a split tile
  (the last of its CTAs, tiles within ``TREEVERIFY_CUDA_SPLIT_MERGE``'s limit) of a 2-split tile
  take 4 rows x 2 splits of loads a thread instead of 2 rows x 8 splits, of which it used 4
  (v28: half the dependent L2 round trips), and lets such a tile merge in the forward up to
  twice the byte limit (SGLang's 2-split 128-row GQA tiles: the merge kernel launch goes away).
  Default ``1`` (sm_90 kernels; measured 1.07-1.09x on SGLang's GQA batch path, grid neutral);
  ``0`` restores v8's shape and limit.
- ``TREEVERIFY_CUDA_MERGE_SPLIT_LANES``: ``1`` gives the merge kernel of plans that split a
  row more than 8 ways 4 groups of dv / 4 threads a head, each merging every 4th split, combined
  through shared memory (v30: a 64-split MLA row in 2 dependent L2 round trips a thread instead
  of 8, 4x the loads in flight; built for sm_80-sm_90a only, ignored elsewhere); measured
  1.05-1.12x on the MLA-TP8 B1 N=16 cases and 0.76-0.94x on its N=64 ones (the merge grid
  already a full wave). ``auto`` (v31, the default) takes them only where the merge grid is at
  most one wave (kernels/splits.py, split_lanes_pay): measured 1.01x / 1.06x / 1.17x on the three
  cases it picks (MLA-TP8 B1 N=16 at 1024 / 8192 / 32768 keys), the rest of the grid untouched;
  ``0`` never.
- ``TREEVERIFY_CUDA_GQA_Q_REGS``: ``1`` makes the ping-pong GQA kernels keep Q's fragments in
  registers and issue QK as register-A wgmma (v18: half the shared-memory reads of QK; measured
  1.01x, so default ``0``).
- ``TREEVERIFY_CUDA_TMA_MIN_PAGE``: the smallest KV page size the ``pingpong-tma`` schedule
  loads by TMA (default 8: a box of 8 rows fills one 1024-byte swizzle atom; smaller pages
  take the cp.async path; 1 lets every page size that divides 64 try TMA, for GPU tests).
- ``TREEVERIFY_FUSED_ROUTING``: ``0`` turns off the one-Triton-kernel MoE expert selection a
  GPU uses by default (models/fused_routing.py; ~15 PyTorch ops a layer instead).
- ``TREEVERIFY_FUSED_MLA_ROPE``: the absorbed MLA layer's attention operands (q_pe and k_pe
  rotated, packed beside q_lat and c_kv) in one Triton kernel on a GPU (models/fused_mla.py)
  instead of ~20 PyTorch kernels a layer; in the engine the same kernel also writes the latent
  row to its cache slot (PagedAttention.pack_store_attend: no cache-write launch). Default ``1``
  (random:mla-moe on the H200: decode b=1 2.05 -> 1.82 ms, verify 1.05-1.16x); ``0`` the PyTorch
  ops (an A/B, or an escape hatch).
- ``TREEVERIFY_FUSED_MOE_DISPATCH``: the grouped-GEMM MoE path's dispatch (expert counts, rows in
  expert order, offsets) and combine (weighted sum of a token's k outputs) as two Triton kernels
  (models/fused_moe.py) instead of ~20 PyTorch kernels a layer. ``auto`` (default): where a batch
  has at most ``fused_moe.AUTO_MAX_PAIRS`` (token, expert) pairs, the sizes where it measured
  faster (decode b=1 1.82 -> 1.57 ms; 0.83x at 768-6144 pairs); ``1`` wherever it fits; ``0``
  never.
- ``TREEVERIFY_MOE_GEMV``: a decode-sized MoE batch's routed experts as two expert-indexed
  GEMVs in pair order (models/moe_gemv.py: no sort, no grouped GEMM): ``auto`` (default) for
  batches of at most ``moe_gemv.AUTO_MAX_PAIRS`` (token, expert) pairs, ``1`` up to
  ``moe_gemv.MAX_PAIRS`` (an A/B of the bound), ``0`` never.
- ``TREEVERIFY_MOE_GEMV_TILE``: ``BN,BK,WARPS``: the expert GEMV's weight rows and columns a
  program reads and its warps (powers of two: BN 1..256, BK 16..4096, WARPS 1..16); unset:
  moe_gemv's BN, BK and 4. An A/B of the tile (scripts/moe_gemv_bench.py).
- ``TREEVERIFY_CUDA_MLA_SCHEDULE``: the sm_90a MLA kernel: ``pair`` (default; each warpgroup
  takes whole KV tiles) or ``split`` (both take half of every tile; v9, kept for A/B runs).
- ``TREEVERIFY_FAULT``: TEST ONLY; plants one fault (see engine/faults.py) for the gate's suite.
- ``NOTIFY_SOCKET``: systemd's readiness socket (the server sends READY=1 / STOPPING=1).
- ``TREEVERIFY_TEST_HOOKS``: TEST ONLY; ``1`` adds the server's /_test/stall and /_test/resume.
- ``TREEVERIFY_API_KEY``: the bearer key the server demands on every route but the health checks
  (``--api-key`` wins over it), and the one the gate and clients send; unset: no authentication.
- ``TREEVERIFY_SGLANG_FALLBACK``: the stock SGLang attention backend that serves every mode but
  target-verify behind ``--attention-backend treeverify``; default ``triton``.
- ``TREEVERIFY_SGLANG_KERNEL``: the kernel backend the SGLang integration plans on (``cuda``,
  ``triton`` or ``torch``); default ``cuda``.
- ``TREEVERIFY_COMMIT``: the commit written into benchmark JSON where the checkout has no .git
  (the GPU machine's copy of the tree).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

VARIABLES: dict[str, str] = {
    "TREEVERIFY_FAULT": "TEST ONLY. Plants one fault in the engine/server (engine/faults.py lists "
    "them) so the gate's fault suite can prove it catches each; unset in any real deployment.",
    "NOTIFY_SOCKET": "systemd's readiness socket; the server sends READY=1 / STOPPING=1 to it.",
    "TREEVERIFY_TEST_HOOKS": "TEST ONLY. 1: the server exposes /_test/stall and /_test/resume "
    "(freeze the engine loop) so tests can prove /health and /health_generate notice.",
    "TREEVERIFY_API_KEY": "Bearer key: the server requires 'Authorization: Bearer <key>' on every "
    "route but /health and /health_generate (--api-key overrides it); the gate sends it.",
    "TREEVERIFY_COMMIT": "Commit recorded in benchmark JSON when the checkout has no .git "
    "(the GPU machine's copy); scripts/gpu-check takes it as an argument.",
    "TREEVERIFY_CUDA_PORTABLE": "1: use the portable mma.sync CUDA kernels even on sm_90a (tests "
    "and comparisons).",
    "TREEVERIFY_CUDA_SPLIT_MERGE": "Where the CUDA backend merges split-KV partials: auto "
    "(default; in the forward when small, every tile of a small batch-1 GQA plan, else a merge "
    "kernel), forward, kernel, or a limit in KiB (tests, A/B).",
    "TREEVERIFY_CUDA_SPLIT_BALANCE": "Room in the CUDA backend's grid for this many times a "
    "uniform batch's splits, taken by the long requests of a mixed batch (default 2; 1: off).",
    "TREEVERIFY_CUDA_PDL": "The CUDA split-merge kernel by programmatic dependent launch on "
    "sm_90+: auto (default; where the forward grid fits in one wave), 1 (always) or 0 (never).",
    "TREEVERIFY_CUDA_MAX_SPLITS": "The CUDA backend's split-KV count forced for every plan, "
    "1..64 (A/B, scripts/split_sweep.py); unset: kernels/splits.py's policy decides.",
    "TREEVERIFY_CUDA_SPLIT_SHARE": "In balanced plans whose requests take one split each, no "
    "split shorter than this multiple (1..4) of the batch's mean keys (1: the v12 rule); unset: "
    "the policy's own value.",
    "TREEVERIFY_DECODE_GEMV": "0: the decode GEMV (models/gemv.py) off, every linear layer on "
    "cuBLAS (an A/B, or an escape hatch); default 1.",
    "TREEVERIFY_SKINNY_GEMM": "1 (default): linear layers of 2..32 rows on weights <= 2 MB (a "
    "batch-1 verify forward, a drafter's block) by the few-row tensor-core kernel instead of "
    "cuBLAS; 0: cuBLAS.",
    "TREEVERIFY_SKINNY_MAX_ROWS": "The most rows the few-row kernel takes: 32 (default), 24, 16 "
    "or 8; linears of more rows go to cuBLAS (an A/B knob, models/gemv.py).",
    "TREEVERIFY_NORM_LINEAR": "1: a Llama layer's adds + RMSNorms made on the load of the "
    "projections after them (models/norm_linear.py); default 0 (off until measured).",
    "TREEVERIFY_DDTREE_WARP_TOPK": "1: DDTree's draft table (vocabularies <= 8192) by warps "
    "first instead of block-wide rounds (the same table); default 0 (off until measured).",
    "TREEVERIFY_ROUND_GLUE": "1: a whole round's tree staging, its path rows + next inputs and a "
    "DFlash draft's block rows by one kernel each (~17 launches fewer a round, the same values) "
    "(default); 0: the torch ops (A/B).",
    "TREEVERIFY_DDTREE_WARP_HEAP": "1: DDTree budgets <= 32 popped by the whole warp instead of "
    "one thread's heap (the same trees) (default); 0: the thread's heap.",
    "TREEVERIFY_FUSED_ACCEPT": "1: a round's greedy walk, packed result and K/V move indices by "
    "one kernel and the K/V move by one kernel a cache tensor (~12 launches -> 3) (default); 0: "
    "the PyTorch ops.",
    "TREEVERIFY_ROPE_TABLE": "1 (default): a GPU model's rotary tables kept for every position, "
    "a forward's rows read by one kernel; 0: computed each forward (~10 small kernels).",
    "TREEVERIFY_FUSED_SILU_DOWN": "1: a SwiGLU MLP's activation made on the load of its down "
    "projection where the decode GEMV or the few-row kernel runs it (one kernel fewer a layer); "
    "default 0 (off until measured).",
    "TREEVERIFY_DECODE_GEMV_PDL": "The decode GEMV by programmatic dependent launch on sm_90+ "
    "(its weights loaded while the kernel before it ends): auto (default, on), 1 or 0 (A/B).",
    "TREEVERIFY_TRITON_PDL": "1: the decode path's and the DFlash drafter's Triton kernels by "
    "programmatic dependent launch on sm_90+ (each waits for the kernel before it as it "
    "starts); default 1; 0: A/B.",
    "TREEVERIFY_DECODE_LOOKAHEAD": "1: each plain greedy decode step launched before the "
    "previous one is read, where graphs are captured (engine/decode_ahead.py); default 1.",
    "TREEVERIFY_FUSED_DECODE_STEP": "1: a decode step launched ahead and a whole round pick their "
    "tokens in Triton (engine/pick_kernels.py), greedy or sampled: sampled plain steps launched "
    "ahead, sampled rounds whole; default 1; 0: the PyTorch end (A/B).",
    "TREEVERIFY_FEED_RING": "1 (default): a DFlash engine's plain steps launched ahead copy "
    "their tapped rows into one device ring and hand the drafter row ids (engine/feed_ring.py); "
    "0: a clone a step, a view a request (A/B).",
    "TREEVERIFY_RING_IN_GRAPH": "1: those steps' graphs write the rows into the feed ring "
    "themselves (engine/ring_put.py) (default); 0: a copy after each replay (A/B).",
    "TREEVERIFY_STAGE_UNPACK": "1: graphs unpack their staged inputs with one kernel "
    "(engine/stage_unpack.py) (default); 0: a copy per buffer (A/B).",
    "TREEVERIFY_PREFILL_REPLAYS": "1 (default): a step of up to 8 short prefill chunks runs as "
    "one prefill graph replay per chunk (engine/model_runner.py); 0: one eager forward (A/B).",
    "TREEVERIFY_RING_PROJECTION": "1 (default): the feed ring's pending rows projected by one "
    "replay a chunk that gathers them in the graph (engine/ring_projection.py); 0: the general "
    "path (A/B).",
    "TREEVERIFY_AHEAD_HOLES": "1: rows of requests that finish become holes and the next plain "
    "step is still launched ahead (engine/decode_ahead.py); 0 (default): read first (A/B).",
    "TREEVERIFY_CONTEXT_LAZY": "1 (default): the DFlash context's feed-ring rows stay pending "
    "until a round needs them or the ring would overwrite them (engine/draft_context.py); 0: "
    "projected every 256 rows a request, 768 a batch (A/B).",
    "TREEVERIFY_MAPPED_READBACK": "1: plain steps launched ahead and whole rounds write their "
    "result into pinned host memory from the graph (engine/mapped_readback.py) (default); 0: "
    "a copy to the host after each replay (A/B).",
    "TREEVERIFY_COST_WHOLE_STEP": "1: a steady step's cost taught to the adaptive controller "
    "is the whole engine step, as calibration times it (engine/llm.py); 0 (default): "
    "run_batch alone (A/B).",
    "TREEVERIFY_CALIBRATE_RUN_BATCH": "1: calibration times each step by the span a steady "
    "step teaches the controller (engine/budget_calibration.py); 0 (default): the whole step.",
    "TREEVERIFY_MOE_GEMV_SHARED": "1: the shared experts as more pairs of the expert GEMVs "
    "(models/moe_gemv.py) instead of their own GEMM + GEMV; default 1; 0: A/B.",
    "TREEVERIFY_CUDA_SPLIT_ORDER": "Balanced plans' later splits in grid order: longest "
    "(default; the longest requests' remainders start first; batches <= 32) or request.",
    "TREEVERIFY_CUDA_MERGE_MAX_CTAS": "Bound on the CUDA token merge kernel's grid (default "
    "2048): smaller gives each CTA more heads, fewer request lookups (A/B runs).",
    "TREEVERIFY_CUDA_GQA_SCHEDULE": "The sm_90a GQA kernel for 128-row CTAs: pingpong-auto "
    "(default, v20: the direct producer on batches of <= 32k keys, pingpong's above), pingpong "
    "(producer warpgroup + two consumers in turns, v14), tile (the v11 kernel, for A/B runs), "
    "pingpong-direct (producer threads look their own KV rows up, v15), pingpong-shfl (producer "
    "warps share row pointers by shuffles, v16), pingpong-tma (paged tiles by TMA, v17) or "
    "pingpong-tma2 (TMA tiles multicast to a 2-CTA cluster, v19) or pingpong-persist (one CTA "
    "an SM walking an equal share of the batch's key tiles, v23, measured 0.83x).",
    "TREEVERIFY_CUDA_GQA_256": "The default GQA schedule's 256-row CTAs (v21) where trees x "
    "group reach 256 rows: auto (default: where batch x KV heads fill the GPU's SMs; grid 1.018x "
    "at page 16), 0 (never: 128-row CTAs) or 1 (wherever the rows reach 256).",
    "TREEVERIFY_CUDA_MERGE_ILP": "1: the split-merge kernel keeps 16 loads in flight a thread "
    "(4 heads x 4 splits, or 16 splits of one head) instead of one head's 8 (v22; default 0: "
    "measured 0.994x on the grid).",
    "TREEVERIFY_CUDA_MERGE_WIDE": "1: the split-merge kernel's CTAs take their heads with one "
    "warp (dv / 4 threads) a head, up to 256 threads, instead of one warp for all (v28); "
    "default 0.",
    "TREEVERIFY_CUDA_FUSED_MERGE_ILP": "1: a 2-split tile merged in the forward takes 4 rows x 2 "
    "splits of loads a thread and merges in the forward up to twice the byte limit (v28); "
    "default 1, 0 restores v8's 2 rows x 8 splits.",
    "TREEVERIFY_CUDA_MERGE_SPLIT_LANES": "1: the merge kernel takes a head's splits with 4 "
    "groups of threads where rows split more than 8 ways (v30); auto (default): only where the "
    "merge grid is at most one wave (v31); 0: never.",
    "TREEVERIFY_CUDA_GQA_Q_REGS": "1: the ping-pong GQA kernels keep Q in registers (QK as "
    "register-A wgmma, v18); default 0.",
    "TREEVERIFY_CUDA_TMA_MIN_PAGE": "Smallest KV page size the pingpong-tma GQA schedule loads "
    "by TMA (default 8; smaller pages use cp.async; 1: try every page size, GPU tests).",
    "TREEVERIFY_FUSED_MLA_ROPE": "0: the absorbed MLA layer's rope and operand packing by ~20 "
    "PyTorch ops instead of one Triton kernel on a GPU (models/fused_mla.py; default 1).",
    "TREEVERIFY_FUSED_MOE_DISPATCH": "The grouped-GEMM MoE path's dispatch and combine as two "
    "Triton kernels (models/fused_moe.py): auto (default; batches of <= 512 token-expert "
    "pairs, where it measured faster), 1 (wherever it fits) or 0.",
    "TREEVERIFY_MOE_GEMV": "Decode-sized MoE batches' routed experts as two GEMVs "
    "(models/moe_gemv.py): auto (default; <= 16 token-expert pairs), 1 (<= 512) or 0.",
    "TREEVERIFY_MOE_GEMV_TILE": "BN,BK,WARPS of the expert GEMV (models/moe_gemv.py), powers "
    "of two; unset: its defaults. An A/B of the tile.",
    "TREEVERIFY_FUSED_ROUTING": "0: MoE expert selection by ~15 PyTorch ops a layer instead of "
    "one Triton kernel on a GPU (models/fused_routing.py; default 1, where Triton imports).",
    "TREEVERIFY_CUDA_MLA_SCHEDULE": "The sm_90a MLA kernel: pair (default; each warpgroup takes "
    "whole KV tiles) or split (both take half of every tile: the v9 kernel, for A/B runs).",
    "TREEVERIFY_CACHE_DIR": "On-disk cache for compiled kernels and other build products "
    "(default ~/.cache/treeverify).",
    "TREEVERIFY_LOG_LEVEL": "Level of the 'treeverify' logger: DEBUG, INFO, WARNING (default), "
    "ERROR, or a number.",
    "TREEVERIFY_SGLANG_FALLBACK": "Stock SGLang attention backend for every mode but "
    "target-verify under --attention-backend treeverify (default triton; MLA models: triton).",
    "TREEVERIFY_SGLANG_KERNEL": "Kernel backend of the SGLang integration's verify plans: cuda "
    "(default), triton or torch.",
    "CUDA_HOME": "A CUDA toolkit whose include/ the kernel compiler may use (optional).",
}


# engine/faults.py's table: a name not in it planted nothing, silently (a typo such as
# "attn_pst" let a fault test believe it had planted one; a new user's audit)
FAULT_NAMES = (
    "attn_past", "merge_bug", "batch_over", "garbage_after", "spec_diverge",
    "spec_greedy_sampled", "capture_crash", "capture_hang", "first_request_crash",
)  # fmt: skip


def planted_fault() -> tuple[str, int] | None:
    """TREEVERIFY_FAULT (TEST ONLY, engine/faults.py): (name, parameter) of the planted fault;
    ValueError naming the variable for a name not in FAULT_NAMES or a parameter not an int."""
    value = os.environ.get("TREEVERIFY_FAULT", "").strip()
    if not value:
        return None
    name, _, param = value.partition(":")
    if param and not param.isdigit():
        raise ValueError(f"TREEVERIFY_FAULT: expected NAME or NAME:INT, got {value!r}")
    if name not in FAULT_NAMES:
        raise ValueError(f"TREEVERIFY_FAULT: unknown fault {name!r}; expected one of "
                         f"{', '.join(FAULT_NAMES)}")  # fmt: skip
    return name, int(param or 0)


def notify_socket() -> str | None:
    """NOTIFY_SOCKET: systemd's readiness socket (Type=notify units), or None."""
    return os.environ.get("NOTIFY_SOCKET", "").strip() or None


def test_hooks_enabled() -> bool:
    """TREEVERIFY_TEST_HOOKS=1 (TEST ONLY): the server adds /_test/stall and /_test/resume."""
    return os.environ.get("TREEVERIFY_TEST_HOOKS", "").strip() == "1"


def api_key_as_set() -> str | None:
    """TREEVERIFY_API_KEY stripped ("" when set but blank), None when unset: for a parser's
    default, whose caller refuses "" as it refuses an empty --api-key."""
    value = os.environ.get("TREEVERIFY_API_KEY")
    return None if value is None else value.strip()


def api_key() -> str | None:
    """TREEVERIFY_API_KEY: the server's bearer key (and the gate's), or None when unset; set but
    blank is a ValueError naming it (a secret that failed to render served with no key at all:
    a new user's audit)."""
    value = os.environ.get("TREEVERIFY_API_KEY")
    if value is None:
        return None
    if not value.strip():
        raise ValueError("TREEVERIFY_API_KEY: set but empty; unset it to serve without a key")
    return value.strip()


def commit_override() -> str | None:
    """TREEVERIFY_COMMIT: the commit to record in benchmark JSON where the tree has no .git."""
    return os.environ.get("TREEVERIFY_COMMIT", "").strip() or None


def sglang_fallback() -> str:
    """TREEVERIFY_SGLANG_FALLBACK: the stock SGLang backend for other modes (default triton)."""
    return os.environ.get("TREEVERIFY_SGLANG_FALLBACK", "").strip() or "triton"


def sglang_kernel() -> str:
    """TREEVERIFY_SGLANG_KERNEL: cuda (default), triton or torch; anything else is a ValueError."""
    value = os.environ.get("TREEVERIFY_SGLANG_KERNEL", "").strip() or "cuda"
    if value not in ("cuda", "triton", "torch"):
        raise ValueError(f"TREEVERIFY_SGLANG_KERNEL: expected cuda, triton or torch, got {value!r}")
    return value


def cuda_portable() -> bool:
    """TREEVERIFY_CUDA_PORTABLE=1: prefer the portable (mma.sync) CUDA kernels on every arch."""
    return os.environ.get("TREEVERIFY_CUDA_PORTABLE", "").strip() in ("1", "true", "yes")


def cuda_split_merge() -> str:
    """TREEVERIFY_CUDA_SPLIT_MERGE: auto (default: tiles of at most 64 KiB merged in the
    forward, every tile of a small GQA plan), forward, kernel, or a limit in KiB
    (kernels/splits.py, fused_merge_limit, plan_merge_limit)."""
    return os.environ.get("TREEVERIFY_CUDA_SPLIT_MERGE", "").strip().lower() or "auto"


def cuda_split_balance(default: int = 2) -> int:
    """TREEVERIFY_CUDA_SPLIT_BALANCE: the balanced split rule's grid factor (kernels/splits.py);
    `default` when unset (2), 1 turns balancing off."""
    value = os.environ.get("TREEVERIFY_CUDA_SPLIT_BALANCE", "").strip() or str(default)
    if not value.isdigit() or not 1 <= int(value) <= 8:
        raise ValueError(
            f"TREEVERIFY_CUDA_SPLIT_BALANCE: expected an integer in 1..8, got {value!r}"
        )
    return int(value)


def cuda_split_share() -> float | None:
    """TREEVERIFY_CUDA_SPLIT_SHARE: in balanced plans whose requests take one split each, no
    split shorter than this multiple of the batch's mean keys (kernels/splits.py,
    SINGLE_SPLIT_SHARE; 1: the v12 rule); unset: None, the policy's own value."""
    value = os.environ.get("TREEVERIFY_CUDA_SPLIT_SHARE", "").strip()
    if not value:
        return None
    try:
        share = float(value)
    except ValueError:
        share = float("nan")
    if not 1.0 <= share <= 4.0:
        raise ValueError(f"TREEVERIFY_CUDA_SPLIT_SHARE: expected a number in 1..4, got {value!r}")
    return share


@contextlib.contextmanager
def set_while(assignments: dict[str, str]) -> Iterator[None]:
    """These variables set for the block and restored after it (unset where they were unset):
    switches are read when an engine or a plan is built, so an A/B builds its variant inside."""
    saved = {k: os.environ.get(k) for k in assignments}
    os.environ.update(assignments)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _choice(name: str, choices: tuple[str, ...]) -> str:
    """A variable that names one of `choices` (case-insensitive; unset: the first)."""
    value = os.environ.get(name, "").strip().lower() or choices[0]
    if value not in choices:
        raise ValueError(f"{name}: expected {' or '.join(choices)}, got {value!r}")
    return value


def _switch(name: str, default: str) -> bool:
    """A 0/1 variable (also false/true, no/yes); `default` when unset."""
    value = os.environ.get(name, default).strip().lower()
    if value not in ("0", "1", "false", "true", "no", "yes"):
        raise ValueError(f"{name}: expected 0 or 1, got {value!r}")
    return value in ("1", "true", "yes")


def cuda_split_order() -> str:
    """TREEVERIFY_CUDA_SPLIT_ORDER: which request a balanced plan's later-split CTAs serve in
    grid order: longest (default since v27: longest request first, for batches of <= 32
    requests; kernels/cuda/device_common.cuh, cta_request_head) or request (request order)."""
    return _choice("TREEVERIFY_CUDA_SPLIT_ORDER", ("longest", "request"))


def _auto_switch(name: str, default: str = "auto") -> str:
    """A variable that is auto, 1 or 0 (1/0 also as true/false, yes/no); `default` when unset."""
    value = os.environ.get(name, "").strip().lower() or default
    aliases = {"auto": "auto", "1": "1", "true": "1", "yes": "1", "0": "0", "false": "0", "no": "0"}
    if value not in aliases:
        raise ValueError(f"{name}: expected auto, 1 or 0, got {value!r}")
    return aliases[value]


def cuda_pdl() -> str:
    """TREEVERIFY_CUDA_PDL: auto (default: programmatic dependent launch of the split merge where
    the forward grid fits in one wave), 1 (always, sm_90+) or 0 (never)."""
    return _auto_switch("TREEVERIFY_CUDA_PDL")


def cuda_gqa_schedule() -> str:
    """TREEVERIFY_CUDA_GQA_SCHEDULE: pingpong-auto (default), pingpong, tile, pingpong-direct,
    pingpong-shfl, pingpong-tma, pingpong-tma2 or pingpong-persist (kernels/cuda/variants.py)."""
    return _choice(
        "TREEVERIFY_CUDA_GQA_SCHEDULE",
        (
            "pingpong-auto",
            "pingpong",
            "tile",
            "pingpong-direct",
            "pingpong-shfl",
            "pingpong-tma",
            "pingpong-tma2",
            "pingpong-persist",
        ),
    )


def cuda_gqa_256() -> str:
    """TREEVERIFY_CUDA_GQA_256: auto (default), 0 or 1: the default GQA schedule's 256-row CTAs
    (kernels/cuda/variants.py, gqa_wide_pays)."""
    return _choice("TREEVERIFY_CUDA_GQA_256", ("auto", "0", "1"))


def cuda_merge_ilp() -> bool:
    """TREEVERIFY_CUDA_MERGE_ILP: the merge kernel with more loads in flight (v22; default 0)."""
    return _switch("TREEVERIFY_CUDA_MERGE_ILP", "0")


def cuda_merge_wide() -> bool:
    """TREEVERIFY_CUDA_MERGE_WIDE: the merge kernel's heads a CTA taken by several warps at once
    (v28; default 0)."""
    return _switch("TREEVERIFY_CUDA_MERGE_WIDE", "0")


def cuda_merge_split_lanes() -> str:
    """TREEVERIFY_CUDA_MERGE_SPLIT_LANES: the merge kernel's split lanes for plans of more than
    8 splits: auto (default: only where the merge grid is at most one wave, v31), 1 (always,
    v30) or 0 (never)."""
    return _auto_switch("TREEVERIFY_CUDA_MERGE_SPLIT_LANES")


def cuda_fused_merge_ilp() -> bool:
    """TREEVERIFY_CUDA_FUSED_MERGE_ILP: a tile merged in the forward with its loads shaped by its
    split count, 2-split tiles up to twice the byte limit (v28; default 1)."""
    return _switch("TREEVERIFY_CUDA_FUSED_MERGE_ILP", "1")


def cuda_gqa_q_regs() -> bool:
    """TREEVERIFY_CUDA_GQA_Q_REGS: the ping-pong GQA kernels' QK with Q in registers (v18)."""
    return _switch("TREEVERIFY_CUDA_GQA_Q_REGS", "0")


def cuda_tma_min_page() -> int:
    """TREEVERIFY_CUDA_TMA_MIN_PAGE: the smallest page size the pingpong-tma schedule loads by
    TMA (default 8; kernels/cuda/tma.py)."""
    value = os.environ.get("TREEVERIFY_CUDA_TMA_MIN_PAGE", "").strip() or "8"
    if not value.isdigit() or not 1 <= int(value) <= 1 << 20:
        raise ValueError(
            f"TREEVERIFY_CUDA_TMA_MIN_PAGE: expected a positive integer, got {value!r}"
        )
    return int(value)


def cuda_mla_schedule() -> str:
    """TREEVERIFY_CUDA_MLA_SCHEDULE: pair (default) or split (kernels/cuda/variants.py)."""
    return _choice("TREEVERIFY_CUDA_MLA_SCHEDULE", ("pair", "split"))


def cuda_max_splits() -> int | None:
    """TREEVERIFY_CUDA_MAX_SPLITS: the CUDA backend's split count forced for every plan (A/B
    and scripts/split_sweep.py); unset: kernels/splits.py's policy decides."""
    value = os.environ.get("TREEVERIFY_CUDA_MAX_SPLITS", "").strip()
    if not value:
        return None
    if not value.isdigit() or not 1 <= int(value) <= 64:
        raise ValueError(f"TREEVERIFY_CUDA_MAX_SPLITS: expected an integer in 1..64, got {value!r}")
    return int(value)


def cuda_merge_max_ctas() -> int | None:
    """TREEVERIFY_CUDA_MERGE_MAX_CTAS: the token merge kernel's grid bound (kernels/splits.py,
    merge_heads_per_cta; unset: its MERGE_MAX_CTAS, 2048): smaller gives each CTA more heads
    and the grid fewer request lookups (an A/B for SGLang's batch path, where most CTAs find
    nothing to merge)."""
    value = os.environ.get("TREEVERIFY_CUDA_MERGE_MAX_CTAS", "").strip()
    if not value:
        return None
    if not value.isdigit() or not 64 <= int(value) <= 1 << 20:
        raise ValueError(
            f"TREEVERIFY_CUDA_MERGE_MAX_CTAS: expected an integer in 64..1048576, got {value!r}"
        )
    return int(value)


def norm_linear() -> bool:
    """TREEVERIFY_NORM_LINEAR: 1 folds a Llama layer's residual adds + RMSNorms into the
    projections after them where the decode GEMV or the few-row kernel takes them
    (models/norm_linear.py); default 0 until measured on a GPU. Read when a model is fused
    for inference (the model's `fold_norms`)."""
    return _switch("TREEVERIFY_NORM_LINEAR", "0")


def decode_gemv() -> bool:
    """TREEVERIFY_DECODE_GEMV: 0 turns the decode GEMV (models/gemv.py) off, every linear layer
    back on cuBLAS (an A/B, or an escape hatch); default on. Read once per process."""
    return _switch("TREEVERIFY_DECODE_GEMV", "1")


def skinny_gemm() -> bool:
    """TREEVERIFY_SKINNY_GEMM: 1 runs linear layers of 2..32 rows on small weights with the
    few-row tensor-core kernel (models/gemv.py, kernels/cuda/skinny_gemm.cu: a batch-1 verify
    forward's 17 rows, a drafter's 16) instead of cuBLAS; default 1 (the H100, forty-sixth
    session: the b=1 round's GPU time 0.438 -> 0.410 ms), 0 keeps cuBLAS. Read once per
    process."""
    return _switch("TREEVERIFY_SKINNY_GEMM", "1")


def skinny_max_rows() -> int:
    """TREEVERIFY_SKINNY_MAX_ROWS: the most rows of a linear the few-row kernel takes (32,
    default; 24, 16 or 8: more rows go to cuBLAS). Read once per process (models/gemv.py)."""
    return int(_choice("TREEVERIFY_SKINNY_MAX_ROWS", ("32", "24", "16", "8")))


def ddtree_warp_topk() -> bool:
    """TREEVERIFY_DDTREE_WARP_TOPK: 1 takes DDTree's draft table (vocabularies <= 8192) by warps
    first (kernels/cuda/ddtree_topk.cu ddtree_topk_warp: shuffle-only rounds a warp, then one
    warp over the candidates) instead of block-wide rounds; the same table; default 0 until
    measured on a GPU."""
    return _switch("TREEVERIFY_DDTREE_WARP_TOPK", "0")


def round_glue() -> bool:
    """TREEVERIFY_ROUND_GLUE: 1 stages a whole round's trees and makes its accepted rows'
    context indices and the next round's inputs by one kernel each (engine/round_state.py,
    kernels/cuda/round_state.cu round_stage_trees / round_path_rows) instead of ~14 torch ops,
    and a DFlash draft's block rows by one (spec/dflash_fused.py block_rows, ~6 -> 1); the same
    values; default 1 since the forty-eighth session's H100 measurement (the b=1 round -6.4%).
    Read when an engine is built (RoundState) and when the drafter is fused for inference."""
    return _switch("TREEVERIFY_ROUND_GLUE", "1")


def ddtree_warp_heap() -> bool:
    """TREEVERIFY_DDTREE_WARP_HEAP: 1 pops a DDTree of budget <= 32 by the whole warp
    (kernels/cuda/ddtree_heap.cu warp_build) instead of thread 0's heap; the same trees; default
    1 since the forty-seventh session's H200 measurement."""
    return _switch("TREEVERIFY_DDTREE_WARP_HEAP", "1")


def fused_accept() -> bool:
    """TREEVERIFY_FUSED_ACCEPT: 1 runs a round's greedy walk, its packed result and the K/V
    move's indices as one kernel (kernels/cuda/ddtree_walk.cu ddtree_walk_pack) and the K/V move
    as one kernel a stacked cache tensor (kv_move.cu); default 1 since the forty-seventh
    session's H200 measurement."""
    return _switch("TREEVERIFY_FUSED_ACCEPT", "1")


def rope_table() -> bool:
    """TREEVERIFY_ROPE_TABLE: 1 (default) keeps a GPU model's rotary tables for every position
    (models/layers.py Rope.tabulate: the rows bit-equal to those computed each forward), 0
    computes them each forward. Read when a model is prepared for inference."""
    return _switch("TREEVERIFY_ROPE_TABLE", "1")


def fused_silu_down() -> bool:
    """TREEVERIFY_FUSED_SILU_DOWN: 1 makes a SwiGLU MLP's activation on the load of its down
    projection where the decode GEMV or the few-row kernel runs it (models/gemv.py
    down_of_silu: one kernel fewer a layer); default 0 until measured on a GPU. Read once per
    process."""
    return _switch("TREEVERIFY_FUSED_SILU_DOWN", "0")


def decode_gemv_pdl() -> str:
    """TREEVERIFY_DECODE_GEMV_PDL: the decode GEMV by programmatic dependent launch, its weight
    loads issued before it waits for the kernel before it, and the Triton norms and activation
    before it signalling their dependents as they start (models/gemv.py): auto (default: on
    sm_90+), 1 (the same) or 0 (plain launches, an A/B). Read once per process."""
    return _auto_switch("TREEVERIFY_DECODE_GEMV_PDL")


def triton_pdl() -> bool:
    """TREEVERIFY_TRITON_PDL: 1 launches the decode path's Triton kernels (and the DFlash
    drafter's, spec/dflash_fused.py) by programmatic dependent launch on sm_90+ (models/pdl.py:
    each waits for the kernel before it as it starts); default 1 (measured 1.04x on
    random:mla-moe's decode step at b=1, 1.02x on the 1B, H200, 2026-12-04); 0 plain launches.
    Read once per process."""
    return _switch("TREEVERIFY_TRITON_PDL", "1")


def fused_mla_rope() -> bool:
    """TREEVERIFY_FUSED_MLA_ROPE: the absorbed MLA layer's rope and operand packing in one Triton
    kernel on a GPU (models/fused_mla.py; ~20 PyTorch kernels a layer otherwise); default 1
    (measured 1.05-1.16x on random:mla-moe's decode and verify forwards, H200, 2026-12-04).
    Read when a layer is built."""
    return _switch("TREEVERIFY_FUSED_MLA_ROPE", "1")


def fused_moe_dispatch() -> str:
    """TREEVERIFY_FUSED_MOE_DISPATCH: the grouped-GEMM MoE path's dispatch (counts, sorted rows,
    offsets) and combine as two Triton kernels (models/fused_moe.py; ~20 PyTorch kernels a layer
    otherwise): auto (default: batches of at most fused_moe.AUTO_MAX_PAIRS pairs, where it
    measured faster), 1 (wherever it fits) or 0. Read when a MoE layer is built."""
    return _auto_switch("TREEVERIFY_FUSED_MOE_DISPATCH")


def moe_gemv() -> str:
    """TREEVERIFY_MOE_GEMV: a decode-sized MoE batch's routed experts as two GEMVs
    (models/moe_gemv.py): auto (default: batches of at most moe_gemv.AUTO_MAX_PAIRS pairs), 1
    (up to moe_gemv.MAX_PAIRS) or 0. Read when a MoE layer is built."""
    return _auto_switch("TREEVERIFY_MOE_GEMV")


def decode_lookahead() -> bool:
    """TREEVERIFY_DECODE_LOOKAHEAD: 1 launches each plain greedy decode step before the previous
    one's tokens are read, where graphs are captured (engine/decode_ahead.py); default 1
    (measured 1.09-1.45x a decode step at b=1, H200, 2026-12-04); 0 reads every step first. Read
    when an engine is built (EngineConfig.decode_lookahead overrides)."""
    return _switch("TREEVERIFY_DECODE_LOOKAHEAD", "1")


def feed_ring() -> bool:
    """TREEVERIFY_FEED_RING: 1 (default) has a DFlash engine's plain steps launched ahead
    write their tapped rows into the context's feed ring (engine/feed_ring.py); 0, a clone a
    step (A/B; the ring measured +4-7% at b=8 adaptive on an H100, fortieth session). Read
    when an engine is built."""
    return _switch("TREEVERIFY_FEED_RING", "1")


def ring_in_graph() -> bool:
    """TREEVERIFY_RING_IN_GRAPH: 1 has the feed ring's plain steps write their tapped rows into
    it from inside their graphs (engine/ring_put.py; default, measured on the H100 in the
    forty-fourth session); 0, a copy after each replay. Read when an engine is built."""
    return _switch("TREEVERIFY_RING_IN_GRAPH", "1")


def stage_unpack() -> bool:
    """TREEVERIFY_STAGE_UNPACK: 1 has graph buckets unpack their staged inputs with one kernel
    (engine/stage_unpack.py), the default since the forty-eighth session's H100 measurement;
    0, a torch copy per buffer. Read when a graph is captured."""
    return _switch("TREEVERIFY_STAGE_UNPACK", "1")


def prefill_replays() -> bool:
    """TREEVERIFY_PREFILL_REPLAYS: 1 (default) runs a step of up to 8 short prefill chunks as
    one (1, n) prefill graph replay per chunk (engine/model_runner.py); 0, one eager forward
    (A/B). Read when an engine is built."""
    return _switch("TREEVERIFY_PREFILL_REPLAYS", "1")


def ahead_holes() -> bool:
    """TREEVERIFY_AHEAD_HOLES: 1 makes the rows of requests that finish holes of a plain decode
    step launched ahead, the next step launched ahead at once (engine/decode_ahead.py); 0
    (default until measured), that step is staged and read first. Read when an engine is
    built."""
    return _switch("TREEVERIFY_AHEAD_HOLES", "0")


def ring_projection() -> bool:
    """TREEVERIFY_RING_PROJECTION: 1 (default) projects the DFlash context's pending feed-ring
    rows by one replay a chunk that gathers them inside the graph (engine/ring_projection.py);
    0, the general path (A/B). Read when an engine is built."""
    return _switch("TREEVERIFY_RING_PROJECTION", "1")


def context_lazy() -> bool:
    """TREEVERIFY_CONTEXT_LAZY: 1 (default) leaves the DFlash context's pending feed-ring rows
    unprojected until a round needs them or the feed ring would overwrite them
    (engine/draft_context.py); 0, projected every flush bucket a request, three a batch (A/B).
    Read when an engine is built."""
    return _switch("TREEVERIFY_CONTEXT_LAZY", "1")


def mapped_readback() -> bool:
    """TREEVERIFY_MAPPED_READBACK: 1 has a plain decode step launched ahead (its tokens) and a
    whole round (its packed rows) write their result into pinned host memory from the graph's
    last kernel (engine/mapped_readback.py) instead of a copy to the host after each replay
    (default: measured faster on the H100, forty-fourth session); 0, the copy. Read when an
    engine is built."""
    return _switch("TREEVERIFY_MAPPED_READBACK", "1")


def cost_whole_step() -> bool:
    """TREEVERIFY_COST_WHOLE_STEP: 1 teaches the adaptive controller each steady step's cost
    as the whole engine step (schedule, run, postprocess: the span calibration times, and the
    loop's period); 0 (default until measured on a GPU), `run_batch` alone, ~50 us less at b=8
    on the H100 than calibration's entries (engine/llm.py). Read when an engine is built."""
    return _switch("TREEVERIFY_COST_WHOLE_STEP", "0")


def calibrate_run_batch() -> bool:
    """TREEVERIFY_CALIBRATE_RUN_BATCH: 1 has calibration time each step by the span a steady
    step teaches the controller (`run_batch`, or the whole step with COST_WHOLE_STEP=1): one
    unit for calibrated and live costs; 0 (default until measured on a GPU), the whole step.
    Read when an engine is built."""
    return _switch("TREEVERIFY_CALIBRATE_RUN_BATCH", "0")


def fused_decode_step() -> bool:
    """TREEVERIFY_FUSED_DECODE_STEP: 1 picks the tokens of a decode step launched ahead (and its
    advance: engine/decode_step_end.py) and of a whole round in Triton (engine/pick_kernels.py),
    greedy or sampled, so sampled plain steps are launched ahead and sampled rounds run whole;
    default 1 (measured on an H100: greedy steps 2-6% faster, plain sampled decoding 2.7-3.1x
    at b=1); 0 the PyTorch end (A/B runs). Read when an engine is built."""
    return _switch("TREEVERIFY_FUSED_DECODE_STEP", "1")


def moe_gemv_shared() -> bool:
    """TREEVERIFY_MOE_GEMV_SHARED: 1 runs the shared experts on the expert-GEMV path as more
    (token, expert) pairs of the same two GEMVs (models/moe.py stacks them after the routed
    experts) instead of their own GEMM, activation and GEMV; default 1 (measured 1.03x on
    random:mla-moe's decode step at b=1, H200, 2026-12-04); 0 their own path. Read when a MoE
    layer is built."""
    return _switch("TREEVERIFY_MOE_GEMV_SHARED", "1")


def moe_gemv_tile() -> tuple[int, int, int] | None:
    """TREEVERIFY_MOE_GEMV_TILE: "BN,BK,WARPS" for the expert GEMV (models/moe_gemv.py): powers of
    two, BN 1..256, BK 16..4096, WARPS 1..16; unset: None (the module's defaults)."""
    value = os.environ.get("TREEVERIFY_MOE_GEMV_TILE", "").strip()
    if not value:
        return None
    parts = value.split(",")
    bounds = ((1, 256), (16, 4096), (1, 16))
    ok = len(parts) == 3 and all(p.strip().isdigit() for p in parts)
    nums = tuple(int(p) for p in parts) if ok else ()
    if not ok or any(
        not lo <= n <= hi or n & (n - 1) for n, (lo, hi) in zip(nums, bounds, strict=True)
    ):
        raise ValueError(
            "TREEVERIFY_MOE_GEMV_TILE: expected BN,BK,WARPS as powers of two (BN 1..256, "
            f"BK 16..4096, WARPS 1..16), got {value!r}"
        )
    return nums


def fused_routing() -> bool:
    """TREEVERIFY_FUSED_ROUTING: the one-kernel expert selection on a GPU (models/fused_routing.py);
    default 1 (random:mla-moe decode at batch 1 2.34 -> 2.04 ms on the H200), 0 the PyTorch ops
    (an A/B, or an escape hatch). Read when a router is built."""
    return _switch("TREEVERIFY_FUSED_ROUTING", "1")


def cache_dir() -> Path:
    """TREEVERIFY_CACHE_DIR, or ~/.cache/treeverify. Not created here."""
    value = os.environ.get("TREEVERIFY_CACHE_DIR", "").strip()
    if value:
        return Path(value).expanduser()
    return Path.home() / ".cache" / "treeverify"


def log_level() -> int:
    """TREEVERIFY_LOG_LEVEL as a logging level; WARNING when unset. Bad values raise ValueError."""
    value = os.environ.get("TREEVERIFY_LOG_LEVEL", "").strip()
    if not value:
        return logging.WARNING
    if value.lstrip("-").isdigit():
        return int(value)
    level = logging.getLevelName(value.upper())
    if not isinstance(level, int):
        raise ValueError(
            f"TREEVERIFY_LOG_LEVEL: expected DEBUG, INFO, WARNING, ERROR, CRITICAL or a number, "
            f"got {value!r}"
        )
    return level


def cuda_home() -> Path | None:
    """CUDA_HOME as a path, or None when unset or empty."""
    value = os.environ.get("CUDA_HOME", "").strip()
    return Path(value).expanduser() if value else None


def configure_logging() -> None:
    """Give the 'treeverify' logger a stderr handler at TREEVERIFY_LOG_LEVEL (idempotent)."""
    logger = logging.getLogger("treeverify")
    logger.setLevel(log_level())
    if not logger.handlers:
        handler = logging.StreamHandler()
        fmt = logging.Formatter(
            "%(asctime)s.%(msecs)03dZ %(levelname)s %(name)s: %(message)s", "%Y-%m-%dT%H:%M:%S"
        )
        fmt.converter = time.gmtime  # UTC timestamps: comparable across machines and journald
        handler.setFormatter(fmt)
        logger.addHandler(handler)
