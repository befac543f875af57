// sm_90a (Hopper) MLA tree-verify kernel on warpgroup MMA (wgmma), included by
// tree_attention.cu. Same work decomposition, split rule and outputs as tree_attn_fwd.
//
// One CTA = 2 warpgroups over 64 packed rows (BM) and BN-token KV tiles:
// - shared memory holds Q (64 x 576) and two KV stages (BN x 576), each stored as 64-column
//   blocks of 128-byte rows with the 128B swizzle, so one tile is both the K-major B operand of
//   S = Q K^T (N = tokens) and, through its first 8 blocks, the N-major B operand of O += P V
//   (K = tokens, N = 512 latent columns): each latent row is read from HBM once.
// - warpgroup w computes S for tokens [w*BN/2, (w+1)*BN/2) of the tile, the two exchange row
//   maxima through shared memory, write P (bf16) into a swizzled 64 x BN tile, and each then
//   multiplies all of P by its own 256 V columns: O is 64 x 256 fp32 per warpgroup.

#include "wgmma_ops.cuh"
#include "sm90_softmax.cuh"

namespace treeverify {

// Shared-memory matrix descriptor, 128-byte swizzle (bits 62-63 = 1).
__device__ __forceinline__ unsigned long long sw128_desc(unsigned addr, unsigned lbo,
                                                         unsigned sbo) {
  return static_cast<unsigned long long>((addr & 0x3FFFF) >> 4) |
         (static_cast<unsigned long long>((lbo & 0x3FFFF) >> 4) << 16) |
         (static_cast<unsigned long long>((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_wait0() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
__device__ __forceinline__ void wg_wait1() {
  asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
}
// Generic-proxy shared-memory writes (cp.async, st.shared) -> visible to the tensor cores.
__device__ __forceinline__ void fence_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Keep the compiler from touching accumulators across the asynchronous MMA window.
template <int R>
__device__ __forceinline__ void pin(float (&r)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// Byte offset of 16-byte chunk c (8 elements) of row r in a ROWS-row tile stored as 64-column
// blocks (ROWS x 128 B each) with the 128B swizzle: chunk index XOR (row mod 8).
template <int ROWS>
__device__ __forceinline__ unsigned sw_off(int r, int c) {
  return (c >> 3) * (ROWS * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}

template <int BN, bool BF16>
__device__ __forceinline__ void mma_s(float (&s)[BN / 4], unsigned long long a,
                                      unsigned long long b, int acc) {
  static_assert(BN == 64, "S tiles are 64 rows x 32 tokens per warpgroup");
  if constexpr (BF16) wgmma_m64n32k16_ss_bf16<0>(s, a, b, acc);
  else wgmma_m64n32k16_ss_f16<0>(s, a, b, acc);
}
template <bool BF16>
__device__ __forceinline__ void mma_o(float (&o)[128], unsigned long long a, unsigned long long b) {
  if constexpr (BF16) wgmma_m64n256k16_ss_bf16<1>(o, a, b, 1);
  else wgmma_m64n256k16_ss_f16<1>(o, a, b, 1);
}

template <int BN>
struct MlaSm90Cfg {
  static constexpr int DQK = 576, DV = 512, BM = 64, CH = DQK / 8;  // 72 chunks per row
  static constexpr int Q_BYTES = BM * DQK * 2;
  static constexpr int KV_BYTES = BN * DQK * 2;
  static constexpr int P_BYTES = BM * BN * 2;
  // + row maxima [2][BM] (reused for row sums after the loop) + K row pointers [2][BN].
  static constexpr int SMEM_BYTES = 1024 + Q_BYTES + 2 * KV_BYTES + P_BYTES + 4 * 2 * BM + 16 * BN;
};

// Q of one CTA's BM packed rows into shared memory as 64-column blocks with the 128B swizzle
// (sw_off), by NT threads, one 16-byte cp.async a chunk; rows past the tile are zero-filled.
// Row r of (request at qo0, KV head kvh) is node r / G, query head kvh * G + r % G.
// Each thread owns one row (NT / BM threads a row, interleaved chunks: a warp's 16-byte pieces
// are whole 32-byte sectors): the division by the runtime G happens once a thread, not once a
// chunk (v11: with a division pair per chunk, issuing Q was ~27% of the warps' samples in the
// small MLA case's ncu profile, where every CTA issues Q at once and waits on it).
template <int BM, int CH, int NT>
__device__ __forceinline__ void load_q_tile(unsigned char* sQ, const TreeAttnParams& p, int m0,
                                            int rows, int qo0, int kvh, int G) {
  constexpr int TPR = NT / BM;  // threads per row
  static_assert(NT % BM == 0 && CH % TPR == 0, "whole rows per thread group, whole chunks each");
  using T = unsigned short;
  const int r = threadIdx.x / TPR, c0 = threadIdx.x % TPR, row = m0 + r;
  const bool ok = row < rows;
  const int node = ok ? row / G : 0, head = kvh * G + (ok ? row % G : 0);
  const T* src = static_cast<const T*>(p.q) + (qo0 + node) * p.q_stride_tok +
                 head * p.q_stride_head;
#pragma unroll
  for (int k = 0; k < CH / TPR; ++k) {
    const int c = c0 + k * TPR;
    cp_async16(sQ + sw_off<BM>(r, c), src + c * 8, ok ? 16 : 0);
  }
}

// The end both sm_90a MLA kernels share: the two warpgroups' row sums added through shared
// memory (sSum, [2][64]), then each warpgroup's 64 x 256 slice of O, normalised, to out (one
// split) or to the split's fp32 partials with the row's log2-LSE, then the in-forward merge.
// m_run: the running row maxima (log2 units), equal in both warpgroups.
template <bool BF16>
__device__ __forceinline__ void mla_sm90_epilogue(const TreeAttnParams& p, const float (&o)[128],
                                                  const float (&m_run)[2], const float (&l_run)[2],
                                                  float* sSum, int split, int n_splits, int m0,
                                                  int rows, int qo0, int kvh) {
  constexpr int BM = 64, DV = 512;
  using T = unsigned short;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2, wi = warp & 3, g = lane >> 2, tq = lane & 3, G = p.group;
  float l_tot[2] = {quad_sum(l_run[0]), quad_sum(l_run[1])};
  const int r0 = 16 * wi + g;
  if (tq == 0) {
    sSum[wg * BM + r0] = l_tot[0];
    sSum[wg * BM + r0 + 8] = l_tot[1];
  }
  __syncthreads();
  l_tot[0] = sSum[r0] + sSum[BM + r0];
  l_tot[1] = sSum[r0 + 8] + sSum[BM + r0 + 8];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = m0 + r0 + h * 8;
    if (row >= rows) continue;
    const int tok = qo0 + row / G, head = kvh * G + row % G;
    const float inv = l_tot[h] > 0.f ? 1.f / l_tot[h] : 0.f;
    if (n_splits == 1) {
      T* og = static_cast<T*>(p.out) + tok * p.o_stride_tok + head * p.o_stride_head;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const int c = wg * 256 + 8 * j + 2 * tq;
        *reinterpret_cast<unsigned*>(og + c) =
            pack2<BF16>(o[4 * j + 2 * h] * inv, o[4 * j + 2 * h + 1] * inv);
      }
    } else {
      const long long prow = ((long long)split * p.total_q_cap + tok) * p.hq + head;
      float* po = p.part_o + prow * DV;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const int c = wg * 256 + 8 * j + 2 * tq;
        *reinterpret_cast<float2*>(po + c) =
            make_float2(o[4 * j + 2 * h] * inv, o[4 * j + 2 * h + 1] * inv);
      }
      if (wg == 0 && tq == 0)
        p.part_lse[prow] = l_tot[h] > 0.f ? m_run[h] + log2f(l_tot[h]) : -TV_INF;
    }
  }
  if (n_splits > 1 && merged_in_forward<DV>(p, n_splits, min(BM, rows - m0)))
    merge_tile_if_last<DV, BF16>(p, qo0, kvh, m0, BM, rows, n_splits);
}

template <int BN, bool BF16>
__global__ void __launch_bounds__(256, 1)
    tree_attn_mla_sm90(const __grid_constant__ TreeAttnParams p) {
  using C = MlaSm90Cfg<BN>;
#ifdef TV_EXPECT_SMEM  // the launcher's byte count (variants.py) must match this layout
  static_assert(C::SMEM_BYTES == TV_EXPECT_SMEM, "variants.py smem_bytes out of date");
#endif
  constexpr int BM = C::BM, HALF = BN / 2;
  using T = unsigned short;
  extern __shared__ unsigned char smem_raw[];
  // 128B-swizzle atoms must start on 1024-byte boundaries.
  const unsigned raw_u32 = smem_u32(smem_raw);
  unsigned char* base = smem_raw + (((raw_u32 + 1023u) & ~1023u) - raw_u32);
  unsigned char* sQ = base;
  unsigned char* sKV = sQ + C::Q_BYTES;
  unsigned char* sP = sKV + 2 * C::KV_BYTES;
  float* sMax = reinterpret_cast<float*>(sP + C::P_BYTES);  // [2][BM]
  float* sSum = sMax;  // [2][BM], after the loop (the last sMax read precedes a barrier)
  const T** sRow = reinterpret_cast<const T**>(sMax + 2 * BM);  // [2][BN]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2, wi = warp & 3;
  const int g = lane >> 2, tq = lane & 3;

  zero_padding_rows<C::DV>(p);
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

  load_q_tile<BM, C::CH, 256>(sQ, p, m0, rows, qo0, kvh, G);
  // Row pointers of tile j live in sRow[j & 1]; see fetch_page in tree_attention.cu.
  auto fetch = [&](int j) { return fetch_page(p, rk, P, kv_begin + j * BN + tid, kv_stop); };
  auto publish = [&](int j, const PageFetch& f) {
    publish_rows<T>(p, f, P, qo0, kvh, kv_stop, &sRow[(j & 1) * BN + tid], nullptr);
  };
  auto fetch_publish = [&](int j) {
    if (tid < BN) publish(j, fetch(j));
  };
  auto load_tile = [&](int stage, int j) {
    unsigned char* dst = sKV + stage * C::KV_BYTES;
    static_assert(BN * C::CH % 256 == 0, "whole chunks per thread: a fixed, unrolled trip count");
#pragma unroll
    for (int k = 0; k < BN * C::CH / 256; ++k) {
      const int idx = tid + k * 256, r = idx / C::CH, c = idx % C::CH;
      const T* src = sRow[(j & 1) * BN + r];
      cp_async16(dst + sw_off<BN>(r, c), src ? src + c * 8 : kg, src ? 16 : 0);
    }
  };
  if (tid < BN) {  // both lookups in flight before either is used: one latency, not two
    const PageFetch f0 = fetch(0), f1 = fetch(1);
    publish(0, f0);
    publish(1, f1);
  }
  __syncthreads();
  if (n_tiles > 0) load_tile(0, 0);
  cp_async_commit();

  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float m_run[2] = {-TV_INF, -TV_INF};
  float l_run[2] = {0.f, 0.f};
  const unsigned q_addr = smem_u32(sQ);
  const unsigned p_addr = smem_u32(sP);

  for (int it = 0; it < n_tiles; ++it) {
    cp_async_wait<0>();
    fence_async_smem();
    __syncthreads();
    const int t0 = kv_begin + it * BN;
    const unsigned kv_addr = smem_u32(sKV + (it & 1) * C::KV_BYTES);

    // ---- S (64 x BN/2 per warpgroup) = Q K^T over 576 = 36 k-steps of 16.
    float s[HALF / 2];
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < C::DQK / 16; ++kk) {
      const unsigned long long da =
          sw128_desc(q_addr + (kk >> 2) * (BM * 128) + (kk & 3) * 32, 16, 1024);
      const unsigned long long db = sw128_desc(
          kv_addr + (kk >> 2) * (BN * 128) + wg * (HALF * 128) + (kk & 3) * 32, 16, 1024);
      mma_s<BN, BF16>(s, da, db, kk > 0);
    }
    wg_commit();
    // Issued while the QK MMAs run (v9; before them, 18 cp.async a thread delayed the tensor
    // cores): the next tile into the other stage (both warpgroups finished its last use, tile
    // it-1, before the barrier above), then the page-table lookups two tiles ahead.
    if (it + 1 < n_tiles) load_tile((it + 1) & 1, it + 1);
    cp_async_commit();
    fetch_publish(it + 2);
    wg_wait0();
    pin(s);

    // ---- mask (tiles reaching the tree or the split's end), row max shared by the warpgroups.
    const int r0 = 16 * wi + g;
    if ((t0 + BN > P) || (t0 + BN > kv_stop))
      frag_mask<HALF / 8>(s, p, t0 + wg * HALF + 2 * tq, m0 + r0, P, kv_stop, rows, qo0, G);
    float mx[2];
    frag_row_max<HALF / 8>(s, mx);
    if (tq == 0) {
      sMax[wg * BM + r0] = mx[0];
      sMax[wg * BM + r0 + 8] = mx[1];
    }
    __syncthreads();
    mx[0] = fmaxf(sMax[r0], sMax[BM + r0]);
    mx[1] = fmaxf(sMax[r0 + 8], sMax[BM + r0 + 8]);
    float alpha[2], m_use[2], rs[2];
    online_max(m_run, mx, p.scale_log2, m_use, alpha);
    frag_exp2<HALF / 8>(s, m_use, p.scale_log2, rs);
#pragma unroll
    for (int j = 0; j < HALF / 8; ++j) {  // P (bf16) into the swizzled 64 x BN tile
      const int c = wg * HALF + 8 * j + 2 * tq;  // token column within the tile
      *reinterpret_cast<unsigned*>(sP + r0 * 128 + (((c >> 3) ^ (r0 & 7)) << 4) + (c & 7) * 2) =
          pack2<BF16>(s[4 * j + 0], s[4 * j + 1]);
      const int r1 = r0 + 8;
      *reinterpret_cast<unsigned*>(sP + r1 * 128 + (((c >> 3) ^ (r1 & 7)) << 4) + (c & 7) * 2) =
          pack2<BF16>(s[4 * j + 2], s[4 * j + 3]);
    }
    l_run[0] = l_run[0] * alpha[0] + rs[0];
    l_run[1] = l_run[1] * alpha[1] + rs[1];
    rescale_rows(o, alpha);
    fence_async_smem();
    __syncthreads();

    // ---- O (64 x 256 per warpgroup) += P (64 x BN) V (BN x 256 of this warpgroup's columns).
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      const unsigned long long da = sw128_desc(p_addr + kk * 32, 16, 1024);
      const unsigned long long db =
          sw128_desc(kv_addr + (4 * wg) * (BN * 128) + kk * 16 * 128, BN * 128, 1024);
      mma_o<BF16>(o, da, db);
    }
    wg_commit();
    wg_wait0();
    pin(o);
  }
  cp_async_wait<0>();

  mla_sm90_epilogue<BF16>(p, o, m_run, l_run, sSum, split, n_splits, m0, rows, qo0, kvh);
}

}  // namespace treeverify
