// sm_90a MLA tree-verify kernel, "pair" schedule (v10), included by tree_attention.cu after
// tree_attention_sm90.cuh (whose descriptor and MMA helpers it uses). Same work decomposition,
// split rule and outputs as tree_attn_mla_sm90 ("split" schedule, v2-v9).
//
// Why: in the split schedule both warpgroups take half of every 64-key tile, so S is
// m64n32k16 with both operands from shared memory (~3 KB read per 16 MMA cycles: more than
// the SM's ~128 B/cycle) and three CTA-wide barriers a tile keep the warpgroups in lockstep
// (ncu, 8caa78d: smem pipe 50% busy, tensor 34%, barrier stalls first).
//
// Here the warpgroups take whole tiles in pairs: warpgroup 0 the even tile a (buffer 0),
// warpgroup 1 the odd tile b (buffer 1), so S is m64n64k16 (half the Q reads per key), and
// they hand over through named barriers instead of CTA-wide ones:
//   wg0: S_a = Q K_a^T; m_a = max(m, rowmax S_a); P_a = 2^(S_a - m_a) -> regs and the rope block
//        of buffer 0 (dead once S_a is done: V is the first 512 columns); publish m_a  [A]
//        O_L = O_L * 2^(m - m_a) + P_a V_a[:, :256]              (P_a from registers)
//        wait [B]; O_L = O_L * 2^(m_a - m_b) + P_b V_b[:, :256]  (P_b from buffer 1's rope block)
//        refill buffer 0 with tile a + 2 once wg1 has read it      [FREE0]
//   wg1: S_b = Q K_b^T; wait [A]; m_b = max(m_a, rowmax S_b); P_b = 2^(S_b - m_b); publish [B]
//        O_R = (O_R * 2^(m - m_a) + P_a V_a[:, 256:]) * 2^(m_a - m_b) + P_b V_b[:, 256:]
//        refill buffer 1 with tile b + 2 once wg0 has read it      [FREE1]
// Each warpgroup loads its own buffer (cp.async, 36 a thread a tile). O stays split by
// columns (64 x 256 fp32 per warpgroup), row sums per warpgroup, added at the end. Shared
// memory: Q 72 KB + two 72 KB buffers; P needs no space of its own (the rope blocks).
// A pair whose odd tile lies past the split runs that tile fully masked (P = 0) over finite
// data: buffer 1 is zero-filled in the prologue or holds an earlier tile.

