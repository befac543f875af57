// DDTree's draft table (spec/tree.py `draft_topk`) for small k, one CTA per (request, depth) row:
// fp32 log-softmax over the vocabulary and its k largest entries, sorted descending, clamped to
// [floor, 0]. One launch instead of log_softmax + torch.topk (whose radix select took 49 us of a
// 0.65 ms round on the H200 for 15 rows of 8192 and k = 16). Rank: larger value first, then the
// smaller index (a strict total order on a row's entries when none is NaN).
//
// Selection by threshold (`ddtree_topk`, since the fifty-first session): every thread's best
// entry; T = the k-th best of those 256 (each warp's 32 sorted by shuffles, then binary
// searches in the other warps' lists: `threshold`); the row's top k all rank at or before T
// (the k thread bests at or before T are k distinct entries), so the entries at or before T,
// usually a few more than k, are gathered in shared memory and each one's place among them is
// counted. Every row takes three passes from memory (max with each thread's best, sum of
// exponentials, the gathering; the second and third hit L1/L2), each thread reading 4-entry
// pieces, several in flight. k block-wide rounds (each rescanning the row) are the fallback,
// taken by a whole row that holds a NaN (no order) or whose entries at or before T overflow
// shared memory (kCandCap: impossible for V <= 8192 and k <= 32, where a thread reads at most
// 32 entries, so at most k x 32 gather).
// Measured (15 rows, H100, scripts/tree_kernels_gpu.py): the k rounds rescanned 128256 entries
// once a round, one load in flight a thread: 1648 us at k = 16, 53 us by threshold. Up to 8192
// entries the rows were held in registers until the fifty-second session (one read, then the
// threshold, or the k rounds at k <= 12): the passes from memory beat them at every k (8192
// entries: k = 1 6.94 against 6.96 us, 4: 7.10 / 9.84, 8: 7.22 / 13.67, 12: 7.33 / 17.53, 16:
// 7.41 / 10.54, 32: 7.63 / 10.80; 512 entries at k = 16: 5.46 / 6.94), with half the code.
// The logits come as fp32 or as bf16 bits (`In` = unsigned short: the drafter's lm_head output
// as it is, each entry widened exactly; pieces of 4 entries for both, so the same entries meet
// the same sums in the same order: the table equals the fp32 upcast's bit for bit, as long as
// both rows are aligned to a piece, as every tensor torch allocates is).

