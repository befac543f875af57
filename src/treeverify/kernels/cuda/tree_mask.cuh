// The tree mask applied to an MMA accumulator fragment, shared by every kernel (the portable
// mma.sync kernel in tree_attention.cu and the sm_90a wgmma kernels): thread (lane g*4+tq) holds,
// for each group j of 8 columns, s[4j + e] = S[row g + 8 (e >> 1)][8 j + 2 tq + (e & 1)] (the
// m16n8k16 C layout, and wgmma's per warp). Instead of one mask-word load per column behind a
// branch, each fragment row loads the (at most three) words its 64 columns need at once and
// builds a 64-bit window of visible columns (v24 on sm_90a; the portable kernel since v25).
#pragma once

namespace treeverify {

// Visibility of columns [c, c + 64) for one tree row, bit k for column c + k: s = c - P; prefix
// columns (c + k < P) are 1, tree column P + i is bit i of the row's mask words. At most three
// words, loaded together (the per-column loads they replace were a chain of dependent L1
// round trips: a masked tile cost ~2 us more than a prefix one, twenty-first session's CTA
// trace).
__device__ __forceinline__ unsigned long long mask_window(const unsigned* words, int n_words,
                                                          int s) {
  if (s <= -64) return ~0ull;
  if (s < 0) {
    const int n = -s;  // 1..63 prefix columns first
    const unsigned w0 = words[0], w1 = n_words > 1 ? words[1] : 0u;
    return ((static_cast<unsigned long long>(w1) << 32 | w0) << n) | ((1ull << n) - 1ull);
  }
  const int b = s >> 5, sh = s & 31;
  const unsigned w0 = b < n_words ? words[b] : 0u;
  const unsigned w1 = b + 1 < n_words ? words[b + 1] : 0u;
  const unsigned w2 = b + 2 < n_words ? words[b + 2] : 0u;
  return static_cast<unsigned long long>(__funnelshift_r(w1, w2, sh)) << 32 |
         __funnelshift_r(w0, w1, sh);
}

// Hidden entries of the fragment -> -inf: keys past the split's end, rows past the tile, tree
// keys the row's node does not see. col0: the key index of column 2*tq of group 0; row0: the
// packed (node, head) row of fragment row g.
template <int NJ>
__device__ __forceinline__ void frag_mask(float (&s)[4 * NJ], const TreeAttnParams& p, int col0,
                                          int row0, int P, int kv_stop, int rows, int qo0,
                                          int G) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + 8 * h;
    const bool row_ok = row < rows;
    // the row's mask words: its node's bits over tree keys (col - P)
    const unsigned* words = p.tree_mask + (long long)(qo0 + (row_ok ? row / G : 0)) * p.mask_words;
#pragma unroll
    for (int j0 = 0; j0 < NJ; j0 += 8) {  // 64 columns a window (this thread's 16 of them)
      const int c = col0 + 8 * j0;
      const unsigned long long win = row_ok ? mask_window(words, p.mask_words, c - P) : 0ull;
      // columns past the split's end cleared too: a window of what stays visible
      const int left = kv_stop - c;  // visible columns from c on (may be <= 0 or >= 64)
      const unsigned long long keep =
          left >= 64 ? win : (left <= 0 ? 0ull : win & ((1ull << left) - 1ull));
      const unsigned lo = static_cast<unsigned>(keep), hi = static_cast<unsigned>(keep >> 32);
#pragma unroll
      for (int j = j0; j < NJ && j < j0 + 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int k = 8 * (j - j0) + e;
          if (!(((k < 32 ? lo : hi) >> (k & 31)) & 1u)) s[4 * j + 2 * h + e] = -TV_INF;
        }
      }
    }
  }
}

}  // namespace treeverify
