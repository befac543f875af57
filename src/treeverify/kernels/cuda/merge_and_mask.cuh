// The split-KV merge kernel and SGLang's byte-mask converter; included by tree_attention.cu.
#pragma once

#include "split_merge.cuh"

namespace treeverify {

// The merge kernels' token lookup: its request b (the last with qo_indptr[b] <= tok), that
// request's tree size and split count.
__device__ __forceinline__ void merge_token_request(const TreeAttnParams& p, int tok, int& b,
                                                    int& T_b, int& n) {
  int lo = 0, hi = p.batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (p.qo_indptr[mid] <= tok) lo = mid; else hi = mid - 1;
  }
  b = lo;
  T_b = p.qo_indptr[b + 1] - p.qo_indptr[b];
  n = num_splits(p, request_kv(p, b).prefix + T_b, batch_kv_sum(p));
}

// Merge the split partials of every row whose request was split and whose row tile the
// forward did not merge itself: one CTA per (token, p.merge_heads heads), DV/4 threads, four
// columns each. Several heads a CTA (v12) keep the grid small: a CTA of a request that was not
// split only finds that out and exits, which cost ~1 us a CTA, so a plan whose requests rarely
// split (2048 tokens x 128 heads: 262k CTAs, ~250 us) paid that on every step.
// HI x U: the loads a thread has in flight, HI heads of U splits each (v22,
// TREEVERIFY_CUDA_MERGE_ILP; 1 x 8 before): with one head at a time the CTA's heads are a chain
// of dependent L2 round trips (8 heads, 2 splits: ~20 us for SGLang's GQA batch, by
// scripts/sim_verify_schedule.py's gap), and a 64-split MLA row takes 8 of them.
// W: head lanes a CTA (v28, TREEVERIFY_CUDA_MERGE_WIDE): W groups of DV/4 threads take the
// CTA's heads in turns (head h0 + lane, + W, ...), so W of its heads' L2 round trips are in
// flight at once from W warps rather than one after another in one (the CTA count, and so the
// request lookups, stay those of merge_heads).
template <int DV, bool BF16, int HI = 1, int U = 8, int W = 1>
__global__ void __launch_bounds__(DV / 4 * W) tree_attn_merge(const __grid_constant__ TreeAttnParams p) {
  constexpr int LANES = DV / 4;  // threads a head: four columns each
  const int col = static_cast<int>(threadIdx.x) % LANES, head_lane = threadIdx.x / LANES;
  const int tok = blockIdx.x;
  const int total_q = p.qo_indptr[p.batch];
  int b, T_b, n;
  merge_token_request(p, tok, b, T_b, n);
  // Programmatic launch: every CTA, even one with nothing to merge, waits for the forward to
  // finish, so that this kernel's completion still means the forward's (stream order for the
  // kernels after it); the request lookup above overlaps the forward.
  pdl_wait();
  if (tok >= total_q || n == 1) return;  // padding, or the main kernel wrote the output
  const int G = p.group, node = tok - p.qo_indptr[b];
  const int h0 = blockIdx.y * p.merge_heads, h1 = min(p.hq, h0 + p.merge_heads);
  if constexpr (HI == 1 && U == 8) {  // v12's loop, kept as measured (the default)
    const int c[1] = {col * 4};
    for (int head = h0 + head_lane; head < h1; head += W) {
      const int row = node * G + head % G;  // packed row of KV head head / G
      const int tile0 = row / p.fwd_bm * p.fwd_bm;
      if (merged_in_forward<DV>(p, n, min(p.fwd_bm, T_b * G - tile0))) continue;
      const long long base[1] = {(long long)tok * p.hq + head};
      float4 o[1];
      merge_splits4<DV, 1>(p, base, n, c, o, (long long)p.total_q_cap * p.hq);
      store_out4<BF16>(p, tok, head, c[0], o[0]);
    }
    return;
  }
  for (int hb = h0 + head_lane * HI; hb < h1; hb += HI * W) {
    long long base[HI];  // token * hq + head, or -1: past the CTA's heads, or merged already
    int c[HI];
#pragma unroll
    for (int i = 0; i < HI; ++i) {
      const int head = hb + i;
      const int row = node * G + head % G;  // packed row of KV head head / G
      const int tile0 = row / p.fwd_bm * p.fwd_bm;
      const bool mine = head < h1 && !merged_in_forward<DV>(p, n, min(p.fwd_bm, T_b * G - tile0));
      base[i] = mine ? (long long)tok * p.hq + head : -1;
      c[i] = col * 4;
    }
    float4 o[HI];
    merge_splits4<DV, HI, U>(p, base, n, c, o, (long long)p.total_q_cap * p.hq);
#pragma unroll
    for (int i = 0; i < HI; ++i)
      if (base[i] >= 0) store_out4<BF16>(p, tok, hb + i, c[i], o[i]);
  }
}