namespace treeverify {

using int64_t = long long;
static_assert(sizeof(int64_t) == 8, "fixed-width types");

constexpr int kTopkThreads = 256;
constexpr int kTopkWarps = kTopkThreads / 32;
constexpr int kTopkPer = 32;  // ddtree_topk_warp: entries a thread holds in registers
constexpr int kCandCap = 1024;  // gathered entries at or before T (k x 32 for k <= 32)
constexpr int kPieceUnroll = 4;  // 4-entry pieces in flight per thread in a memory pass

// Entry i of a row: fp32 as is, bf16 bits widened (exact).
__device__ __forceinline__ float logit_at(const float* __restrict__ x, int i) { return x[i]; }
__device__ __forceinline__ float logit_at(const unsigned short* __restrict__ x, int i) {
  return __uint_as_float(static_cast<unsigned>(x[i]) << 16);
}

// Four entries 4c .. 4c + 3 of a row (16 bytes of fp32, 8 of bf16), widened to fp32.
__device__ __forceinline__ void piece_at(const float* __restrict__ x, int c, float (&e)[4]) {
  const float4 f = reinterpret_cast<const float4*>(x)[c];
  e[0] = f.x;
  e[1] = f.y;
  e[2] = f.z;
  e[3] = f.w;
}
__device__ __forceinline__ void piece_at(const unsigned short* __restrict__ x, int c,
                                         float (&e)[4]) {
  const uint2 u = reinterpret_cast<const uint2*>(x)[c];  // entry 4c: u.x's low half
  e[0] = __uint_as_float(u.x << 16);
  e[1] = __uint_as_float(u.x & 0xffff0000u);
  e[2] = __uint_as_float(u.y << 16);
  e[3] = __uint_as_float(u.y & 0xffff0000u);
}

// f(value, index) for every entry of this thread's share of a row of V, in a fixed order: 4-entry
// pieces c = threadIdx.x, + 256, ... (kPieceUnroll in flight) when V is a multiple of 4 and the
// row is aligned to a piece, else single entries i = threadIdx.x, + 256, ... (8 in flight).
template <typename In, typename F>
__device__ __forceinline__ void for_each_entry(const In* __restrict__ x, int V, F f) {
  const bool pieces = (V & 3) == 0 &&
                      (reinterpret_cast<unsigned long long>(x) & (4 * sizeof(In) - 1)) == 0;
  if (pieces) {
    const int C = V >> 2;
    for (int c0 = threadIdx.x; c0 < C; c0 += kTopkThreads * kPieceUnroll) {
      float e[kPieceUnroll][4];
#pragma unroll
      for (int u = 0; u < kPieceUnroll; ++u) {
        const int c = c0 + u * kTopkThreads;
        if (c < C) piece_at(x, c, e[u]);
      }
#pragma unroll
      for (int u = 0; u < kPieceUnroll; ++u) {
        const int c = c0 + u * kTopkThreads;
        if (c < C) {
#pragma unroll
          for (int q = 0; q < 4; ++q) f(e[u][q], 4 * c + q);
        }
      }
    }
    return;
  }
  constexpr int kUnroll = 8;
  for (int i0 = threadIdx.x; i0 < V; i0 += kTopkThreads * kUnroll) {
    float e[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = i0 + u * kTopkThreads;
      e[u] = i < V ? logit_at(x, i) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = i0 + u * kTopkThreads;
      if (i < V) f(e[u], i);
    }
  }
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

// The same table by warps first, each row held in registers (an A/B variant,
// TREEVERIFY_DDTREE_WARP_TOPK; V <= kTopkThreads x kTopkPer, k <= kTopkMaxK): each warp takes
// its own 1024 entries' k best in k shuffle-only rounds (no barrier), then warp 0 takes the k
// best of the warps' k x 8 candidates the same way (refuted against block-wide rounds in the
// forty-eighth session; ddtree_topk is faster still). The same table: every
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

// ddtree_topk's shared memory: the reductions' slots, every thread's best entry, the gathering.
struct TopkShared {
  float red[kTopkWarps];
  float win_v[kTopkWarps];
  int win_i[kTopkWarps];
  float best_v[kTopkThreads];
  int best_i[kTopkThreads];
  float cand_v[kCandCap];
  int cand_i[kCandCap];
  float t_v;
  int t_i;
  int count;
};

// T = (tv, ti): the k-th best of the threads' best entries (bv, bi); a thread without entries
// holds (-inf, INT_MAX), which ranks after every entry of the row. Where fewer than k threads
// hold entries (a row of under 4k entries read in 4-entry pieces: k == V = 16 takes 4 threads,
// all in warp 0) T is that padding: the one at place k - 1 of warp 0's list counts k - 1 before
// it (none in other warps), so the search always sets T; every entry is then gathered. Each
// warp sorts its 32 bests (bitonic, shuffles only) into shared memory; a best at place p < k
// of its warp's list then finds its place among all 256 as p plus a binary search in each
// other list (one best at place >= k of its own list cannot be the k-th).
// Counting every best against all 256 took ~4 us a row (11.5 us at k = 1, against 2.9 for the
// rounds). Also empties the gathering. Two barriers.
__device__ __forceinline__ void threshold(float bv, int bi, int k, TopkShared& sh, float& tv,
                                          int& ti) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int size = 2; size <= 32; size <<= 1) {  // best first in each warp
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, stride);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, stride);
      const bool lower = (lane & stride) == 0;
      const bool best_first = (lane & size) == 0 || size == 32;  // this run's direction
      const bool other_before = ranks_before(ov, oi, bv, bi);
      const bool mine_before = ranks_before(bv, bi, ov, oi);
      if (lower == best_first ? other_before : mine_before) {  // the pair's order flips
        bv = ov;
        bi = oi;
      }
    }
  }
  sh.best_v[threadIdx.x] = bv;  // warp w's list: best_v[32 w ..], best first
  sh.best_i[threadIdx.x] = bi;
  if (threadIdx.x == 0) sh.count = 0;
  __syncthreads();
  if (lane < k) {
    int r = lane;  // the entries before it in its own list
    for (int w = 0; w < kTopkWarps; ++w) {
      if (w == warp) continue;
      int lo = 0, hi = 32;  // the list's prefix ranked before (bv, bi)
      while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (ranks_before(sh.best_v[32 * w + mid], sh.best_i[32 * w + mid], bv, bi)) {
          lo = mid + 1;
        } else {
          hi = mid;
        }
      }
      r += lo;
    }
    if (r == k - 1) {
      sh.t_v = bv;
      sh.t_i = bi;
    }
  }
  __syncthreads();
  tv = sh.t_v;
  ti = sh.t_i;
}

