// DDTree draft-tree construction (Algorithm 1) as the literal best-first heap, one CTA per
// request, on the device: one launch replaces the batched beam search's ~40 small kernels per
// depth (spec/tree.py). Node for node equal to spec/tree_oracle.py (the host heap):
//   * keys are (logw desc, ranks tuple asc); ranks tuples are unique, so the pop order is the
//     same for any correct priority queue;
//   * each logw is computed with the oracle's fp32 operations, correctly rounded, no FMA and no
//     flush-to-zero (compiled without --use_fast_math; __fadd_rn/__fsub_rn are never fused):
//       sibling: fl(fl(logw - lp[d-1][r]) + lp[d-1][r+1]),  first child: fl(logw + lp[d][0]);
//   * a ranks tuple is never stored: a candidate is (parent node, rank, depth), and two tuples
//     compare by climbing the popped nodes' parent links to their first difference (O(depth),
//     only on exactly equal logw, which the n-gram drafter's flat distributions produce often).
// Thread 0 runs the heap in shared memory. Its loop touches no global memory: the block first
// copies the (L, K) log-prob table into shared memory (where it fits, kHeapStage floats; larger
// tables are read in place), and the popped nodes' tokens, parents, depths and scores are
// written by every thread after the loop. Measured on the H200 (scripts/tree_kernels_gpu.py,
// 2026-12-04): the kernel's time grows with the budget at ~0.7-1.3 us a pop (11-14 us at budget
// 16, 33 at 32, 71 at 64, 362 at 256), with or without this staging (which was predicted to
// remove most of it): the pops themselves are the cost. One warp finding each pop by an argmax
// over a slot pool instead (3ae0993, TREEVERIFY_DDTREE_HEAP=warp) measured the same per pop
// (16.6 / 34.2 / 67.7 / 346 us) and was taken off main.
// With a mask buffer, every thread then writes the ancestor-or-self bits of its nodes by climbing
// the popped nodes' parent links (parents precede children in pop order), the same bits as
// spec/mask.py's `parents_to_tree_mask` (padding nodes: their own bit only), so a round needs no
// separate mask compile (its ~15 pointer-jumping kernels).

