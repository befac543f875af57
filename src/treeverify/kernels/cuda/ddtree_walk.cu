// The greedy acceptance walk (DDTree step 6) of a verified draft tree, one CTA per request: one
// launch for what spec/accept.py's vectorized `walk_tree` does in ~25 small kernels (matching,
// lowest-index children, pointer jumping, depths, the path scatter). Same result exactly:
//   * node c (c >= 1, parent p >= 0) matches when tokens[c] == posterior[p];
//   * from the root, the walk moves to the lowest-index matching child of the current node while
//     one exists and the depth is below max_depth;
//   * path[k] = the node at depth k (root first), -1 past the end; length = nodes on the path
//     (root included); last = its deepest node; bonus = posterior[last].
// The lowest matching child of every node is found in parallel (atomicMin in shared memory),
// then thread 0 follows the chain (at most max_depth steps).

namespace treeverify {

using int64_t = long long;
static_assert(sizeof(int64_t) == 8, "fixed-width types");

constexpr int kWalkMaxNodes = 1025;  // the verify kernels' largest tree

// tokens, parents, posterior (B, T) int64; outputs path (B, max_depth + 1), length, bonus,
// last (B,) int64.
__global__ void ddtree_greedy_walk(const int64_t* __restrict__ tokens,
                                   const int64_t* __restrict__ parents,
                                   const int64_t* __restrict__ posterior, int T, int max_depth,
                                   int64_t* __restrict__ path, int64_t* __restrict__ length,
                                   int64_t* __restrict__ bonus, int64_t* __restrict__ last) {
  __shared__ int first[kWalkMaxNodes];  // lowest matching child per node, T if none
  const int b = blockIdx.x;
  const int64_t* tok = tokens + static_cast<int64_t>(b) * T;
  const int64_t* par = parents + static_cast<int64_t>(b) * T;
  const int64_t* post = posterior + static_cast<int64_t>(b) * T;
  int64_t* out = path + static_cast<int64_t>(b) * (max_depth + 1);

  for (int i = threadIdx.x; i < T; i += blockDim.x) first[i] = T;
  for (int k = threadIdx.x; k <= max_depth; k += blockDim.x) out[k] = -1;
  __syncthreads();
  for (int c = 1 + threadIdx.x; c < T; c += blockDim.x) {
    const int64_t p = par[c];
    if (p >= 0 && p < T && tok[c] == post[p]) atomicMin(&first[p], c);
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  int cur = 0, depth = 0;
  out[0] = 0;
  while (depth < max_depth && first[cur] < T) {
    cur = first[cur];
    out[++depth] = cur;
  }
  length[b] = depth + 1;
  last[b] = cur;
  bonus[b] = post[cur];
}

}  // namespace treeverify
