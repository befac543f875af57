// DDTree's draft table (spec/tree.py `draft_topk`) for small k, one CTA per (request, depth) row:
// fp32 log-softmax over the vocabulary and its k largest entries, sorted descending, clamped to
// [floor, 0]. One launch instead of log_softmax + torch.topk (whose radix select took 49 us of a
// 0.65 ms round on the H200 for 15 rows of 8192 and k = 16). The k winners are found in k rounds
// (rank: larger value first, then smaller index); each round the block reduces every thread's
// best entry ranked after the previous winner.
//   * V <= threads * kTopkPer (tiny-code's 8192): each thread holds its strided entries in
//     registers and the k winners are selected by rank, with no rounds (select_by_rank): the
//     k-th best of the threads' own maxima bounds the k winners from below (those k maxima are
//     k distinct entries at or above it), so only entries at or above it are candidates (at
//     most k x kTopkPer, typically ~k); each candidate's rank among them is its output slot.
//     (Before: k rounds, each a block reduction plus the winner's owner rescanning its 32
//     registers, ~12 us for 15 rows, k = 16, in the round profile; before that each round
//     re-read the row from L1/L2: 44 us.)
//   * larger vocabularies, or a row holding a NaN (no order to select by): every thread rescans
//     its entries from memory each round (the row stays in L1/L2 across the rounds; k is bounded
//     by the caller: the scans are k x V / threads).

namespace treeverify {

using int64_t = long long;
static_assert(sizeof(int64_t) == 8, "fixed-width types");

constexpr int kTopkThreads = 256;
constexpr int kTopkWarps = kTopkThreads / 32;
constexpr int kTopkPer = 32;  // entries per thread held in registers (V <= 8192)
constexpr int kTopkMaxK = 32;  // spec/topk_cuda.py MAX_K
constexpr int kTopkCands = kTopkMaxK * kTopkPer;  // select_by_rank's candidate bound

// Does (va, ia) rank before (vb, ib)?
__device__ __forceinline__ bool ranks_before(float va, int ia, float vb, int ib) {
  return va > vb || (va == vb && ia < ib);
}

__device__ __forceinline__ float block_max(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  v = red[0];
  for (int w = 1; w < kTopkWarps; ++w) v = fmaxf(v, red[w]);
  __syncthreads();
  return v;
}

__device__ __forceinline__ float block_sum(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  v = 0.0f;
  for (int w = 0; w < kTopkWarps; ++w) v += red[w];
  __syncthreads();
  return v;
}

// The block's best (value, index) pair; every thread gets it.
__device__ __forceinline__ void block_best(float& bv, int& bi, float* win_v, int* win_i) {
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (ranks_before(ov, oi, bv, bi)) {
      bv = ov;
      bi = oi;
    }
  }
  if ((threadIdx.x & 31) == 0) {
    win_v[threadIdx.x >> 5] = bv;
    win_i[threadIdx.x >> 5] = bi;
  }
  __syncthreads();
  bv = win_v[0];
  bi = win_i[0];
  for (int w = 1; w < kTopkWarps; ++w) {
    if (ranks_before(win_v[w], win_i[w], bv, bi)) {
      bv = win_v[w];
      bi = win_i[w];
    }
  }
  __syncthreads();
}

