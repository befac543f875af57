// A round's accepted K/V rows moved to their positions (engine/kv_cache.py `move_slots`), one
// launch for every layer of a stacked cache (L, slots, row): where PyTorch takes a gather into a
// temporary and a scatter (two kernels per cache tensor, plus the index math before them).
// One CTA per (request, layer): its K pairs src[b, j] -> dst[b, j] are first all read into
// shared memory, then written, so a source that is another pair's destination (a path node at
// depth d moved to position d while its own slot is the destination of depth e > d... any order
// a walk makes) is read before it is overwritten. Pairs with src == dst (past the path's end,
// padding rows at the scratch slot) write nothing. Requests' slots are disjoint, so CTAs never
// touch the same row. Rows are moved as 16-byte vectors (row_vecs of them).

namespace treeverify {

using int64_t = long long;
static_assert(sizeof(int64_t) == 8, "fixed-width types");

// base: the cache's first byte; layer_bytes: its layer stride in bytes; src, dst (B, K) int64
// flat slot indices; dynamic shared memory: K * row_vecs * 16 bytes.
__global__ void kv_move_rows(unsigned char* __restrict__ base, long long layer_bytes,
                             int row_vecs, const int64_t* __restrict__ src,
                             const int64_t* __restrict__ dst, int K) {
  extern __shared__ uint4 stage[];  // (K, row_vecs)
  const int b = blockIdx.x;
  uint4* layer = reinterpret_cast<uint4*>(base + blockIdx.y * layer_bytes);
  const int64_t* s = src + static_cast<int64_t>(b) * K;
  const int64_t* d = dst + static_cast<int64_t>(b) * K;
  const int n = K * row_vecs;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int j = i / row_vecs, v = i - j * row_vecs;
    if (s[j] != d[j]) stage[i] = layer[s[j] * row_vecs + v];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int j = i / row_vecs, v = i - j * row_vecs;
    if (s[j] != d[j]) layer[d[j] * row_vecs + v] = stage[i];
  }
}

}  // namespace treeverify