// Split lanes (v30, TREEVERIFY_CUDA_MERGE_SPLIT_LANES): the merge of plans that split a row
// more than 8 ways. S groups of DV/4 threads take one head's splits in turns (split s to group
// s % S), each merging its share (8 splits of loads in flight a thread), then group 0 merges
// the S results through shared memory: a 64-split MLA row takes 2 dependent L2 round trips a
// thread instead of 8, with S times the loads in flight. Its own kernel for its own launch
// bounds (S x DV/4 threads, one CTA an SM's worth of registers).
template <int DV, bool BF16, int S>
__global__ void __launch_bounds__(DV / 4 * S, 1)
    tree_attn_merge_split_lanes(const __grid_constant__ TreeAttnParams p) {
  constexpr int LANES = DV / 4, U = 8;
  const int col = static_cast<int>(threadIdx.x) % LANES;
  const int group_s = threadIdx.x / LANES;  // this group takes splits group_s, + S, ...
  const int tok = blockIdx.x;
  const int total_q = p.qo_indptr[p.batch];
  int b, T_b, n;
  merge_token_request(p, tok, b, T_b, n);
  pdl_wait();  // as tree_attn_merge
  if (tok >= total_q || n == 1) return;
  const int G = p.group, node = tok - p.qo_indptr[b];
  const int h0 = blockIdx.y * p.merge_heads, h1 = min(p.hq, h0 + p.merge_heads);
  __shared__ float4 sO[S][LANES];  // each group's merged share of a head's splits
  __shared__ float sL[S][LANES];   // and its LSE (the same across a group's columns)
  const long long stride = (long long)p.total_q_cap * p.hq;
  const int c[1] = {col * 4};
  const int mine = (n - group_s + S - 1) / S;  // splits group_s, group_s + S, ... (may be 0)
  for (int head = h0; head < h1; ++head) {  // uniform over the CTA: barriers below
    const int row = node * G + head % G;
    const int tile0 = row / p.fwd_bm * p.fwd_bm;
    if (merged_in_forward<DV>(p, n, min(p.fwd_bm, T_b * G - tile0))) continue;
    const long long base[1] = {(long long)tok * p.hq + head + group_s * stride};
    float4 o[1];
    float l[1];
    merge_splits4<DV, 1, U, true>(p, base, mine, c, o, stride * S, 0, l);
    sO[group_s][col] = o[0];
    sL[group_s][col] = l[0];
    __syncthreads();
    if (group_s == 0) {
      float mx = -TV_INF;
#pragma unroll
      for (int g = 0; g < S; ++g) mx = fmaxf(mx, sL[g][col]);
      float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
      float ws = 0.f;
      if (mx != -TV_INF) {
#pragma unroll
        for (int g = 0; g < S; ++g) {
          const float w = exp2f(sL[g][col] - mx);  // 0 for a group whose splits saw no key
          const float4 v = sO[g][col];
          a.x += w * v.x; a.y += w * v.y; a.z += w * v.z; a.w += w * v.w;
          ws += w;
        }
      }
      const float inv = ws > 0.f ? 1.f / ws : 0.f;
      const float4 merged = make_float4(a.x * inv, a.y * inv, a.z * inv, a.w * inv);
      store_out4<BF16>(p, tok, head, c[0], merged);
    }
    __syncthreads();  // the next head reuses sO / sL
  }
}

#ifdef TV_SGLANG_MASK_KERNEL  // compiled only into its own module
// SGLang's custom mask (bytes, per request row-major [N, prefix+N]; the prefix columns are all
// visible in target verify, so only the last N are read) -> our packed tree mask
// (total_q, mask_words).
__global__ void sglang_mask_to_bits(const unsigned char* __restrict__ custom_mask,
                                    const long long* __restrict__ mask_indptr,
                                    const int* __restrict__ qo_indptr,
                                    const int* __restrict__ kv_indptr, unsigned* __restrict__ bits,
                                    int batch, int mask_words, int total_q_cap) {
  const int tok = blockIdx.x;
  if (tok >= total_q_cap) return;
  const int total_q = qo_indptr[batch];
  if (tok >= total_q) {
    for (int w = threadIdx.x; w < mask_words; w += blockDim.x) bits[(long long)tok * mask_words + w] = 0u;
    return;
  }
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (qo_indptr[mid] <= tok) lo = mid; else hi = mid - 1;
  }
  const int b = lo, i = tok - qo_indptr[b];
  const int N = qo_indptr[b + 1] - qo_indptr[b];
  const int P = kv_indptr[b + 1] - kv_indptr[b];
  const int row_len = P + N;  // the layout keeps prefix columns even when they are skipped
  const unsigned char* row = custom_mask + mask_indptr[b] + (long long)i * row_len + (row_len - N);
  for (int w = threadIdx.x; w < mask_words; w += blockDim.x) {
    unsigned word = 0u;
    for (int j = w * 32; j < min(N, w * 32 + 32); ++j) word |= (row[j] ? 1u : 0u) << (j & 31);
    bits[(long long)tok * mask_words + w] = word;
  }
}
#endif  // TV_SGLANG_MASK_KERNEL

}  // namespace treeverify