// Entry (v, i) into the gathering when it ranks at or before T.
__device__ __forceinline__ void gather(float v, int i, float tv, int ti, TopkShared& sh) {
  if (i == ti || ranks_before(v, i, tv, ti)) {
    const int at = atomicAdd(&sh.count, 1);
    if (at < kCandCap) {
      sh.cand_v[at] = v;
      sh.cand_i[at] = i;
    }
  }
}

// After the gathering's barrier: each gathered entry's place among them (a strict total order:
// distinct indices, no NaN), the first k written as the table's row. False, with nothing
// written, when the gathering overflowed kCandCap (block-uniform: the count is shared).
__device__ __forceinline__ bool place(int k, float m, float logz, float floor_lp,
                                      float* __restrict__ lp, int64_t* __restrict__ ids,
                                      int64_t row, const TopkShared& sh) {
  const int n = sh.count;
  if (n < k || n > kCandCap) return false;
  for (int c = threadIdx.x; c < n; c += kTopkThreads) {
    const float v = sh.cand_v[c];
    const int i = sh.cand_i[c];
    int r = 0;
    for (int j = 0; j < n; ++j) r += ranks_before(sh.cand_v[j], sh.cand_i[j], v, i);
    if (r < k) {
      lp[row * k + r] = fminf(fmaxf((v - m) - logz, floor_lp), 0.0f);
      ids[row * k + r] = i;
    }
  }
  return true;
}

// logits (R, V) fp32 or bf16 rows; lp (R, k) fp32, ids (R, k) int64.
template <typename In>
__global__ void ddtree_topk(const In* __restrict__ logits, int V, int k, float floor_lp,
                            float* __restrict__ lp, int64_t* __restrict__ ids) {
  __shared__ TopkShared sh;
  const int64_t row = blockIdx.x;
  const In* x = logits + row * V;
  const float inf = __int_as_float(0x7f800000);

  // Max (with each thread's best and whether a NaN is there), then the sum of exponentials,
  // then the gathering: three passes in one order (for_each_entry).
  float m = -inf, bv = -inf;
  int bi = 0x7fffffff;
  bool nan = false;
  for_each_entry(x, V, [&](float v, int i) {
    m = fmaxf(m, v);
    nan |= v != v;
    if (ranks_before(v, i, bv, bi)) {
      bv = v;
      bi = i;
    }
  });
  m = block_max(m, sh.red);
  float s = 0.0f;
  for_each_entry(x, V, [&](float v, int) { s += expf(v - m); });
  const float logz = logf(block_sum(s, sh.red));
  if (!__syncthreads_or(nan)) {
    float tv;
    int ti;
    threshold(bv, bi, k, sh, tv, ti);
    for_each_entry(x, V, [&](float v, int i) { gather(v, i, tv, ti, sh); });
    __syncthreads();
    if (place(k, m, logz, floor_lp, lp, ids, row, sh)) return;
  }
  // The fallback: k block-wide rounds, each rescanning the row (from L1/L2).
  float pv = inf;  // the previous winner: every entry ranks after it at first
  int pi = -1;
  for (int r = 0; r < k; ++r) {
    float wv = -inf;
    int wi = 0x7fffffff;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
      const float v = logit_at(x, i);
      if (ranks_before(pv, pi, v, i) && ranks_before(v, i, wv, wi)) {
        wv = v;
        wi = i;
      }
    }
    block_best(wv, wi, sh.win_v, sh.win_i);
    pv = wv;
    pi = wi;
    if (threadIdx.x == 0) {
      const float v = (wv - m) - logz;
      lp[row * k + r] = fminf(fmaxf(v, floor_lp), 0.0f);
      ids[row * k + r] = wi;
    }
  }
}

}  // namespace treeverify