namespace treeverify {

// NVRTC has no <cstdint> without a host toolchain: the fixed-width types it would give.
using int16_t = short;
using int64_t = long long;
using uint32_t = unsigned int;
static_assert(sizeof(int16_t) == 2 && sizeof(int64_t) == 8, "fixed-width types");

constexpr int kHeapMaxBudget = 1024;  // the verify kernels' largest tree is 1025 nodes
constexpr int kHeapStage = 4096;  // table entries staged in shared memory (depth 16 x k 256)

struct HeapEntry {
  float logw;
  int16_t parent;  // popped node index (0 = the root)
  int16_t rank;    // r: this node is the r-th most likely token at its depth
  int16_t depth;   // 1-based
};

struct HeapTree {  // the popped nodes, index = pop order (0 = the root)
  float logw[kHeapMaxBudget + 1];
  int16_t parent[kHeapMaxBudget + 1];
  int16_t rank[kHeapMaxBudget + 1];
  int16_t depth[kHeapMaxBudget + 1];
};

// Is candidate a's ranks tuple lexicographically smaller than b's (a prefix is smaller)?
__device__ __forceinline__ bool ranks_less(const HeapTree& t, HeapEntry a, HeapEntry b) {
  int pa = a.parent, pb = b.parent, ra = a.rank, rb = b.rank, da = a.depth, db = b.depth;
  while (da > db) { ra = t.rank[pa]; pa = t.parent[pa]; --da; }
  while (db > da) { rb = t.rank[pb]; pb = t.parent[pb]; --db; }
  while (pa != pb) {  // equal depths: climb until both hang under the same node
    ra = t.rank[pa]; pa = t.parent[pa];
    rb = t.rank[pb]; pb = t.parent[pb];
  }
  if (ra != rb) return ra < rb;
  return a.depth < b.depth;  // one is a prefix of the other
}

// The heap's order: larger logw first, then the smaller ranks tuple.
__device__ __forceinline__ bool pops_before(const HeapTree& t, HeapEntry a, HeapEntry b) {
  if (a.logw != b.logw) return a.logw > b.logw;
  return ranks_less(t, a, b);
}

__device__ __forceinline__ void heap_push(HeapEntry* heap, int& size, const HeapTree& t,
                                          HeapEntry e) {
  int i = size++;
  while (i > 0) {
    int up = (i - 1) >> 1;
    if (!pops_before(t, e, heap[up])) break;
    heap[i] = heap[up];
    i = up;
  }
  heap[i] = e;
}

__device__ __forceinline__ HeapEntry heap_pop(HeapEntry* heap, int& size, const HeapTree& t) {
  HeapEntry top = heap[0];
  HeapEntry last = heap[--size];
  int i = 0;
  while (true) {
    int c = 2 * i + 1;
    if (c >= size) break;
    if (c + 1 < size && pops_before(t, heap[c + 1], heap[c])) ++c;
    if (!pops_before(t, heap[c], last)) break;
    heap[i] = heap[c];
    i = c;
  }
  if (size > 0) heap[i] = last;
  return top;
}

// Thread 0's heap over the table `tab` (L, K): fills tree nodes 1..n (n = popped, returned).
__device__ int heap_build(const float* tab, int L, int K, int budget, HeapEntry* heap,
                          HeapTree& tree) {
  tree.parent[0] = -1;
  tree.rank[0] = 0;
  tree.depth[0] = 0;
  tree.logw[0] = 0.0f;
  int size = 0;
  heap_push(heap, size, tree, HeapEntry{tab[0], 0, 0, 1});  // the seed: lp[0][0] exactly
  int n = 0;
  while (size > 0 && n < budget) {
    HeapEntry e = heap_pop(heap, size, tree);
    ++n;
    tree.parent[n] = e.parent;
    tree.rank[n] = e.rank;
    tree.depth[n] = e.depth;
    tree.logw[n] = e.logw;
    const float* row = tab + (e.depth - 1) * K;
    if (e.rank + 1 < K) {
      float sib = __fadd_rn(__fsub_rn(e.logw, row[e.rank]), row[e.rank + 1]);
      heap_push(heap, size, tree,
                HeapEntry{sib, e.parent, static_cast<int16_t>(e.rank + 1), e.depth});
    }
    if (e.depth < L) {
      float child = __fadd_rn(e.logw, tab[e.depth * K]);
      heap_push(heap, size, tree,
                HeapEntry{child, static_cast<int16_t>(n), 0, static_cast<int16_t>(e.depth + 1)});
    }
  }
  return n;
}

// The same pops by the whole warp for budget <= kWarpMaxBudget (TREEVERIFY_DDTREE_WARP_HEAP):
// before pop n the frontier holds at most n candidates (each pop takes one and pushes at most
// two; nothing is pushed after the last pop), so one candidate a lane fits. A pop is the warp's
// maximum of an order-preserving integer key of logw (__reduce_max_sync, sm_80+); lanes tied on
// logw (flat n-gram distributions) are settled by `ranks_less`, each tied lane against every
// other, so the winner is the heap's. Pops are ~10x fewer dependent steps than the shared-
// memory heap's sift-down and sift-up (measured there: ~0.7-1.3 us a pop).
constexpr int kWarpMaxBudget = 32;

// logw's order as unsigned keys: larger logw, larger key; -0 and +0 one key; every finite or
// infinite logw above 0 (the empty lane's key).
__device__ __forceinline__ unsigned order_key(float f) {
  const unsigned u = __float_as_uint(f == 0.0f ? 0.0f : f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ int warp_build(const float* tab, int L, int K, int budget, HeapTree& tree) {
  const int lane = threadIdx.x & 31;
  if (lane == 0) {
    tree.parent[0] = -1;
    tree.rank[0] = 0;
    tree.depth[0] = 0;
    tree.logw[0] = 0.0f;
  }
  bool valid = lane == 0;  // this lane's candidate: the seed at first, lp[0][0] exactly
  HeapEntry mine{valid ? tab[0] : 0.0f, 0, 0, 1};
  int n = 0;
  __syncwarp();
  while (n < budget) {
    const unsigned key = valid ? order_key(mine.logw) : 0u;
    const unsigned top = __reduce_max_sync(0xffffffffu, key);
    if (top == 0u) break;  // the frontier is empty
    const unsigned tied = __ballot_sync(0xffffffffu, valid && key == top);
    int w = __ffs(tied) - 1;
    if (__popc(tied) > 1) {  // equal logw: the smallest ranks tuple pops first, found by a
      // butterfly minimum (ranks_less is a strict total order on the distinct tuples, so every
      // lane ends with the same one: 5 rounds however many tie, n-gram drafts tie often)
      bool have = (tied >> lane) & 1u;
      HeapEntry best = mine;
      int best_lane = lane;
      for (int o = 16; o > 0; o >>= 1) {
        const HeapEntry other{__shfl_xor_sync(0xffffffffu, best.logw, o),
                              static_cast<int16_t>(__shfl_xor_sync(0xffffffffu, best.parent, o)),
                              static_cast<int16_t>(__shfl_xor_sync(0xffffffffu, best.rank, o)),
                              static_cast<int16_t>(__shfl_xor_sync(0xffffffffu, best.depth, o))};
        const int other_lane = __shfl_xor_sync(0xffffffffu, best_lane, o);
        const bool other_has = __shfl_xor_sync(0xffffffffu, have, o);
        if (other_has && (!have || ranks_less(tree, other, best))) {
          best = other;
          best_lane = other_lane;
          have = true;
        }
      }
      w = best_lane;
    }
    const HeapEntry e{__shfl_sync(0xffffffffu, mine.logw, w),
                      static_cast<int16_t>(__shfl_sync(0xffffffffu, mine.parent, w)),
                      static_cast<int16_t>(__shfl_sync(0xffffffffu, mine.rank, w)),
                      static_cast<int16_t>(__shfl_sync(0xffffffffu, mine.depth, w))};
    ++n;
    if (lane == 0) {
      tree.parent[n] = e.parent;
      tree.rank[n] = e.rank;
      tree.depth[n] = e.depth;
      tree.logw[n] = e.logw;
    }
    __syncwarp();  // ranks_less reads the popped nodes
    if (n == budget) break;  // the heap's last pushes are never popped
    const float* row = tab + (e.depth - 1) * K;
    if (lane == w) {  // the popped lane takes the sibling, or empties
      valid = e.rank + 1 < K;
      if (valid) {
        mine = HeapEntry{__fadd_rn(__fsub_rn(e.logw, row[e.rank]), row[e.rank + 1]), e.parent,
                         static_cast<int16_t>(e.rank + 1), e.depth};
      }
    }
    if (e.depth < L) {  // the first child to the lowest empty lane (one exists: see above)
      const int f = __ffs(__ballot_sync(0xffffffffu, !valid)) - 1;
      if (lane == f) {
        valid = true;
        mine = HeapEntry{__fadd_rn(e.logw, tab[e.depth * K]), static_cast<int16_t>(n), 0,
                         static_cast<int16_t>(e.depth + 1)};
      }
    }
  }
  return n;
}

// lp (B, L, K) fp32 sorted descending per (b, depth), ids (B, L, K) int64, roots (B,) int64.
// Outputs (B, budget + 1): tokens, parents (-1 root/padding), depths, scores (-inf padding);
// num_nodes (B,) = 1 + popped nodes; mask (B * (budget + 1), words) ancestor-or-self bits when
// not null (words >= ceil((budget + 1) / 32)).
__global__ void ddtree_heap_build(const float* __restrict__ lp, const int64_t* __restrict__ ids,
                                  const int64_t* __restrict__ roots, int L, int K, int budget,
                                  int64_t* __restrict__ tokens, int64_t* __restrict__ parents,
                                  int64_t* __restrict__ depths, float* __restrict__ scores,
                                  int64_t* __restrict__ num_nodes, uint32_t* __restrict__ mask,
                                  int words, int warp_pops) {
  __shared__ HeapEntry heap[kHeapMaxBudget + 2];
  __shared__ HeapTree tree;
  __shared__ float staged[kHeapStage];
  __shared__ int popped;
  const int b = blockIdx.x;
  const int slots = budget + 1;
  const float* tab = lp + static_cast<int64_t>(b) * L * K;  // (L, K)
  const int64_t* idt = ids + static_cast<int64_t>(b) * L * K;
  int64_t* tok = tokens + static_cast<int64_t>(b) * slots;
  int64_t* par = parents + static_cast<int64_t>(b) * slots;
  int64_t* dep = depths + static_cast<int64_t>(b) * slots;
  float* sc = scores + static_cast<int64_t>(b) * slots;

  const bool stage = L * K <= kHeapStage;  // the copy is exact: the same floats the loop reads
  if (stage) {
    for (int i = threadIdx.x; i < L * K; i += blockDim.x) staged[i] = tab[i];
  }
  __syncthreads();
  if (warp_pops && budget <= kWarpMaxBudget) {  // the first warp, all its lanes
    if (threadIdx.x < 32) {
      const int got = warp_build(stage ? staged : tab, L, K, budget, tree);
      if (threadIdx.x == 0) popped = got;
    }
  } else if (threadIdx.x == 0) {
    popped = heap_build(stage ? staged : tab, L, K, budget, heap, tree);
  }
  __syncthreads();
  const int n = popped;
  for (int i = threadIdx.x; i < slots; i += blockDim.x) {  // nodes 0..n, then padding
    if (i == 0) {
      tok[0] = roots[b];
      par[0] = -1;
      dep[0] = 0;
      sc[0] = 0.0f;
    } else if (i <= n) {
      tok[i] = idt[(tree.depth[i] - 1) * K + tree.rank[i]];
      par[i] = tree.parent[i];
      dep[i] = tree.depth[i];
      sc[i] = tree.logw[i];
    } else {
      tok[i] = 0;
      par[i] = -1;
      dep[i] = 0;
      sc[i] = -__int_as_float(0x7f800000);
    }
  }
  if (threadIdx.x == 0) num_nodes[b] = n + 1;
  if (mask == nullptr) return;
  for (int i = threadIdx.x; i < slots; i += blockDim.x) {  // this thread's rows only
    uint32_t* row = mask + (static_cast<int64_t>(b) * slots + i) * words;
    for (int w = 0; w < words; ++w) row[w] = 0u;
    if (i > n) {  // padding: itself only
      row[i >> 5] |= 1u << (i & 31);
      continue;
    }
    for (int a = i; a >= 0; a = tree.parent[a]) row[a >> 5] |= 1u << (a & 31);
  }
}


}  // namespace treeverify
