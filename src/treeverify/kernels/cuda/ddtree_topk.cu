// DDTree's draft table (spec/tree.py `draft_topk`) for small k, one CTA per (request, depth) row:
// fp32 log-softmax over the vocabulary and its k largest entries, sorted descending, clamped to
// [floor, 0]. One launch instead of log_softmax + torch.topk (whose radix select took 49 us of a
// 0.65 ms round on the H200 for 15 rows of 8192 and k = 16). The k winners are found in k rounds
// (rank: larger value first, then smaller index); each round the block reduces every thread's
// best entry ranked after the previous winner.
//   * V <= threads * kTopkPer (tiny-code's 8192): each thread holds its strided entries in
//     registers, and after a round only the winner's owner looks for its next best (the others'
//     candidates still rank after the winner): a round is a block reduction plus one register
//     scan. (The loop below re-read the row from L1/L2 every round: 44 us for 15 rows of 8192,
//     k = 16, ~7% of a whole round.)
//   * larger vocabularies: every thread rescans its entries from memory each round (the row
//     stays in L1/L2 across the rounds; k is bounded by the caller: the scans are k x V / threads).
// The logits come as fp32 or as bf16 bits (`In` = unsigned short: the drafter's lm_head output
// as it is, each entry widened exactly, so the table equals the fp32 upcast's; the upcast was a
// copy kernel of its own and twice the bytes read here).

namespace treeverify {

using int64_t = long long;
static_assert(sizeof(int64_t) == 8, "fixed-width types");

constexpr int kTopkThreads = 256;
constexpr int kTopkWarps = kTopkThreads / 32;
constexpr int kTopkPer = 32;  // entries per thread held in registers (V <= 8192)

// Entry i of a row: fp32 as is, bf16 bits widened (exact).
__device__ __forceinline__ float logit_at(const float* __restrict__ x, int i) { return x[i]; }
__device__ __forceinline__ float logit_at(const unsigned short* __restrict__ x, int i) {
  return __uint_as_float(static_cast<unsigned>(x[i]) << 16);
}

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

// The warp's best (value, index) pair by shuffles alone; every lane gets it.
__device__ __forceinline__ void warp_best(float& bv, int& bi) {
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (ranks_before(ov, oi, bv, bi)) {
      bv = ov;
      bi = oi;
    }
  }
}

// The block's best (value, index) pair; every thread gets it.
__device__ __forceinline__ void block_best(float& bv, int& bi, float* win_v, int* win_i) {
  warp_best(bv, bi);
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

// A row of V <= kTopkThreads x kTopkPer logits into the threads' registers (strided; -inf past
// V), with its max m and log-sum-exp logz (a log-softmax entry is (v - m) - logz).
template <typename In>
__device__ __forceinline__ void row_in_registers(const In* __restrict__ x, int V, float* red,
                                                 float (&vals)[kTopkPer], float& m,
                                                 float& logz) {
  const float inf = __int_as_float(0x7f800000);
  m = -inf;
#pragma unroll
  for (int j = 0; j < kTopkPer; ++j) {
    const int i = threadIdx.x + j * kTopkThreads;
    vals[j] = i < V ? logit_at(x, i) : -inf;
    m = fmaxf(m, vals[j]);
  }
  m = block_max(m, red);
  float s = 0.0f;
#pragma unroll
  for (int j = 0; j < kTopkPer; ++j) s += expf(vals[j] - m);  // padding: exp(-inf) = 0
  logz = logf(block_sum(s, red));
}

// k rounds over each lane's n entries (vals[j], index idx(j), -inf / INT_MAX past the row):
// round r's winner is the best entry ranked after round r - 1's, found by one warp reduction;
// only the winner's lane rescans its registers. Lane 0 hands each winner to `out(r, v, i)`.
template <int N, typename Index, typename Out>
__device__ __forceinline__ void warp_rounds(const float (&vals)[N], Index idx, int k, Out out) {
  const float inf = __int_as_float(0x7f800000);
  float pv = inf;  // the previous winner: every entry ranks after it at first
  int pi = -1;
  float cv = -inf;
  int ci = 0x7fffffff;
  bool mine = true;
  for (int r = 0; r < k; ++r) {
    if (mine) {
      cv = -inf;
      ci = 0x7fffffff;
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const int i = idx(j);
        if (ranks_before(pv, pi, vals[j], i) && ranks_before(vals[j], i, cv, ci)) {
          cv = vals[j];
          ci = i;
        }
      }
    }
    float bv = cv;
    int bi = ci;
    warp_best(bv, bi);
    mine = bi == ci;
    pv = bv;
    pi = bi;
    if ((threadIdx.x & 31) == 0) out(r, bv, bi);
  }
}

