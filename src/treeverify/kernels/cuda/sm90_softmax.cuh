// The online softmax on a warpgroup's S fragment, shared by the sm_90a GQA and MLA kernels.
// Fragment layout (wgmma m64nNk16 accumulator): thread (warp wi, lane g*4+tq) holds, for each
// group j of 8 columns, s[4j + e] = S[16 wi + g + 8 (e >> 1)][8 j + 2 tq + (e & 1)].
//
// Written for few instructions per tile (v9): both kernels issue-bound, not tensor-bound (ncu,
// 2026-12-01: 1.6 IPC with the tensor pipe at 29%), so
// - scores stay raw until exp2: the row maximum of raw scores times the (positive) scale is the
//   scaled maximum, and p = 2^(s * scale - m) is one FFMA + EX2 (scale > 0 is checked on the host);
// - the mask is applied only on tiles that reach the tree or the split's end (one branch per
//   tile, not per element);
// - O is rescaled only when some row of the warp raised its maximum (alpha == 1 exactly otherwise,
//   so skipping the multiply changes nothing): after the first tiles of a long context, rarely.

namespace treeverify {

// Per-thread maxima of fragment rows g and g + 8 over this thread's raw scores, then over the
// quad of threads sharing the rows.
template <int NJ>
__device__ __forceinline__ void frag_row_max(const float (&s)[4 * NJ], float (&mx)[2]) {
  mx[0] = mx[1] = -TV_INF;
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    mx[0] = fmaxf(mx[0], fmaxf(s[4 * j + 0], s[4 * j + 1]));
    mx[1] = fmaxf(mx[1], fmaxf(s[4 * j + 2], s[4 * j + 3]));
  }
  mx[0] = quad_max(mx[0]);
  mx[1] = quad_max(mx[1]);
}

// The running maxima (log2 units, scaled) take this tile's raw maxima: m_use is what exp2
// subtracts (0 for a row with nothing visible yet, so -inf - -inf never happens), alpha the
// factor O and l carry over.
__device__ __forceinline__ void online_max(float (&m_run)[2], const float (&mx_raw)[2],
                                           float scale, float (&m_use)[2], float (&alpha)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float m_new = fmaxf(m_run[h], mx_raw[h] * scale);
    m_use[h] = m_new == -TV_INF ? 0.f : m_new;
    alpha[h] = exp2f(m_run[h] - m_use[h]);
    m_run[h] = m_new;
  }
}

// s <- 2^(s * scale - m_use) in place; rs: this thread's row sums.
template <int NJ>
__device__ __forceinline__ void frag_exp2(float (&s)[4 * NJ], const float (&m_use)[2],
                                          float scale, float (&rs)[2]) {
  rs[0] = rs[1] = 0.f;
#pragma unroll
  for (int i = 0; i < 4 * NJ; ++i) {
    s[i] = exp2f(fmaf(s[i], scale, -m_use[(i >> 1) & 1]));
    rs[(i >> 1) & 1] += s[i];
  }
}

// One tile's online softmax on S in place (S -> unnormalised P) for the GQA kernels: the mask
// where the tile reaches the tree or the split's end (keys from t0, BN = 8 NJ of them; row0:
// this thread's fragment row g), the running maxima and row sums; alpha: what O carries over.
template <int NJ>
__device__ __forceinline__ void tile_softmax(float (&s)[4 * NJ], const TreeAttnParams& p, int t0,
                                             int tq, int row0, int P, int kv_stop, int rows,
                                             int qo0, int G, float (&m_run)[2],
                                             float (&l_run)[2], float (&alpha)[2]) {
  if ((t0 + 8 * NJ > P) || (t0 + 8 * NJ > kv_stop))
    frag_mask<NJ>(s, p, t0 + 2 * tq, row0, P, kv_stop, rows, qo0, G);
  float mx[2], m_use[2], rs[2];
  frag_row_max<NJ>(s, mx);
  online_max(m_run, mx, p.scale_log2, m_use, alpha);
  frag_exp2<NJ>(s, m_use, p.scale_log2, rs);
  l_run[0] = l_run[0] * alpha[0] + rs[0];
  l_run[1] = l_run[1] * alpha[1] + rs[1];
}

// O (the same row layout, R accumulators) *= alpha per row, skipped when no row of this warp
// changed its maximum: alpha is then exactly 1.
template <int R>
__device__ __forceinline__ void rescale_rows(float (&o)[R], const float (&alpha)[2]) {
  if (!__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) return;
#pragma unroll
  for (int j = 0; j < R / 4; ++j) {
    o[4 * j + 0] *= alpha[0];
    o[4 * j + 1] *= alpha[0];
    o[4 * j + 2] *= alpha[1];
    o[4 * j + 3] *= alpha[1];
  }
}

// P (this thread's exponentiated scores, the S fragment) as the A fragments of PV: k-step kk
// takes columns 16 kk .. 16 kk + 15 (the accumulator layout is the A-fragment layout).
template <int NJ, bool BF16>
__device__ __forceinline__ void pack_p_frags(const float (&s)[4 * NJ],
                                             unsigned (&pa)[NJ / 2][4]) {
#pragma unroll
  for (int kk = 0; kk < NJ / 2; ++kk) {
    pa[kk][0] = pack2<BF16>(s[8 * kk + 0], s[8 * kk + 1]);
    pa[kk][1] = pack2<BF16>(s[8 * kk + 2], s[8 * kk + 3]);
    pa[kk][2] = pack2<BF16>(s[8 * kk + 4], s[8 * kk + 5]);
    pa[kk][3] = pack2<BF16>(s[8 * kk + 6], s[8 * kk + 7]);
  }
}

}  // namespace treeverify
