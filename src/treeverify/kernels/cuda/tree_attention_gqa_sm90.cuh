// sm_90a (Hopper) GQA/MHA tree-verify kernel on warpgroup MMA, included by tree_attention.cu.
// Same work decomposition, split rule and outputs as tree_attn_fwd; helpers from
// tree_attention_sm90.cuh (descriptors, fences, swizzled offsets).
//
// One CTA = NWG warpgroups, each owning 64 packed (node, head) rows of one KV head, so a KV tile
// in shared memory serves 64*NWG rows. Per tile each warpgroup computes S = Q K^T (64 x BN,
// both operands from swizzled shared memory), the online softmax in registers, and O += P V
// with P fed from registers (the accumulator layout is the A-fragment layout) and V read
// N-major from the same swizzled layout K uses. No cross-warpgroup exchange is needed.

namespace treeverify {

template <int D, int BN, int NWG, int STAGES>
struct GqaSm90Cfg {
  static constexpr int BM = 64 * NWG, NT = 128 * NWG, CH = D / 8;
  static constexpr int Q_BYTES = BM * D * 2;
  static constexpr int T_BYTES = BN * D * 2;  // one K (or V) tile
  // 1 KB alignment slack + Q + STAGES of K and V + K/V row pointers [STAGES][BN] each.
  static constexpr int SMEM_BYTES = 1024 + Q_BYTES + 2 * STAGES * T_BYTES + 16 * STAGES * BN;
  static_assert(STAGES >= 2 && STAGES <= 4, "cp.async groups in flight");
  static_assert(BN == 64 && (D == 64 || D == 128), "tile shapes this kernel is written for");
};

template <int D, bool BF16>
__device__ __forceinline__ void mma_qk64(float (&s)[32], unsigned long long a,
                                         unsigned long long b, int acc) {
  if constexpr (BF16) wgmma_m64n64k16_ss_bf16<0>(s, a, b, acc);
  else wgmma_m64n64k16_ss_f16<0>(s, a, b, acc);
}
// QK with Q's fragments in registers (the GQA ping-pong kernel's Q_REGS): only K is read from
// shared memory, 2 KB a wgmma instead of 4 KB.
template <int D, bool BF16>
__device__ __forceinline__ void mma_qk64_rs(float (&s)[32], const unsigned (&a)[4],
                                            unsigned long long b, int acc) {
  if constexpr (BF16) wgmma_m64n64k16_rs_bf16<0>(s, a, b, acc);
  else wgmma_m64n64k16_rs_f16<0>(s, a, b, acc);
}
template <int D, bool BF16>
__device__ __forceinline__ void mma_pv(float (&o)[D / 2], const unsigned (&a)[4],
                                       unsigned long long b) {
  if constexpr (D == 128) {
    if constexpr (BF16) wgmma_m64n128k16_rs_bf16<1>(o, a, b, 1);
    else wgmma_m64n128k16_rs_f16<1>(o, a, b, 1);
  } else {
    if constexpr (BF16) wgmma_m64n64k16_rs_bf16<1>(o, a, b, 1);
    else wgmma_m64n64k16_rs_f16<1>(o, a, b, 1);
  }
}

// The sm_90a GQA kernels' MMAs of one warpgroup's 64 rows on a BN-key tile (their callers fence,
// commit and wait): S = Q K^T with Q at q_addr in a ROWS-row block of load_q_tile's layout, and
// O += P V with P's A fragments in registers.
template <int D, int BN, int ROWS, bool BF16>
__device__ __forceinline__ void issue_qk64(float (&s)[32], unsigned q_addr, unsigned k_addr) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const unsigned long long db =
        sw128_desc(k_addr + (kk >> 2) * (BN * 128) + (kk & 3) * 32, 16, 1024);
    const unsigned long long da =
        sw128_desc(q_addr + (kk >> 2) * (ROWS * 128) + (kk & 3) * 32, 16, 1024);
    mma_qk64<D, BF16>(s, da, db, kk > 0);
  }
}
template <int D, int BN, bool BF16>
__device__ __forceinline__ void issue_pv64(float (&o)[D / 2], const unsigned (&pa)[BN / 16][4],
                                           unsigned v_addr) {
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
    const unsigned long long db = sw128_desc(v_addr + kk * 16 * 128, BN * 128, 1024);
    mma_pv<D, BF16>(o, pa[kk], db);
  }
}

// Fragment row h (0: g, 1: g + 8) of a warpgroup's O as fp32 partial row `prow` (normalised by
// its sum l_tot, the quad's) and the row's log2-LSE (-inf where it saw no key).
template <int D>
__device__ __forceinline__ void store_partial_row(const TreeAttnParams& p, const float (&o)[D / 2],
                                                  int h, long long prow, float m, float l_tot,
                                                  int tq) {
  const float inv = l_tot > 0.f ? 1.f / l_tot : 0.f;
  float* po = p.part_o + prow * D;
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
    *reinterpret_cast<float2*>(po + 8 * j + 2 * tq) =
        make_float2(o[4 * j + 2 * h] * inv, o[4 * j + 2 * h + 1] * inv);
  if (tq == 0) p.part_lse[prow] = l_tot > 0.f ? m + log2f(l_tot) : -TV_INF;
}

