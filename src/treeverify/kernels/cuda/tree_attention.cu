// Tree-verify attention, hand-written CUDA C++ (compiled at run time by NVRTC).
//
// Version log. Geomean = % of the roofline floor over the 54 cases of shared/bench/cases.json
// on one H200 (CUDA-graph replay, median); JSON per run in bench_results/, table in
// docs/performance.md. GQA-16 / GQA-64 / MLA = geomeans of those case families.
//   v1  (75ff216) mma.sync m16n8k16 (portable sm_80+). Rows = (tree node, q head) packed per KV
//       head, so one KV tile serves every head of its group and every node of the request;
//       prefix split across CTAs (split-KV) with fp32 partial O + log2-LSE and a merge kernel;
//       split count decided on the device from the plan's (max_splits, chunk), grid fixed per
//       bucket (capture-safe); cp.async double buffer; tail tiles read the packed tree mask and
//       stop at the tile's last node (topological order). MLA: one 576-wide latent row in
//       shared memory serves QK (576) and PV (first 512); warp pairs split V's columns and
//       exchange P through shared memory.                        14.6% (GQA-16 27, MLA 11-14)
//   v1b (93556bf) 128-row CTAs for GQA when a KV head has >= 128 rows.          15.0%
//   v2  (7c9d072) sm_90a MLA kernel on wgmma (tree_attention_sm90.cuh): 2 warpgroups, latent
//       tile stored once in 128B-swizzled 64-column blocks = K-major B of QK and N-major B of
//       PV; split count that fills one wave without a second, mostly empty one.  20.9%
//   v3  (494402a) page-table lookups moved out of the cp.async loop: thread i fetches the page
//       of token i a tile ahead and publishes row pointers in shared memory (the dependent
//       global load had serialised once per 16-byte chunk). Predicted ~2x on the MLA tiles,
//       measured 1.9x (MLA-TP1 N64 21.5 -> 37.9%).                               31.3%
//   v4  (bcb6357) sm_90a GQA kernel on wgmma (tree_attention_gqa_sm90.cuh): P from registers,
//       V read N-major from the same swizzled layout as K.  GQA-16 40 -> 48%, GQA-64 22 -> 27%
//                                                                                33.2%
//   v5  (59a68cc) GQA wgmma: 4-stage cp.async pipeline for 128-row CTAs. Predicted GQA-64
//       22 -> ~40% if load-latency bound; measured +3 points: it is bound by the serial
//       QK -> softmax -> PV chain of each warpgroup instead.                      33.5%
//   v6  (a44145d) prologue issues all first page lookups before using any.   33.3% (noise)
//   v7  split length follows each request's own key count (whole 64-token units over the
//       plan's max_splits) instead of the bucket's capacity / max_splits: an engine decode of
//       520 keys in a 32k-key bucket ran one CTA per KV head (24 us/layer on the H200). The
//       grid's cases are planned at their own length: predicted unchanged there.
//   v8  (0c5abd5) the split merge inside the forward for row tiles whose read is <= 64 KB
//       (split_merge.cuh: a self-resetting counter per row tile, the last split CTA merges;
//       the merge kernel launched only where a tile can exceed it), the merge's loads issued 8
//       splits at a time, padding rows zeroed by CTA 0 (the engine's memset per layer gone).
//       Engine decode: 123 -> 107 kernels a step, forward 0.244 -> 0.224 ms (tiny-code, b=1);
//       merge kernel -23..-30%. A first cut that merged every tile in the forward with serial
//       loads made 17-node trees at b=8 2.2x slower (one CTA's merge is latency-bound).
//       Grid: unchanged (33.6% vs 33.7% with the merge kernel forced, same run).
//   v9a (8caa78d) sm_90a tiles with fewer instructions (sm90_softmax.cuh).              40.1%
//   v10 (7d168f5) sm_90a MLA "pair" schedule (tree_attention_mla_pair_sm90.cuh): each
//       warpgroup takes whole 64-key tiles, even / odd (S m64n64, P through the buffers'
//       rope blocks, named-barrier handovers). MLA 36.5 -> 45.3% (same lease), large TP1
//       cases 1.3-1.36x; TREEVERIFY_CUDA_MLA_SCHEDULE=split runs v9's.                46.5%
//   v11 (c263695) load_q_tile: one row per NT/BM threads, the division by the runtime group
//       size once a thread instead of twice a chunk (ncu: ~27% of a small MLA case's warp
//       samples in that loop). Small MLA-TP8 cases 1.10x (up to 1.23x), large unchanged. 48.3%
//   v12c (b906c5e) balanced splits for batches of mixed lengths (kernels/splits.py): plans of
//       >= 8k keys leave grid room for 2x a uniform batch's splits, no split shorter than
//       the batch's mean share (batch_kv_sum), splits last in the grid (cta_split); the merge
//       kernel takes several heads a CTA past 8192 CTAs. Mixed-length grid 37.4 -> 40.8%,
//       the equal-length grid unchanged (47.8% vs 48.1% off, same lease).           47.8%
//   v13b-v21: the merge by PDL (device_common.cuh) and the GQA ping-pong kernels, listed in
//       tree_attention_gqa_pp_sm90.cuh (v21: 256-row CTAs, gqa_pp256_consumers.cuh); every
//       version's prediction and figure: docs/performance.md.
//   v24 (fd01e68) the tree mask as one 64-column window a fragment row (tree_mask.cuh) in the
//       sm_90a kernels.                                                            51.4%
//   v25 (7d865f4) the same window in this file's portable kernel, one branch a tile instead
//       of a branch, a division and a mask load per element: portable GQA 1.37x on the H200
//       (28.7 -> 39.2%, long contexts too), portable MLA-TP8 1.02x.
//   v26 (fe57828) host-side split rule (kernels/splits.py).
//   v27 (48775a0) a balanced plan's later splits serve the requests longest first
//       (cta_request_head, device_common.cuh): SGLang's page-1 GQA batch 1.09x, Kimi TP8
//       1.06-1.09x, the mixed-length grid 1.014x, the equal one unchanged.         50.7%
//
// Layout of one CTA's work: (m-tile of BM packed rows) x (split of the KV range) x (request,
// KV head); the grid's y/z order of the last two is cta_split / cta_request_head's. Packed row r of (request b, KV head h): node r / G, query head h*G + r % G.
// Each warp owns 16 rows and DV/WN output columns; WN warps share the same rows.

