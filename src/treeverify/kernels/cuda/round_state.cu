// A whole speculative round's own state (engine/round_graphs.py), in one launch per phase
// instead of ~12 small torch kernels each (~2 us apiece inside a captured round):
//   phase 0 (the round's start): each node's KV slot, node i of request r at position
//     prefix[r] + i, from the staged page table (pages-major, table[page * table_batch + r]);
//     rows of padding requests (valid == 0) take the scratch slot;
//   phase 1 (the round's end): the next round's inputs, for requests with context rows
//     (meta rows read > 0): rows read += m (at most `window`), root = bonus, ring end += m,
//     prefix += m, where m = the accepted length (root included).
// Grid: one CTA per request. Same results as the torch ops in round_graphs.py exactly (integer
// arithmetic; tests/test_round_graphs_gpu.py compares them).

namespace treeverify {

using int64_t = long long;
static_assert(sizeof(int64_t) == 8, "fixed-width types");

// meta (4, meta_stride) int64: rows read, roots, ends, ring slots; length, bonus (B,) int64;
// prefix (B,) int32; table (pages, table_batch) int32; valid (B * n,) int32; slots (B * n,)
// int64.
__global__ void whole_round_state(int phase, int n, int page_size, int pages, int table_batch,
                                  int window, int64_t scratch, int64_t* __restrict__ meta,
                                  int meta_stride, const int64_t* __restrict__ length,
                                  const int64_t* __restrict__ bonus, int* __restrict__ prefix,
                                  const int* __restrict__ table, const int* __restrict__ valid,
                                  int64_t* __restrict__ slots) {
  const int r = blockIdx.x;
  if (phase == 0) {
    const int64_t p0 = prefix[r];
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const int64_t row = static_cast<int64_t>(r) * n + i;
      const int64_t pos = p0 + i;
      int64_t page_index = pos / page_size;
      if (page_index > pages - 1) page_index = pages - 1;  // (never read: not held)
      const int64_t page = table[page_index * table_batch + r];
      slots[row] = valid[row] != 0 ? page * page_size + pos % page_size : scratch;
    }
    return;
  }
  if (threadIdx.x != 0 || meta[r] <= 0) return;  // padding requests keep their inputs
  const int64_t m = length[r];
  const int64_t rows = meta[r] + m;
  meta[r] = rows < window ? rows : window;
  meta[meta_stride + r] = bonus[r];
  meta[2 * meta_stride + r] += m;
  prefix[r] += static_cast<int>(m);
}

}  // namespace treeverify