// The sm_90a GQA kernels' epilogue (this tile kernel, the ping-pong ones): a warpgroup's 64
// rows of O (this thread: fragment rows `row0` and row0 + 8, packed (node,
// head) rows of the request) normalised by their sums: to out when the request has one split,
// else to the split's fp32 partials with each row's log2-LSE.
template <int D, bool BF16>
__device__ __forceinline__ void gqa_store_rows(const TreeAttnParams& p, const float (&o)[D / 2],
                                               const float (&m_run)[2], const float (&l_run)[2],
                                               int row0, int rows, int qo0, int kvh, int G,
                                               int split, int n_splits, int tq) {
  using T = unsigned short;
  const float l_tot[2] = {quad_sum(l_run[0]), quad_sum(l_run[1])};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + h * 8;
    if (row >= rows) continue;
    const int tok = qo0 + row / G, head = kvh * G + row % G;
    const float inv = l_tot[h] > 0.f ? 1.f / l_tot[h] : 0.f;
    if (n_splits == 1) {
      T* og = static_cast<T*>(p.out) + tok * p.o_stride_tok + head * p.o_stride_head;
#pragma unroll
      for (int j = 0; j < D / 8; ++j)
        *reinterpret_cast<unsigned*>(og + 8 * j + 2 * tq) =
            pack2<BF16>(o[4 * j + 2 * h] * inv, o[4 * j + 2 * h + 1] * inv);
    } else {
      store_partial_row<D>(p, o, h, ((long long)split * p.total_q_cap + tok) * p.hq + head,
                           m_run[h], l_tot[h], tq);
    }
  }
}