namespace treeverify {

// Named barriers (0 is __syncthreads): producer arrives, consumer syncs, 256 threads each.
enum : int { kBarA = 1, kBarB = 2, kBarFree0 = 3, kBarFree1 = 4, kBarWg = 5 /* + wg: 128 */ };

__device__ __forceinline__ void named_sync(int id, int n) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

template <bool BF16>
__device__ __forceinline__ void mma_s64(float (&s)[32], unsigned long long a,
                                        unsigned long long b, int acc) {
  if constexpr (BF16) wgmma_m64n64k16_ss_bf16<0>(s, a, b, acc);
  else wgmma_m64n64k16_ss_f16<0>(s, a, b, acc);
}
template <bool BF16>
__device__ __forceinline__ void mma_o_rs(float (&o)[128], const unsigned (&a)[4],
                                         unsigned long long b) {
  if constexpr (BF16) wgmma_m64n256k16_rs_bf16<1>(o, a, b, 1);
  else wgmma_m64n256k16_rs_f16<1>(o, a, b, 1);
}

template <int BN>
struct MlaPairCfg {
  static_assert(BN == 64, "one warpgroup's S is a whole 64-key tile");
  static constexpr int DQK = 576, DV = 512, BM = 64, CH = DQK / 8;  // 72 chunks per row
  static constexpr int Q_BYTES = BM * DQK * 2;
  static constexpr int KV_BYTES = BN * DQK * 2;
  static constexpr int P_OFF = 8 * BN * 128;  // block 8 (columns 512..575) of a buffer
  // + row maxima [2 pairs][2][BM] + row sums [2][BM] + K row pointers [2][BN] (each buffer's
  // next tile). The maxima alternate between two slots by pair, so a pair's writes never meet
  // the previous pair's reads (the barriers order them anyway; tried against racecheck's report,
  // which it did not change, and kept as the layout the H200 runs verified).
  static constexpr int SMEM_BYTES = 1024 + Q_BYTES + 2 * KV_BYTES + 4 * 6 * BM + 8 * 2 * BN;
};

template <int BN, bool BF16>
__global__ void __launch_bounds__(256, 1)
    tree_attn_mla_pair_sm90(const __grid_constant__ TreeAttnParams p) {
  using C = MlaPairCfg<BN>;
#ifdef TV_EXPECT_SMEM  // the launcher's byte count (variants.py) must match this layout
  static_assert(C::SMEM_BYTES == TV_EXPECT_SMEM, "variants.py smem_bytes out of date");
#endif
  constexpr int BM = C::BM;
  using T = unsigned short;
  extern __shared__ unsigned char smem_raw[];
  const unsigned raw_u32 = smem_u32(smem_raw);
  unsigned char* base = smem_raw + (((raw_u32 + 1023u) & ~1023u) - raw_u32);
  unsigned char* sQ = base;
  unsigned char* sKV = sQ + C::Q_BYTES;                            // buffer w at w * KV_BYTES
  float* sMaxes = reinterpret_cast<float*>(sKV + 2 * C::KV_BYTES);  // [2][2][BM]: m_a, m_b
  float* sSum = sMaxes + 4 * BM;                                      // [2][BM]
  const T** sRow = reinterpret_cast<const T**>(sSum + 2 * BM);    // [2][BN]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2, wi = warp & 3, wt = tid & 127;
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
  cp_async_commit();

  // This warpgroup's buffer, its tiles' row pointers (see fetch_page), and its tile loader.
  unsigned char* my_buf = sKV + wg * C::KV_BYTES;
  const T** my_rows = sRow + wg * BN;
  auto fetch = [&](int j) { return fetch_page(p, rk, P, kv_begin + j * BN + wt, kv_stop); };
  auto publish = [&](const PageFetch& f) {
    publish_rows<T>(p, f, P, qo0, kvh, kv_stop, &my_rows[wt], nullptr);
  };
  // Thread wt loads 16-byte chunk wt % 8 of every 64-column block of rows wt / 8 + 16 i: eight
  // threads cover 128 contiguous bytes of a row, and the swizzle term (chunk ^ row % 8) is the
  // same for all 36 of a thread's chunks, so each is one cp.async with immediate offsets.
  static_assert(BN == 4 * 16 && C::CH == 9 * 8, "4 rows x 9 blocks a thread");
  const int c8 = wt & 7, rq = wt >> 3;
  unsigned char* my_dst = my_buf + rq * 128 + ((c8 ^ (rq & 7)) << 4);
  auto load_tile = [&]() {  // rows past the split are zero-filled (null row pointer)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const T* row = my_rows[rq + 16 * i];
      const T* src = row ? row + c8 * 8 : kg;
      const int step = row ? 64 : 0, bytes = row ? 16 : 0;
#pragma unroll
      for (int cb = 0; cb < 9; ++cb)
        cp_async16(my_dst + i * (16 * 128) + cb * (BN * 128), src + cb * step, bytes);
    }
  };
  PageFetch f_next{-1, 0};  // threads wt < BN: the page of this warpgroup's tile after next
  if (wt < BN) {
    const PageFetch f0 = fetch(wg);  // both lookups in flight before either is used
    f_next = fetch(wg + 2);
    publish(f0);
  }
  named_sync(kBarWg + wg, 128);
  load_tile();  // always, even past the split: buffer 1 must hold finite data (see above)
  cp_async_commit();
  cp_async_wait<1>();  // Q (the tile may still be in flight)
  fence_async_smem();
  __syncthreads();

  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float m_run[2] = {-TV_INF, -TV_INF};  // the running maximum, equal in both warpgroups
  float l_run[2] = {0.f, 0.f};          // this warpgroup's share of the row sums
  const unsigned q_addr = smem_u32(sQ);
  const unsigned buf0 = smem_u32(sKV), buf1 = buf0 + C::KV_BYTES;
  const unsigned my_addr = wg == 0 ? buf0 : buf1;
  const int r0 = 16 * wi + g;
  const float scale = p.scale_log2;