#include "device_common.cuh"
#include "split_merge.cuh"  // merge_tile_if_last, zero_padding_rows
#include "tree_mask.cuh"    // frag_mask: a fragment row's visible columns as one window

namespace treeverify {

template <int DQK, int DV, int BM, int BN, int WN, int STAGES, bool BF16, bool MLA>
struct Cfg {
  static constexpr int NW = (BM / 16) * WN;  // warps
  static constexpr int NT = NW * 32;         // threads
  static constexpr int SQ = DQK + 8;         // padded smem row (elements): conflict-free ldmatrix
  static constexpr int SV = MLA ? SQ : DV + 8;
  static constexpr int SP = BN + 8;
  static constexpr int BNW = BN / WN;        // S columns per warp
  static constexpr int DVW = DV / WN;        // O columns per warp
  static constexpr int Q_ELEMS = BM * SQ;
  static constexpr int K_ELEMS = BN * SQ;
  static constexpr int V_ELEMS = MLA ? 0 : BN * SV;
  static constexpr int P_ELEMS = WN > 1 ? BM * SP : 0;
  static constexpr int PTR_BYTES = 8 * 2 * BN * (MLA ? 1 : 2);  // K (and V) rows, 2 tiles
  static constexpr int SMEM_BYTES =
      2 * (Q_ELEMS + STAGES * (K_ELEMS + V_ELEMS) + P_ELEMS) + 4 * 2 * WN * BM + PTR_BYTES;
  static_assert(NT >= BN, "one thread per token of a tile fetches its page");
  static_assert(BM % 16 == 0 && BN % (16 * WN) == 0 && DQK % 16 == 0 && DVW % 16 == 0, "tile");
  static_assert(MLA ? DV <= DQK : DV == DQK, "GQA needs Dqk == Dv; MLA needs Dv <= Dqk");
};

template <int DQK, int DV, int BM, int BN, int WN, int STAGES, bool BF16, bool MLA>
__global__ void __launch_bounds__((BM / 16) * WN * 32, 1)
    tree_attn_fwd(const __grid_constant__ TreeAttnParams p) {
  using C = Cfg<DQK, DV, BM, BN, WN, STAGES, BF16, MLA>;
#ifdef TV_EXPECT_SMEM  // the launcher's byte count (variants.py) must match this layout
  static_assert(C::SMEM_BYTES == TV_EXPECT_SMEM, "variants.py smem_bytes out of date");
#endif
  using T = unsigned short;  // raw 16-bit element
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + C::Q_ELEMS;                  // [STAGES][BN][SQ]
  T* sV = sK + STAGES * C::K_ELEMS;         // [STAGES][BN][SV] (GQA only)
  T* sP = sV + STAGES * C::V_ELEMS;         // [BM][SP] (WN > 1 only)
  float* sMax = reinterpret_cast<float*>(sP + C::P_ELEMS);  // [WN][BM]
  float* sSum = sMax + WN * BM;                                // [WN][BM]
  const T** sRowK = reinterpret_cast<const T**>(sSum + WN * BM);  // [2][BN]
  const T** sRowV = sRowK + 2 * BN;                               // [2][BN] (GQA only)

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / WN, wn = warp % WN;
  const int g = lane >> 2, tq = lane & 3;

  zero_padding_rows<DV>(p);
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
  // Topological order: rows of this tile see tree columns < node_hi only.
  const int node_hi = min(T_b, (m0 + BM - 1) / G + 1);
  const int chunk = split_chunk(p, P + T_b, kv_batch);
  const int kv_begin = split * chunk;
  const int kv_stop = min(P + node_hi, kv_begin + chunk);
  const int n_tiles = kv_stop > kv_begin ? (kv_stop - kv_begin + BN - 1) / BN : 0;

  const T* qg = static_cast<const T*>(p.q);
  const T* kg = static_cast<const T*>(p.k);
  const T* vg = static_cast<const T*>(p.v);

  // ---- Q tile: BM packed rows -> smem (zero-filled past the last row).
  constexpr int QCH = DQK / 8;
  for (int idx = tid; idx < BM * QCH; idx += C::NT) {
    const int r = idx / QCH, c = idx % QCH, row = m0 + r;
    const bool ok = row < rows;
    const int node = ok ? row / G : 0, head = kvh * G + (ok ? row % G : 0);
    const T* src = qg + (qo0 + node) * p.q_stride_tok + head * p.q_stride_head + c * 8;
    cp_async16(sQ + r * C::SQ + c * 8, src, ok ? 16 : 0);
  }

  // ---- KV tiles: row pointers of tile j live in sRowK/V[j & 1] (see fetch_page).
  auto publish = [&](int j, const PageFetch& f) {
    if (tid < BN)
      publish_rows<T>(p, f, P, qo0, kvh, kv_stop, &sRowK[(j & 1) * BN + tid],
                      MLA ? nullptr : &sRowV[(j & 1) * BN + tid]);
  };
  auto fetch = [&](int j) {
    return tid < BN ? fetch_page(p, rk, P, kv_begin + j * BN + tid, kv_stop)
                    : PageFetch{-1, kv_stop};
  };
  auto load_tile = [&](int stage, int j) {
    T* dk = sK + stage * C::K_ELEMS;
    T* dv = sV + stage * C::V_ELEMS;
    constexpr int KCH = DQK / 8;
    for (int idx = tid; idx < BN * KCH; idx += C::NT) {
      const int r = idx / KCH, c = idx % KCH;
      const T* kp = sRowK[(j & 1) * BN + r];
      cp_async16(dk + r * C::SQ + c * 8, kp ? kp + c * 8 : kg, kp ? 16 : 0);
      if constexpr (!MLA) {
        const T* vp = sRowV[(j & 1) * BN + r];
        cp_async16(dv + r * C::SV + c * 8, vp ? vp + c * 8 : kg, vp ? 16 : 0);
      }
    }
  };

  static_assert(STAGES == 2, "row pointers are double-buffered with the KV stages");
  {  // both lookups in flight before either is used: one latency, not two
    const PageFetch f0 = fetch(0), f1 = fetch(1);
    publish(0, f0);
    publish(1, f1);
  }
  __syncthreads();
  if (n_tiles > 0) load_tile(0, 0);
  cp_async_commit();

  float o[C::DVW / 8][4];
#pragma unroll
  for (int i = 0; i < C::DVW / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m_run[2] = {-TV_INF, -TV_INF};
  float l_run[2] = {0.f, 0.f};

  constexpr bool Q_IN_REGS = DQK <= 128;
  unsigned qf[Q_IN_REGS ? DQK / 16 : 1][4];

  for (int it = 0; it < n_tiles; ++it) {
    cp_async_wait<0>();
    __syncthreads();
    if (it + 1 < n_tiles) load_tile((it + 1) & 1, it + 1);
    cp_async_commit();
    const PageFetch ahead = fetch(it + 2);  // latency hidden behind this tile's MMAs
    const int t0 = kv_begin + it * BN;
    const T* cK = sK + (it % STAGES) * C::K_ELEMS;
    const T* cV = MLA ? cK : sV + (it % STAGES) * C::V_ELEMS;

    if constexpr (Q_IN_REGS) {
      if (it == 0) {
#pragma unroll
        for (int kk = 0; kk < DQK / 16; ++kk)
          ldsm_x4(qf[kk], sQ + (wm * 16 + (lane & 15)) * C::SQ + kk * 16 + (lane >> 4) * 8);
      }
    }

    // ---- S = Q K^T for this warp's 16 rows x BNW columns.
    float s[C::BNW / 8][4];
#pragma unroll
    for (int i = 0; i < C::BNW / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < DQK / 16; ++kk) {
      unsigned a[4];
      if constexpr (Q_IN_REGS) {
        a[0] = qf[kk][0]; a[1] = qf[kk][1]; a[2] = qf[kk][2]; a[3] = qf[kk][3];
      } else {
        ldsm_x4(a, sQ + (wm * 16 + (lane & 15)) * C::SQ + kk * 16 + (lane >> 4) * 8);
      }
#pragma unroll
      for (int nn = 0; nn < C::BNW / 16; ++nn) {
        unsigned bf[4];
        ldsm_x4(bf, cK + (wn * C::BNW + nn * 16 + (lane & 7) + (lane >> 4) * 8) * C::SQ +
                        kk * 16 + ((lane >> 3) & 1) * 8);
        mma16816<BF16>(s[2 * nn], a, bf[0], bf[1]);
        mma16816<BF16>(s[2 * nn + 1], a, bf[2], bf[3]);
      }
    }

    // ---- scale, mask (only tiles that reach the tree nodes or the end: one window of
    // visible columns a fragment row, tree_mask.cuh), row max.
#pragma unroll
    for (int nt = 0; nt < C::BNW / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] *= p.scale_log2;
    }
    if ((t0 + BN > P) || (t0 + BN > kv_stop)) {
      // s[nt][e] is the flat fragment s[4 nt + e] (frag_mask's layout)
      frag_mask<C::BNW / 8>(reinterpret_cast<float(&)[C::BNW / 2]>(s), p,
                            t0 + wn * C::BNW + 2 * tq, m0 + wm * 16 + g, P, kv_stop, rows, qo0,
                            G);
    }
    float mx[2] = {-TV_INF, -TV_INF};
#pragma unroll
    for (int nt = 0; nt < C::BNW / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
    }
    mx[0] = quad_max(mx[0]);
    mx[1] = quad_max(mx[1]);
    if constexpr (WN > 1) {
      if (tq == 0) {
        sMax[wn * BM + wm * 16 + g] = mx[0];
        sMax[wn * BM + wm * 16 + g + 8] = mx[1];
      }
      pair_barrier(1 + wm, WN * 32);
#pragma unroll
      for (int w = 0; w < WN; ++w) {
        mx[0] = fmaxf(mx[0], sMax[w * BM + wm * 16 + g]);
        mx[1] = fmaxf(mx[1], sMax[w * BM + wm * 16 + g + 8]);
      }
    }
    float alpha[2], m_use[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float m_new = fmaxf(m_run[h], mx[h]);
      m_use[h] = m_new == -TV_INF ? 0.f : m_new;
      alpha[h] = exp2f(m_run[h] - m_use[h]);
      m_run[h] = m_new;
    }
    float rs[2] = {0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < C::BNW / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pe = exp2f(s[nt][e] - m_use[e >> 1]);
        s[nt][e] = pe;
        rs[e >> 1] += pe;
      }
    }
    l_run[0] = l_run[0] * alpha[0] + rs[0];
    l_run[1] = l_run[1] * alpha[1] + rs[1];
#pragma unroll
    for (int i = 0; i < C::DVW / 8; ++i) {
      o[i][0] *= alpha[0]; o[i][1] *= alpha[0];
      o[i][2] *= alpha[1]; o[i][3] *= alpha[1];
    }

    // ---- O += P V.
    if constexpr (WN == 1) {
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        unsigned a[4];
        a[0] = pack2<BF16>(s[2 * kk][0], s[2 * kk][1]);
        a[1] = pack2<BF16>(s[2 * kk][2], s[2 * kk][3]);
        a[2] = pack2<BF16>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        a[3] = pack2<BF16>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
        for (int nn = 0; nn < C::DVW / 16; ++nn) {
          unsigned bf[4];
          ldsm_x4_t(bf, cV + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * C::SV +
                            nn * 16 + (lane >> 4) * 8);
          mma16816<BF16>(o[2 * nn], a, bf[0], bf[1]);
          mma16816<BF16>(o[2 * nn + 1], a, bf[2], bf[3]);
        }
      }
    } else {
#pragma unroll
      for (int nt = 0; nt < C::BNW / 8; ++nt) {
        const int c = wn * C::BNW + nt * 8 + 2 * tq;
        *reinterpret_cast<unsigned*>(sP + (wm * 16 + g) * C::SP + c) =
            pack2<BF16>(s[nt][0], s[nt][1]);
        *reinterpret_cast<unsigned*>(sP + (wm * 16 + g + 8) * C::SP + c) =
            pack2<BF16>(s[nt][2], s[nt][3]);
      }
      pair_barrier(1 + wm, WN * 32);
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        unsigned a[4];
        ldsm_x4(a, sP + (wm * 16 + (lane & 15)) * C::SP + kk * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int nn = 0; nn < C::DVW / 16; ++nn) {
          unsigned bf[4];
          ldsm_x4_t(bf, cV + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * C::SV +
                            wn * C::DVW + nn * 16 + (lane >> 4) * 8);
          mma16816<BF16>(o[2 * nn], a, bf[0], bf[1]);
          mma16816<BF16>(o[2 * nn + 1], a, bf[2], bf[3]);
        }
      }
    }
    publish(it + 2, ahead);  // tile it's pointers were consumed last iteration: slot is free
  }
  cp_async_wait<0>();

  // ---- finish: full row sums, normalise, store final output or this split's partial.
  float l_tot[2] = {quad_sum(l_run[0]), quad_sum(l_run[1])};
  if constexpr (WN > 1) {
    if (tq == 0) {
      sSum[wn * BM + wm * 16 + g] = l_tot[0];
      sSum[wn * BM + wm * 16 + g + 8] = l_tot[1];
    }
    pair_barrier(1 + wm, WN * 32);
    l_tot[0] = l_tot[1] = 0.f;
#pragma unroll
    for (int w = 0; w < WN; ++w) {
      l_tot[0] += sSum[w * BM + wm * 16 + g];
      l_tot[1] += sSum[w * BM + wm * 16 + g + 8];
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = m0 + wm * 16 + g + h * 8;
    if (row >= rows) continue;
    const int tok = qo0 + row / G, head = kvh * G + row % G;
    const float inv = l_tot[h] > 0.f ? 1.f / l_tot[h] : 0.f;
    if (n_splits == 1) {
      T* og = static_cast<T*>(p.out) + tok * p.o_stride_tok + head * p.o_stride_head;
#pragma unroll
      for (int nt = 0; nt < C::DVW / 8; ++nt) {
        const int c = wn * C::DVW + nt * 8 + 2 * tq;
        *reinterpret_cast<unsigned*>(og + c) =
            pack2<BF16>(o[nt][2 * h] * inv, o[nt][2 * h + 1] * inv);
      }
    } else {
      const long long prow = ((long long)split * p.total_q_cap + tok) * p.hq + head;
      float* po = p.part_o + prow * DV;
#pragma unroll
      for (int nt = 0; nt < C::DVW / 8; ++nt) {
        const int c = wn * C::DVW + nt * 8 + 2 * tq;
        *reinterpret_cast<float2*>(po + c) = make_float2(o[nt][2 * h] * inv, o[nt][2 * h + 1] * inv);
      }
      if (wn == 0 && tq == 0)
        p.part_lse[prow] = l_tot[h] > 0.f ? m_run[h] + log2f(l_tot[h]) : -TV_INF;
    }
  }
  if (n_splits > 1 && merged_in_forward<DV>(p, n_splits, min(BM, rows - m0)))
    merge_tile_if_last<DV, BF16, false>(p, qo0, kvh, m0, BM, rows, n_splits);  // v8 shape
}

}  // namespace treeverify

#include "merge_and_mask.cuh"           // split-KV merge, SGLang mask converter
#include "tree_attention_sm90.cuh"      // sm_90a wgmma MLA kernel (instantiated only for sm_90a)
#include "tree_attention_mla_pair_sm90.cuh"  // sm_90a MLA, whole tiles per warpgroup (v10)
#include "tree_attention_gqa_sm90.cuh"  // sm_90a wgmma GQA kernel
#include "sm90_async.cuh"  // mbarrier, TMA and cluster PTX wrappers
#include "gqa_pp_tma_producer.cuh"  // the GQA ping-pong kernel's TMA phase
#include "gqa_pp_common.cuh"  // the ping-pong kernels' shape, barriers, epilogue
#include "cta_trace.cuh"  // per-CTA timing, diagnostic builds only (scripts/cta_trace.py)
#include "gqa_pp256_consumers.cuh"  // the 256-row CTA's consumers (v21)
#include "tree_attention_gqa_pp_sm90.cuh"  // sm_90a GQA, producer + ping-pong consumers (v14)
#include "gqa_pp_persist.cuh"  // the same, persistent: equal shares of the batch (v23)