// The k best of the row held in `vals` (entry threadIdx.x + j * kTopkThreads), written sorted to
// lp / ids (this row's k slots). False, with nothing written, where the row holds a NaN; every
// thread returns the same (the decisions read shared memory after a barrier).
__device__ bool select_by_rank(const float (&vals)[kTopkPer], int V, int k, float m, float logz,
                               float floor_lp, float* __restrict__ lp, int64_t* __restrict__ ids) {
  __shared__ float max_v[kTopkThreads];
  __shared__ int max_i[kTopkThreads];
  __shared__ float cand_v[kTopkCands];
  __shared__ int cand_i[kTopkCands];
  __shared__ float thr_v;
  __shared__ int thr_i, n_cand;
  const float inf = __int_as_float(0x7f800000);
  float bv = -inf;  // this thread's best entry; none: ranks after every real entry
  int bi = V + threadIdx.x;
  int nan = 0;
#pragma unroll
  for (int j = 0; j < kTopkPer; ++j) {
    const int i = threadIdx.x + j * kTopkThreads;
    if (i < V) {
      nan |= vals[j] != vals[j];
      if (ranks_before(vals[j], i, bv, bi)) {
        bv = vals[j];
        bi = i;
      }
    }
  }
  max_v[threadIdx.x] = bv;
  max_i[threadIdx.x] = bi;
  if (threadIdx.x == 0) {
    thr_i = -1;
    n_cand = 0;
  }
  if (__syncthreads_or(nan)) return false;
  int rank = 0;  // among the threads' maxima: a strict total order, so ranks 0..255 once each
  for (int t = 0; t < kTopkThreads; ++t) rank += ranks_before(max_v[t], max_i[t], bv, bi);
  if (rank == k - 1) {
    thr_v = bv;
    thr_i = bi;
  }
  __syncthreads();
  const float tv = thr_v;
  const int ti = thr_i;
#pragma unroll
  for (int j = 0; j < kTopkPer; ++j) {
    const int i = threadIdx.x + j * kTopkThreads;
    if (i < V && !ranks_before(tv, ti, vals[j], i)) {  // at or above the threshold
      const int slot = atomicAdd(&n_cand, 1);
      if (slot < kTopkCands) {
        cand_v[slot] = vals[j];
        cand_i[slot] = i;
      }
    }
  }
  __syncthreads();
  const int c = min(n_cand, kTopkCands);  // >= k; bounded by k x kTopkPer (see the header)
  for (int a = threadIdx.x; a < c; a += kTopkThreads) {
    const float av = cand_v[a];
    const int ai = cand_i[a];
    int r = 0;
    for (int b = 0; b < c; ++b) r += ranks_before(cand_v[b], cand_i[b], av, ai);
    if (r < k) {
      lp[r] = fminf(fmaxf((av - m) - logz, floor_lp), 0.0f);
      ids[r] = ai;
    }
  }
  return true;
}

// logits (R, V) fp32 rows; lp (R, k) fp32, ids (R, k) int64.
__global__ void ddtree_topk(const float* __restrict__ logits, int V, int k, float floor_lp,
                            float* __restrict__ lp, int64_t* __restrict__ ids) {
  __shared__ float red[kTopkWarps];
  __shared__ float win_v[kTopkWarps];
  __shared__ int win_i[kTopkWarps];
  const int64_t row = blockIdx.x;
  const float* x = logits + row * V;
  const float inf = __int_as_float(0x7f800000);

  if (V <= kTopkThreads * kTopkPer && k <= kTopkMaxK) {  // registers: selected by rank
    float vals[kTopkPer];
    float m = -inf;
#pragma unroll
    for (int j = 0; j < kTopkPer; ++j) {
      const int i = threadIdx.x + j * kTopkThreads;
      vals[j] = i < V ? x[i] : -inf;
      m = fmaxf(m, vals[j]);
    }
    m = block_max(m, red);
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < kTopkPer; ++j) s += expf(vals[j] - m);  // padding: exp(-inf) = 0
    const float logz = logf(block_sum(s, red));
    if (select_by_rank(vals, V, k, m, logz, floor_lp, lp + row * k, ids + row * k)) return;
  }

  float m = -inf;
  for (int i = threadIdx.x; i < V; i += blockDim.x) m = fmaxf(m, x[i]);
  m = block_max(m, red);
  float s = 0.0f;
  for (int i = threadIdx.x; i < V; i += blockDim.x) s += expf(x[i] - m);
  const float logz = logf(block_sum(s, red));

  float pv = inf;  // the previous winner: every entry ranks after it at first
  int pi = -1;
  for (int r = 0; r < k; ++r) {
    float bv = -inf;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
      const float v = x[i];
      if (ranks_before(pv, pi, v, i) && ranks_before(v, i, bv, bi)) {
        bv = v;
        bi = i;
      }
    }
    block_best(bv, bi, win_v, win_i);
    pv = bv;
    pi = bi;
    if (threadIdx.x == 0) {
      const float v = (bv - m) - logz;
      lp[row * k + r] = fminf(fmaxf(v, floor_lp), 0.0f);
      ids[row * k + r] = bi;
    }
  }
}

}  // namespace treeverify