// ddtree_topk's register path by warps first (TREEVERIFY_DDTREE_WARP_TOPK; V <= kTopkThreads x
// kTopkPer, k <= kTopkMaxK): each warp takes its own 1024 entries' k best in k shuffle-only
// rounds (no barrier), then warp 0 takes the k best of the warps' k x 8 candidates the same
// way. The block-wide rounds above cost two barriers each: ~12.6 us for 15 rows of 8192, k = 16,
// on the H200 (61224e3's kernel lists), the tree build's larger half. The same table: every
// entry of the row's top k is among its warp's top k, and ranks (value, then the smaller id)
// are total, so the two stages pick what the block-wide rounds pick.
constexpr int kTopkMaxK = 32;  // spec/topk_cuda.py MAX_K (the launcher checks 1 <= k <= it, V)

template <typename In>
__global__ void ddtree_topk_warp(const In* __restrict__ logits, int V, int k, float floor_lp,
                                 float* __restrict__ lp, int64_t* __restrict__ ids) {
  __shared__ float red[kTopkWarps];
  __shared__ float cand_v[kTopkWarps * kTopkMaxK];
  __shared__ int cand_i[kTopkWarps * kTopkMaxK];
  const int64_t row = blockIdx.x;
  const In* x = logits + row * V;
  const float inf = __int_as_float(0x7f800000);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  float vals[kTopkPer], m, logz;
  row_in_registers(x, V, red, vals, m, logz);

  // Stage 1: the warp's k best (entries past the row are -inf at index INT_MAX: last).
  const int base = threadIdx.x;
  warp_rounds(
      vals, [&](int j) { const int i = base + j * kTopkThreads; return i < V ? i : 0x7fffffff; },
      k, [&](int r, float v, int i) {
        cand_v[warp * kTopkMaxK + r] = v;
        cand_i[warp * kTopkMaxK + r] = i;
      });
  __syncthreads();
  if (warp != 0) return;
  // Stage 2: warp 0 over the kTopkWarps x k candidates, lane-strided.
  constexpr int kCand = kTopkWarps * kTopkMaxK / 32;
  float cand_vals[kCand];
  int cand_ids[kCand];
#pragma unroll
  for (int j = 0; j < kCand; ++j) {
    const int e = lane + 32 * j;  // candidate e: warp e / k's round e % k
    const bool real = e < kTopkWarps * k;
    cand_vals[j] = real ? cand_v[(e / k) * kTopkMaxK + e % k] : -inf;
    cand_ids[j] = real ? cand_i[(e / k) * kTopkMaxK + e % k] : 0x7fffffff;
  }
  warp_rounds(
      cand_vals, [&](int j) { return cand_ids[j]; }, k, [&](int r, float v, int i) {
        lp[row * k + r] = fminf(fmaxf((v - m) - logz, floor_lp), 0.0f);
        ids[row * k + r] = i;
      });
}

// logits (R, V) fp32 or bf16 rows; lp (R, k) fp32, ids (R, k) int64.
template <typename In>
__global__ void ddtree_topk(const In* __restrict__ logits, int V, int k, float floor_lp,
                            float* __restrict__ lp, int64_t* __restrict__ ids) {
  __shared__ float red[kTopkWarps];
  __shared__ float win_v[kTopkWarps];
  __shared__ int win_i[kTopkWarps];
  const int64_t row = blockIdx.x;
  const In* x = logits + row * V;
  const float inf = __int_as_float(0x7f800000);

  if (V <= kTopkThreads * kTopkPer) {  // registers: a round is a reduction + one scan
    float vals[kTopkPer], m, logz;
    row_in_registers(x, V, red, vals, m, logz);
    float pv = inf;  // the previous winner: every entry ranks after it at first
    int pi = -1;
    float cv = -inf;  // this thread's best entry ranked after the previous winner
    int ci = 0x7fffffff;
    bool mine = true;  // whether this thread's candidate was the winner (or none yet)
    for (int r = 0; r < k; ++r) {
      if (mine) {
        cv = -inf;
        ci = 0x7fffffff;
#pragma unroll
        for (int j = 0; j < kTopkPer; ++j) {
          const int i = threadIdx.x + j * kTopkThreads;
          if (i < V && ranks_before(pv, pi, vals[j], i) && ranks_before(vals[j], i, cv, ci)) {
            cv = vals[j];
            ci = i;
          }
        }
      }
      float bv = cv;
      int bi = ci;
      block_best(bv, bi, win_v, win_i);
      mine = bi == ci;
      pv = bv;
      pi = bi;
      if (threadIdx.x == 0) {
        lp[row * k + r] = fminf(fmaxf((bv - m) - logz, floor_lp), 0.0f);
        ids[row * k + r] = bi;
      }
    }
    return;
  }

  float m = -inf;
  for (int i = threadIdx.x; i < V; i += blockDim.x) m = fmaxf(m, logit_at(x, i));
  m = block_max(m, red);
  float s = 0.0f;
  for (int i = threadIdx.x; i < V; i += blockDim.x) s += expf(logit_at(x, i) - m);
  const float logz = logf(block_sum(s, red));

  float pv = inf;  // the previous winner: every entry ranks after it at first
  int pi = -1;
  for (int r = 0; r < k; ++r) {
    float bv = -inf;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
      const float v = logit_at(x, i);
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
