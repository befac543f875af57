// DDTree's draft table (spec/tree.py `draft_topk`) for small k, one CTA per (request, depth) row:
// fp32 log-softmax over the vocabulary and its k largest entries, sorted descending, clamped to
// [floor, 0]. One launch instead of log_softmax + torch.topk (whose radix select took 49 us of a
// 0.65 ms round on the H200 for 15 rows of 8192 and k = 16). The k winners are found in k rounds:
// each round every thread scans its strided entries for the best one ranked after the previous
// winner (rank: larger value first, then smaller index), and the block reduces them. The row
// stays in L1/L2 across the rounds; k is bounded by the caller (the scans are k x V / threads).

namespace treeverify {

using int64_t = long long;
static_assert(sizeof(int64_t) == 8, "fixed-width types");

constexpr int kTopkThreads = 256;
constexpr int kTopkWarps = kTopkThreads / 32;

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

// logits (R, V) fp32 rows; lp (R, k) fp32, ids (R, k) int64.
__global__ void ddtree_topk(const float* __restrict__ logits, int V, int k, float floor_lp,
                            float* __restrict__ lp, int64_t* __restrict__ ids) {
  __shared__ float red[kTopkWarps];
  __shared__ float win_v[kTopkWarps];
  __shared__ int win_i[kTopkWarps];
  const int64_t row = blockIdx.x;
  const float* x = logits + row * V;
  const float inf = __int_as_float(0x7f800000);

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