  for (int ta = 0; ta < n_tiles; ta += 2) {
    const int tb = ta + 1;
    float* sMax = sMaxes + ((ta >> 1) & 1) * (2 * BM);
    // ---- S (64 x 64) = Q K^T over this warpgroup's tile: 36 k-steps of m64n64k16.
    cp_async_wait<0>();
    fence_async_smem();
    named_sync(kBarWg + wg, 128);
    float s[32];
    // Descriptors as a base plus an offset in 16-byte units (one add each); the empty asm makes
    // the bases opaque. Written against spills that turned out to come from the loads' index
    // math (fixed in load_tile); without it ptxas emits the same loop with 4 more uniform ops.
    unsigned long long qd = sw128_desc(q_addr, 16, 1024), kd = sw128_desc(my_addr, 16, 1024);
    asm volatile("" : "+l"(qd), "+l"(kd));
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < C::DQK / 16; ++kk)  // descriptor addresses count 16-byte units
      mma_s64<BF16>(s, qd + (((kk >> 2) * (BM * 128) + (kk & 3) * 32) >> 4),
                    kd + (((kk >> 2) * (BN * 128) + (kk & 3) * 32) >> 4), kk > 0);
    wg_commit();
    wg_wait0();
    pin(s);
    const int t0 = kv_begin + (ta + wg) * BN;
    if ((t0 + BN > P) || (t0 + BN > kv_stop))  // reaches the tree or the split's end
      frag_mask<8>(s, p, t0 + 2 * tq, m0 + r0, P, kv_stop, rows, qo0, G);
    float mx[2];
    frag_row_max<8>(s, mx);
    // P in bf16 once: pk[2j] / pk[2j + 1] = rows r0 / r0 + 8, columns 8j + 2tq (+1), which is
    // also the A fragment of k-step kk = pk[4kk .. 4kk + 3]; s is dead after this.
    unsigned pk[16];
    auto pack_p = [&]() {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        pk[2 * j] = pack2<BF16>(s[4 * j + 0], s[4 * j + 1]);
        pk[2 * j + 1] = pack2<BF16>(s[4 * j + 2], s[4 * j + 3]);
      }
    };
    unsigned char* my_p = my_buf + C::P_OFF;
    auto store_p = [&]() {  // P into this buffer's rope block, 128B-swizzled 64 x 64
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int r1 = r0 + 8;
        *reinterpret_cast<unsigned*>(my_p + r0 * 128 + ((j ^ (r0 & 7)) << 4) + tq * 4) = pk[2 * j];
        *reinterpret_cast<unsigned*>(my_p + r1 * 128 + ((j ^ (r1 & 7)) << 4) + tq * 4) =
            pk[2 * j + 1];
      }
    };
    auto pv_own = [&](unsigned v_addr) {  // O += P V from registers, 4 k-steps
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        const unsigned a[4] = {pk[4 * kk], pk[4 * kk + 1], pk[4 * kk + 2], pk[4 * kk + 3]};
        mma_o_rs<BF16>(o, a, sw128_desc(v_addr + kk * 16 * 128, BN * 128, 1024));
      }
      wg_commit();
    };
    auto pv_other = [&](unsigned buf, unsigned v_addr) {  // O += P V, P from buf's rope block
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk)
        mma_o<BF16>(o, sw128_desc(buf + C::P_OFF + kk * 32, 16, 1024),
                    sw128_desc(v_addr + kk * 16 * 128, BN * 128, 1024));
      wg_commit();
    };
    float rs[2];
    if (wg == 0) {
      float alpha[2], m_use[2];
      online_max(m_run, mx, scale, m_use, alpha);  // m_run = m_a
      frag_exp2<8>(s, m_use, scale, rs);
      pack_p();
      store_p();
      if (tq == 0) {
        sMax[r0] = m_run[0];
        sMax[r0 + 8] = m_run[1];
      }
      fence_async_smem();
      named_arrive(kBarA, 256);
      l_run[0] = l_run[0] * alpha[0] + rs[0];
      l_run[1] = l_run[1] * alpha[1] + rs[1];
      rescale_rows(o, alpha);
      pv_own(buf0);  // O_L += P_a V_a[:, :256]
      named_sync(kBarB, 256);
      float beta[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float m_b = sMax[BM + r0 + 8 * h];
        beta[h] = exp2f(m_run[h] - (m_b == -TV_INF ? 0.f : m_b));
        m_run[h] = m_b;
      }
      wg_wait0();
      pin(o);
      l_run[0] *= beta[0];
      l_run[1] *= beta[1];
      rescale_rows(o, beta);
      pv_other(buf1, buf1);  // O_L += P_b V_b[:, :256]
      if (ta + 2 < n_tiles) {  // buffer 0's next tile, once warpgroup 1 has read P_a, V_a
        named_sync(kBarFree0, 256);
        if (wt < BN) publish(f_next);
        named_sync(kBarWg + 0, 128);
        load_tile();
      }
      cp_async_commit();
      if (wt < BN) f_next = fetch(ta + 4);
      wg_wait0();
      pin(o);
      if (tb + 2 < n_tiles) named_arrive(kBarFree1, 256);
    } else {
      named_sync(kBarA, 256);
      float alpha[2], beta[2], m_use[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // the same arithmetic as warpgroup 0's, bit for bit
        const float m_a = sMax[r0 + 8 * h];
        alpha[h] = exp2f(m_run[h] - (m_a == -TV_INF ? 0.f : m_a));
        const float m_b = fmaxf(m_a, mx[h] * scale);
        m_use[h] = m_b == -TV_INF ? 0.f : m_b;
        beta[h] = exp2f(m_a - m_use[h]);
        m_run[h] = m_b;
      }
      frag_exp2<8>(s, m_use, scale, rs);
      pack_p();
      store_p();
      if (tq == 0) {
        sMax[BM + r0] = m_run[0];
        sMax[BM + r0 + 8] = m_run[1];
      }
      fence_async_smem();
      named_arrive(kBarB, 256);
      l_run[0] *= alpha[0];
      l_run[1] *= alpha[1];
      rescale_rows(o, alpha);
      pv_other(buf0, buf0 + 4 * (BN * 128));  // O_R += P_a V_a[:, 256:]
      wg_wait0();
      pin(o);
      if (ta + 2 < n_tiles) named_arrive(kBarFree0, 256);
      l_run[0] = l_run[0] * beta[0] + rs[0];
      l_run[1] = l_run[1] * beta[1] + rs[1];
      rescale_rows(o, beta);
      pv_own(buf1 + 4 * (BN * 128));  // O_R += P_b V_b[:, 256:]
      wg_wait0();
      pin(o);
      if (tb + 2 < n_tiles) {  // buffer 1's next tile, once warpgroup 0 has read P_b, V_b
        named_sync(kBarFree1, 256);
        if (wt < BN) publish(f_next);
        named_sync(kBarWg + 1, 128);
        load_tile();
      }
      cp_async_commit();
      if (wt < BN) f_next = fetch(tb + 4);
    }
  }
  cp_async_wait<0>();

  mla_sm90_epilogue<BF16>(p, o, m_run, l_run, sSum, split, n_splits, m0, rows, qo0, kvh);
}

}  // namespace treeverify
