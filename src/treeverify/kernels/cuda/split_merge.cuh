// Merging split-KV partials into the final output, and the padding rows' zeros; included by
// tree_attention.cu before the forward kernels, which call merge_tile_if_last at their end.
//
// Two ways to merge (the launcher picks per plan, kernels/splits.py: merge_in_forward):
// - in the forward (v8): each split CTA counts itself done on a per-row-tile counter; the last
//   of the tile's n_splits CTAs merges the tile and resets the counter to 0 for the next launch
//   (graph replays and the next layer), so no merge kernel is launched. Chosen when the last
//   CTA's read (n_splits x tile rows x DV fp32) is small: one SM reading a large tile would be
//   slower than a merge kernel spread over the GPU;
// - tree_attn_merge (merge_and_mask.cuh), one CTA per (token, head), otherwise.
#pragma once

#include "device_common.cuh"

namespace treeverify {

// Four output columns [c, c+4) of row `base` (= token * hq + head) of a split request: the
// LSE-weighted mean of its n splits' partials. Loads bypass L1: other SMs wrote the partials.
template <int DV>
__device__ __forceinline__ float4 merge_splits4(const TreeAttnParams& p, long long base, int n,
                                                int c) {
  const long long stride = (long long)p.total_q_cap * p.hq;  // one split's rows
  float lmax = -TV_INF;
  for (int s = 0; s < n; ++s) lmax = fmaxf(lmax, __ldcg(p.part_lse + s * stride + base));
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float wsum = 0.f;
  for (int s = 0; s < n; ++s) {
    const float lse = __ldcg(p.part_lse + s * stride + base);
    if (lse == -TV_INF) continue;  // a split that saw no visible key
    const float w = exp2f(lse - lmax);
    const float4 v = __ldcg(reinterpret_cast<const float4*>(p.part_o + (s * stride + base) * DV + c));
    acc.x += w * v.x; acc.y += w * v.y; acc.z += w * v.z; acc.w += w * v.w;
    wsum += w;
  }
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  return make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
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

// Called by every thread of a split CTA (n_splits > 1) after it wrote its partials: the last
// of the row tile's n_splits CTAs to arrive merges rows [m0, min(m0 + bm, rows)) of (request at
// qo0, KV head kvh). Counter slot: this CTA's (m-tile, request x KV head) in the launch grid.
template <int DV, bool BF16>
__device__ __forceinline__ void merge_tile_if_last(const TreeAttnParams& p, int qo0, int kvh,
                                                   int m0, int bm, int rows, int n_splits) {
  __shared__ int s_last;
  __threadfence();  // this thread's partials reach L2 before the tile's count does
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned* ctr = p.split_counters + (long long)blockIdx.z * gridDim.x + blockIdx.x;
    const unsigned prev = atomicAdd(ctr, 1u);
    s_last = prev == static_cast<unsigned>(n_splits - 1);
    if (s_last) *ctr = 0u;  // every split has counted: ready for the next launch
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();  // order the partial reads after the count that said they are complete
  constexpr int CH = DV / 4;
  const int tile_rows = min(bm, rows - m0), G = p.group;
  for (int idx = threadIdx.x; idx < tile_rows * CH; idx += blockDim.x) {
    const int row = m0 + idx / CH, c = (idx % CH) * 4;
    const int tok = qo0 + row / G, head = kvh * G + row % G;
    store_out4<BF16>(p, tok, head, c, merge_splits4<DV>(p, (long long)tok * p.hq + head, n_splits, c));
  }
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
