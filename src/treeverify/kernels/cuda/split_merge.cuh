// Merging split-KV partials into the final output, and the padding rows' zeros; included by
// tree_attention.cu before the forward kernels, which call merge_tile_if_last at their end.
//
// Two ways to merge a split row tile, chosen per tile on the device (merged_in_forward):
// - in the forward (v8), when the tile's read (n splits x tile rows x DV fp32) is at most
//   p.fused_merge_bytes: each split CTA counts itself done on a per-row-tile counter; the last
//   of the tile's n CTAs merges it and resets the counter to 0 for the next launch (graph
//   replays, the next layer). One SM reading a large tile would be slower than a merge kernel
//   spread over the GPU, hence the limit;
// - tree_attn_merge (merge_and_mask.cuh), one CTA per (token, p.merge_heads heads), for the
//   other tiles. The launcher launches it only when some tile of the plan can exceed the limit
//   (kernels/splits.py: merge_kernel_needed), so plans of short trees launch one kernel. (A
//   merge on the forward's tile grid, v13, measured 0.986x and was removed.)
#pragma once

#include "device_common.cuh"

namespace treeverify {

// Four output columns [c, c+4) of I rows at once (rows base[i] = token * hq + head, or < 0:
// none) of split requests: the LSE-weighted mean of their n splits' partials, in one pass (a
// running max rescales the sum). The loads of 8 splits x I rows are issued together: a serial
// load per split left the merge bound by L2 latency (4 us per layer for a 17-node tree on the
// H200). Loads bypass L1: other SMs wrote the partials. A split that saw no key has LSE -inf
// and partial 0: weight 0. U: splits a row's loads cover at once (I x U float4 in flight).
// Split s of row i is partial row s * stride + base[i] (+ first_off for s = 0): the split
// layout's stride is one split's rows (total_q_cap x hq); the persistent GQA kernel's CTA slots
// (gqa_pp_persist.cuh) pass their own.
// LSE: also the merged LSE of the n splits a row (log2 domain, -inf where none saw a key) in
// lse[i], for a caller that merges this result with others (the split-lane merge kernel).
template <int DV, int I, int U = 8, bool LSE = false>
__device__ __forceinline__ void merge_splits4(const TreeAttnParams& p, const long long (&base)[I],
                                              int n, const int (&c)[I], float4 (&out)[I],
                                              long long stride, long long first_off = 0,
                                              float* lse = nullptr) {
  float m[I], wsum[I];
  float4 acc[I];
#pragma unroll
  for (int i = 0; i < I; ++i) {
    m[i] = -TV_INF;
    wsum[i] = 0.f;
    acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  for (int s0 = 0; s0 < n; s0 += U) {
    float l[I][U];
    float4 v[I][U];
#pragma unroll
    for (int i = 0; i < I; ++i) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const long long row = (s0 + u) * stride + base[i] + (s0 + u == 0 ? first_off : 0);
        const bool ok = s0 + u < n && base[i] >= 0;
        l[i][u] = ok ? __ldcg(p.part_lse + row) : -TV_INF;
        v[i][u] = ok ? __ldcg(reinterpret_cast<const float4*>(p.part_o + row * DV + c[i]))
                     : make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
#pragma unroll
    for (int i = 0; i < I; ++i) {
      float mb = m[i];
#pragma unroll
      for (int u = 0; u < U; ++u) mb = fmaxf(mb, l[i][u]);
      if (mb == -TV_INF) continue;  // no split so far saw a key
      const float sc = exp2f(m[i] - mb);  // 0 while m is -inf
      float4& a = acc[i];
      a.x *= sc; a.y *= sc; a.z *= sc; a.w *= sc;
      wsum[i] *= sc;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float w = exp2f(l[i][u] - mb);
        a.x += w * v[i][u].x; a.y += w * v[i][u].y; a.z += w * v[i][u].z; a.w += w * v[i][u].w;
        wsum[i] += w;
      }
      m[i] = mb;
    }
  }
#pragma unroll
  for (int i = 0; i < I; ++i) {
    const float inv = wsum[i] > 0.f ? 1.f / wsum[i] : 0.f;
    out[i] = make_float4(acc[i].x * inv, acc[i].y * inv, acc[i].z * inv, acc[i].w * inv);
    if constexpr (LSE) lse[i] = wsum[i] > 0.f ? m[i] + log2f(wsum[i]) : -TV_INF;
  }
}

// Whether the forward merges the row tile itself: its read (n splits x tile rows x DV fp32) is
// at most p.fused_merge_bytes, twice that for a 2-split tile under p.fused_merge_ilp, whose
// merge then loads twice the rows at a time (merge_rows: the same load rounds a thread). The
// forward's split CTAs and the merge kernel (which then skips the tile) evaluate the same rule,
// so each tile is merged exactly once; kernels/splits.py: merged_in_forward mirrors it.
template <int DV>
__device__ __forceinline__ bool merged_in_forward(const TreeAttnParams& p, int n, int tile_rows) {
  const long long limit = (long long)p.fused_merge_bytes << (p.fused_merge_ilp && n <= 2 ? 1 : 0);
  return (long long)n * tile_rows * DV * 4 <= limit;
}

template <bool BF16>
__device__ __forceinline__ void store_out4(const TreeAttnParams& p, int tok, int head, int c,
                                           float4 v) {
  unsigned short* og = static_cast<unsigned short*>(p.out) + tok * p.o_stride_tok +
                       head * p.o_stride_head + c;
  uint2 packed;
  packed.x = pack2<BF16>(v.x, v.y);
  packed.y = pack2<BF16>(v.z, v.w);
  *reinterpret_cast<uint2*>(og) = packed;
}

// Packed rows [r0, r1) of (request at qo0, KV head kvh), split n ways: merged into `out` by
// the CTA's threads, four columns of I rows each at a time, U splits of each row's loads issued
// together.
template <int DV, bool BF16, int I, int U>
__device__ __forceinline__ void merge_rows_ilp(const TreeAttnParams& p, int qo0, int kvh, int r0,
                                               int r1, int n) {
  constexpr int CH = DV / 4;
  const int G = p.group, total = (r1 - r0) * CH;
  for (int idx0 = threadIdx.x; idx0 < total; idx0 += I * blockDim.x) {
    long long base[I];
    int c[I], tok[I], head[I];
#pragma unroll
    for (int i = 0; i < I; ++i) {
      const int idx = idx0 + i * blockDim.x, row = r0 + min(idx, total - 1) / CH;
      c[i] = (idx % CH) * 4;
      tok[i] = qo0 + row / G;
      head[i] = kvh * G + row % G;
      base[i] = idx < total ? (long long)tok[i] * p.hq + head[i] : -1;
    }
    float4 o[I];
    merge_splits4<DV, I, U>(p, base, n, c, o, (long long)p.total_q_cap * p.hq);
#pragma unroll
    for (int i = 0; i < I; ++i)
      if (base[i] >= 0) store_out4<BF16>(p, tok[i], head[i], c[i], o[i]);
  }
}

// The forward's merge of one tile: 2 rows x 8 splits of loads a thread (v8), of which a
// 2-split tile fills 4; with p.fused_merge_ilp (v28, TREEVERIFY_CUDA_FUSED_MERGE_ILP, default on) a tile of
// at most 2 splits takes 4 rows x 2 splits: a 128-row GQA tile (SGLang's balanced batch) in 3
// dependent L2 round trips a thread at 384 threads instead of 6. (8 x 2 and 4 x 4 spilled in
// the ping-pong kernels' 168 registers.)
// SHAPED = false (the portable mma.sync kernels) compiles the v8 shape only: their widest
// builds sit at 255 registers, where the other shapes' code spilled (sm_80, d256).
template <int DV, bool BF16, bool SHAPED = true>
__device__ __forceinline__ void merge_rows(const TreeAttnParams& p, int qo0, int kvh, int r0,
                                           int r1, int n) {
  if constexpr (SHAPED) {
    if (p.fused_merge_ilp && n <= 2) return merge_rows_ilp<DV, BF16, 4, 2>(p, qo0, kvh, r0, r1, n);
  }
  merge_rows_ilp<DV, BF16, 2, 8>(p, qo0, kvh, r0, r1, n);
}

// Called by every thread of a split CTA whose tile merges in the forward, after it wrote its
// partials: the last of the tile's n_splits CTAs to arrive merges rows [m0, min(m0 + bm, rows))
// of (request at qo0, KV head kvh). Counter: this CTA's (m-tile, request x KV head) of the grid.
template <int DV, bool BF16, bool SHAPED = true>
__device__ __forceinline__ void merge_tile_if_last(const TreeAttnParams& p, int qo0, int kvh,
                                                   int m0, int bm, int rows, int n_splits) {
  __shared__ int s_last;
  __threadfence();  // this thread's partials reach L2 before the tile's count does
  __syncthreads();
  // The tile's request x KV head, not the grid row (a later split may serve another request,
  // TREEVERIFY_CUDA_SPLIT_ORDER), recomputed by every converged warp rather than kept live in
  // a register through the kernel.
  const int bh = cta_request_head(p);
  if (threadIdx.x == 0) {
    unsigned* ctr = p.split_counters + (long long)bh * gridDim.x + blockIdx.x;
    const unsigned prev = atomicAdd(ctr, 1u);
    s_last = prev == static_cast<unsigned>(n_splits - 1);
    if (s_last) *ctr = 0u;  // every split has counted: ready for the next launch
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();  // order the partial reads after the count that said they are complete
  merge_rows<DV, BF16, SHAPED>(p, qo0, kvh, m0, m0 + min(bm, rows - m0), n_splits);
}

// Rows [total_q, out_rows) of `out` belong to no request (padded batch slots of a graph
// bucket): CTA (0, 0, 0) zeroes them before anything else, so callers need no memset.
template <int DV>
__device__ __forceinline__ void zero_padding_rows(const TreeAttnParams& p) {
  if (p.out_rows == 0 || (blockIdx.x | blockIdx.y | blockIdx.z) != 0) return;
  const int first = p.qo_indptr[p.batch];
  constexpr int CH = DV / 8;  // 16-byte chunks per head
  const int per_row = p.hq * CH;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  for (int idx = threadIdx.x; idx < (p.out_rows - first) * per_row; idx += blockDim.x) {
    const int tok = first + idx / per_row, head = (idx % per_row) / CH, c = (idx % CH) * 8;
    *reinterpret_cast<uint4*>(static_cast<unsigned short*>(p.out) + tok * p.o_stride_tok +
                              head * p.o_stride_head + c) = zero;
  }
}

}  // namespace treeverify