template <int D, int BN, int NWG, int STAGES, bool BF16>
__global__ void __launch_bounds__(128 * NWG, 1)
    tree_attn_gqa_sm90(const __grid_constant__ TreeAttnParams p) {
  using C = GqaSm90Cfg<D, BN, NWG, STAGES>;
#ifdef TV_EXPECT_SMEM  // the launcher's byte count (variants.py) must match this layout
  static_assert(C::SMEM_BYTES == TV_EXPECT_SMEM, "variants.py smem_bytes out of date");
#endif
  constexpr int BM = C::BM, NT = C::NT;
  using T = unsigned short;
  extern __shared__ unsigned char smem_raw[];
  const unsigned raw_u32 = smem_u32(smem_raw);
  unsigned char* base = smem_raw + (((raw_u32 + 1023u) & ~1023u) - raw_u32);
  unsigned char* sQ = base;
  unsigned char* sK = sQ + C::Q_BYTES;           // [STAGES][BN x D]
  unsigned char* sV = sK + STAGES * C::T_BYTES;  // [STAGES][BN x D]
  const T** sRowK = reinterpret_cast<const T**>(sV + STAGES * C::T_BYTES);  // [STAGES][BN]
  const T** sRowV = sRowK + STAGES * BN;                                      // [STAGES][BN]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2, wi = warp & 3;
  const int g = lane >> 2, tq = lane & 3;

  zero_padding_rows<D>(p);
  pdl_trigger();  // the merge kernel may be scheduled as SMs free (TREEVERIFY_CUDA_PDL)
  const int bh = cta_request_head(p), b = bh / p.hkv, kvh = bh % p.hkv;
  const int qo0 = p.qo_indptr[b];
  const int T_b = p.qo_indptr[b + 1] - qo0;
  const RequestKV rk = request_kv(p, b);
  const int P = rk.prefix, G = p.group;
  const int rows = T_b * G;
  const int m0 = blockIdx.x * BM;
  if (m0 >= rows) return;
  const int kv_batch = batch_kv_sum(p);
  const int n_splits = num_splits(p, P + T_b, kv_batch);
  const int split = cta_split(p);
  if (split >= n_splits) return;
  const int node_hi = min(T_b, (m0 + BM - 1) / G + 1);
  const int chunk = split_chunk(p, P + T_b, kv_batch);
  const int kv_begin = split * chunk;
  const int kv_stop = min(P + node_hi, kv_begin + chunk);
  const int n_tiles = kv_stop > kv_begin ? (kv_stop - kv_begin + BN - 1) / BN : 0;

  const T* kg = static_cast<const T*>(p.k);
  load_q_tile<BM, C::CH, NT>(sQ, p, m0, rows, qo0, kvh, G);
  // Tile j's row pointers, K/V stage and cp.async group all use slot j % STAGES.
  auto fetch_publish = [&](int j) {
    if (tid < BN) {
      const PageFetch f = fetch_page(p, rk, P, kv_begin + j * BN + tid, kv_stop);
      publish_rows<T>(p, f, P, qo0, kvh, kv_stop, &sRowK[(j % STAGES) * BN + tid],
                      &sRowV[(j % STAGES) * BN + tid]);
    }
  };
  auto load_tile = [&](int stage, int j) {
    unsigned char* dk = sK + stage * C::T_BYTES;
    unsigned char* dv = sV + stage * C::T_BYTES;
    static_assert(BN * C::CH % NT == 0, "whole chunks per thread: a fixed, unrolled trip count");
#pragma unroll
    for (int k = 0; k < BN * C::CH / NT; ++k) {
      const int idx = tid + k * NT, r = idx / C::CH, c = idx % C::CH;
      const T* kp = sRowK[(j % STAGES) * BN + r];
      const T* vp = sRowV[(j % STAGES) * BN + r];
      cp_async16(dk + sw_off<BN>(r, c), kp ? kp + c * 8 : kg, kp ? 16 : 0);
      cp_async16(dv + sw_off<BN>(r, c), vp ? vp + c * 8 : kg, vp ? 16 : 0);
    }
  };
  if (tid < BN) {  // all lookups in flight before any is used: one latency, not STAGES
    PageFetch f[STAGES];
#pragma unroll
    for (int j = 0; j < STAGES; ++j) f[j] = fetch_page(p, rk, P, kv_begin + j * BN + tid, kv_stop);
#pragma unroll
    for (int j = 0; j < STAGES; ++j)
      publish_rows<T>(p, f[j], P, qo0, kvh, kv_stop, &sRowK[j * BN + tid], &sRowV[j * BN + tid]);
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < STAGES - 1; ++j) {  // the first group also carries Q
    if (j < n_tiles) load_tile(j, j);
    cp_async_commit();
  }

  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  float m_run[2] = {-TV_INF, -TV_INF};
  float l_run[2] = {0.f, 0.f};
  const unsigned q_addr = smem_u32(sQ) + wg * 64 * 128;  // this warpgroup's 64 rows

  for (int it = 0; it < n_tiles; ++it) {
    cp_async_wait<STAGES - 2>();  // tile it has landed; up to STAGES-2 younger ones in flight
    fence_async_smem();
    __syncthreads();
    const int t0 = kv_begin + it * BN;
    const unsigned k_addr = smem_u32(sK + (it % STAGES) * C::T_BYTES);
    const unsigned v_addr = smem_u32(sV + (it % STAGES) * C::T_BYTES);

    float s[32];  // 64 rows x 64 tokens per warpgroup
    wg_fence();
    issue_qk64<D, BN, BM, BF16>(s, q_addr, k_addr);
    wg_commit();
    // Issued while the QK MMAs run (v9; before them, their issue delayed the tensor cores):
    // the next load into the stage that held tile it-1 (every warpgroup finished it before the
    // barrier above), then the page-table lookups of tile it + STAGES into slot it % STAGES
    // (tile it's pointers were read when its load was issued).
    {
      const int nxt = it + STAGES - 1;
      if (nxt < n_tiles) load_tile(nxt % STAGES, nxt);
      cp_async_commit();
    }
    fetch_publish(it + STAGES);
    wg_wait0();
    pin(s);

    const int r0 = wg * 64 + 16 * wi + g;  // row within the CTA tile (and r0 + 8)
    float alpha[2];
    tile_softmax<BN / 8>(s, p, t0, tq, m0 + r0, P, kv_stop, rows, qo0, G, m_run, l_run, alpha);
    rescale_rows(o, alpha);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      unsigned a[4];
      a[0] = pack2<BF16>(s[8 * kk + 0], s[8 * kk + 1]);
      a[1] = pack2<BF16>(s[8 * kk + 2], s[8 * kk + 3]);
      a[2] = pack2<BF16>(s[8 * kk + 4], s[8 * kk + 5]);
      a[3] = pack2<BF16>(s[8 * kk + 6], s[8 * kk + 7]);
      const unsigned long long db = sw128_desc(v_addr + kk * 16 * 128, BN * 128, 1024);
      mma_pv<D, BF16>(o, a, db);
    }
    wg_commit();
    wg_wait0();
    pin(o);
  }
  cp_async_wait<0>();

  const int r0 = wg * 64 + 16 * wi + g;
  gqa_store_rows<D, BF16>(p, o, m_run, l_run, m0 + r0, rows, qo0, kvh, G, split, n_splits, tq);
  if (n_splits > 1 && merged_in_forward<D>(p, n_splits, min(BM, rows - m0)))
    merge_tile_if_last<D, BF16>(p, qo0, kvh, m0, BM, rows, n_splits);
}

}  // namespace treeverify
