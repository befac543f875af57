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
//
// With TREEVERIFY_ROUND_GLUE (engine/round_state.py) two kernels take more of a round's glue:
//   round_stage_trees (the round's start): phase 0's node slots plus the trees into the verify
//     stage: ids = the nodes' tokens, positions = ring end + depth, the mask's first w words the
//     tree's and the rest clear (a copy, an add, a fill and a copy as torch ops);
//   round_path_rows (the round's end): each accepted path node's row for the drafter's context
//     (its flat row r * n + node, its position end + d, its ring row slot * width + position %
//     width, or the scratch ring's row past the path's end), then phase 1's advance (a clamp, a
//     compare, an arange and ~6 index ops as torch ops, plus phase 1's launch).

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

// tokens, depths (B, n) int64; meta as above (row 2: each request's ring end = its prefix);
// tree_mask (B * n, w) int32; ids, pos, slots (B * n,) int64; mask (B * n, words) int32, w <=
// words.
__global__ void round_stage_trees(int n, int w, int words, int page_size, int pages,
                                  int table_batch, int64_t scratch,
                                  const int64_t* __restrict__ tokens,
                                  const int64_t* __restrict__ depths,
                                  const int64_t* __restrict__ meta, int meta_stride,
                                  const int* __restrict__ tree_mask, const int* __restrict__ prefix,
                                  const int* __restrict__ table, const int* __restrict__ valid,
                                  int64_t* __restrict__ ids, int64_t* __restrict__ pos,
                                  int64_t* __restrict__ slots, int* __restrict__ mask) {
  const int r = blockIdx.x;
  const int64_t p0 = prefix[r];
  const int64_t end = meta[2 * meta_stride + r];
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t row = static_cast<int64_t>(r) * n + i;
    ids[row] = tokens[row];
    pos[row] = depths[row] + end;
    const int64_t at = p0 + i;
    int64_t page_index = at / page_size;
    if (page_index > pages - 1) page_index = pages - 1;  // (never read: not held)
    const int64_t page = table[page_index * table_batch + r];
    slots[row] = valid[row] != 0 ? page * page_size + at % page_size : scratch;
  }
  const int64_t first = static_cast<int64_t>(r) * n;  // this request's rows, `words` a row
  for (int j = threadIdx.x; j < n * words; j += blockDim.x) {
    const int64_t row = first + j / words;
    const int c = j % words;
    mask[row * words + c] = c < w ? tree_mask[row * w + c] : 0;
  }
}

// packed (B, 2 + 2k) int64 [length, bonus, committed k, path k] (path node -1 past the end);
// rows, pos, ring (B * k,) int64; scratch_row: the scratch ring's first row (slot * width).
__global__ void round_path_rows(int k, int n, int64_t width, int64_t scratch_row, int window,
                                const int64_t* __restrict__ packed, int64_t* __restrict__ meta,
                                int meta_stride, int* __restrict__ prefix,
                                int64_t* __restrict__ rows, int64_t* __restrict__ pos,
                                int64_t* __restrict__ ring) {
  const int r = blockIdx.x;
  const int64_t* result = packed + static_cast<int64_t>(r) * (2 + 2 * k);
  const int64_t end = meta[2 * meta_stride + r];
  const int64_t slot = meta[3 * meta_stride + r];
  for (int d = threadIdx.x; d < k; d += blockDim.x) {
    const int64_t node = result[2 + k + d];
    const int64_t out = static_cast<int64_t>(r) * k + d;
    const int64_t at = end + d;
    rows[out] = static_cast<int64_t>(r) * n + (node > 0 ? node : 0);
    pos[out] = at;
    ring[out] = node >= 0 ? slot * width + at % width : scratch_row;
  }
  __syncthreads();  // every thread read this request's end before thread 0 advances it
  if (threadIdx.x != 0 || meta[r] <= 0) return;  // padding requests keep their inputs
  const int64_t m = result[0];
  const int64_t read = meta[r] + m;
  meta[r] = read < window ? read : window;
  meta[meta_stride + r] = result[1];
  meta[2 * meta_stride + r] = end + m;
  prefix[r] += static_cast<int>(m);
}

}  // namespace treeverify
