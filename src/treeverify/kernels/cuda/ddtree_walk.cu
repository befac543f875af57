// The greedy acceptance walk (DDTree step 6) of a verified draft tree, one CTA per request: one
// launch for what spec/accept.py's vectorized `walk_tree` does in ~25 small kernels (matching,
// lowest-index children, pointer jumping, depths, the path scatter). Same result exactly:
//   * node c (c >= 1, parent p >= 0) matches when tokens[c] == posterior[p];
//   * from the root, the walk moves to the lowest-index matching child of the current node while
//     one exists and the depth is below max_depth;
//   * path[k] = the node at depth k (root first), -1 past the end; length = nodes on the path
//     (root included); last = its deepest node; bonus = posterior[last].
// The lowest matching child of every node is found in parallel (atomicMin in shared memory),
// then thread 0 follows the chain (at most max_depth steps). `ddtree_walk_pack` also packs the
// round's result and the K/V move's indices (engine/speculative.py, TREEVERIFY_FUSED_ACCEPT).

namespace treeverify {

using int64_t = long long;
static_assert(sizeof(int64_t) == 8, "fixed-width types");

constexpr int kWalkMaxNodes = 1025;  // the verify kernels' largest tree

// The walk of request b's tree, by the whole CTA: `first` (T ints of shared memory) gets each
// node's lowest matching child; thread 0 then follows the chain into path[0..depth] (the caller
// has set the rest to -1) and returns the depth (other threads return -1).
__device__ __forceinline__ int walk_tree(const int64_t* tok, const int64_t* par,
                                         const int64_t* post, int T, int max_depth, int* first,
                                         int64_t* path) {
  for (int i = threadIdx.x; i < T; i += blockDim.x) first[i] = T;
  __syncthreads();
  for (int c = 1 + threadIdx.x; c < T; c += blockDim.x) {
    const int64_t p = par[c];
    if (p >= 0 && p < T && tok[c] == post[p]) atomicMin(&first[p], c);
  }
  __syncthreads();
  if (threadIdx.x != 0) return -1;
  int cur = 0, depth = 0;
  path[0] = 0;
  while (depth < max_depth && first[cur] < T) {
    cur = first[cur];
    path[++depth] = cur;
  }
  return depth;
}

// tokens, parents, posterior (B, T) int64; outputs path (B, max_depth + 1), length, bonus,
// last (B,) int64.
__global__ void ddtree_greedy_walk(const int64_t* __restrict__ tokens,
                                   const int64_t* __restrict__ parents,
                                   const int64_t* __restrict__ posterior, int T, int max_depth,
                                   int64_t* __restrict__ path, int64_t* __restrict__ length,
                                   int64_t* __restrict__ bonus, int64_t* __restrict__ last) {
  __shared__ int first[kWalkMaxNodes];  // lowest matching child per node, T if none
  const int b = blockIdx.x;
  const int64_t* post = posterior + static_cast<int64_t>(b) * T;
  int64_t* out = path + static_cast<int64_t>(b) * (max_depth + 1);
  for (int k = threadIdx.x; k <= max_depth; k += blockDim.x) out[k] = -1;
  const int depth = walk_tree(tokens + static_cast<int64_t>(b) * T,
                              parents + static_cast<int64_t>(b) * T, post, T, max_depth, first,
                              out);
  if (threadIdx.x != 0) return;
  const int cur = static_cast<int>(out[depth]);
  length[b] = depth + 1;
  last[b] = cur;
  bonus[b] = post[cur];
}

// The walk and what engine/speculative.py `_move_and_pack` makes of it, in one launch (a round's
// ~10 small kernels: the path's clamp and mask, two gathers, a select, the cat):
//   packed (B, 2 + 2K) int64: [length, bonus, committed K, path K], committed[d] the token of
//     node max(path[d], 0) (the root's past the path's end), path[d] -1 past it;
//   dst (B, K) = slots[:, :K]; src (B, K) = slots of path[d] for d < length, else dst (no-op);
//   length, bonus (B,) also on their own (contiguous, for the next round's state).
// K <= min(max_depth + 1, T). slots (B, T) int64: each node's KV slot.
__global__ void ddtree_walk_pack(const int64_t* __restrict__ tokens,
                                 const int64_t* __restrict__ parents,
                                 const int64_t* __restrict__ posterior,
                                 const int64_t* __restrict__ slots, int T, int max_depth, int K,
                                 int64_t* __restrict__ packed, int64_t* __restrict__ src,
                                 int64_t* __restrict__ dst, int64_t* __restrict__ length_out,
                                 int64_t* __restrict__ bonus_out) {
  __shared__ int first[kWalkMaxNodes];
  __shared__ int64_t path[kWalkMaxNodes];
  __shared__ int length;
  const int b = blockIdx.x;
  const int64_t* tok = tokens + static_cast<int64_t>(b) * T;
  const int64_t* post = posterior + static_cast<int64_t>(b) * T;
  const int64_t* slot = slots + static_cast<int64_t>(b) * T;
  // The walk writes depths <= min(max_depth, T - 1) = K - 1, and only path[0..K) is read: a
  // max_depth past the shared array (<= kWalkMaxNodes entries) never indexes it.
  for (int k = threadIdx.x; k < K; k += blockDim.x) path[k] = -1;
  __syncthreads();
  const int depth = walk_tree(tok, parents + static_cast<int64_t>(b) * T, post, T,
                              max_depth < K - 1 ? max_depth : K - 1, first, path);
  int64_t* row = packed + static_cast<int64_t>(b) * (2 + 2 * K);
  if (threadIdx.x == 0) {
    length = depth + 1;
    row[0] = length_out[b] = depth + 1;
    row[1] = bonus_out[b] = post[path[depth]];
  }
  __syncthreads();
  for (int d = threadIdx.x; d < K; d += blockDim.x) {
    const int64_t p = path[d];  // -1 past the end
    const int64_t node = p < 0 ? 0 : p;
    row[2 + d] = tok[node];
    row[2 + K + d] = p;
    dst[static_cast<int64_t>(b) * K + d] = slot[d];
    src[static_cast<int64_t>(b) * K + d] = d < length ? slot[node] : slot[d];
  }
}

}  // namespace treeverify
