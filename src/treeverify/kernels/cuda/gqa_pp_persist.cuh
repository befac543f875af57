// sm_90a GQA tree verify, persistent (v23, TREEVERIFY_CUDA_GQA_SCHEDULE=pingpong-persist): the
// ping-pong kernel's producer and consumers (tree_attention_gqa_pp_sm90.cuh) walking an equal
// share of the batch's key tiles instead of one (128-row block, split, request, KV head) a CTA.
// Included by tree_attention.cu after tree_attention_gqa_pp_sm90.cuh.
//
// Why: with one CTA a (row block, request, KV head), a batch of mixed lengths lasts as long as
// its longest request. The CTA trace of SGLang's GQA batch (scripts/cta_trace.py, page 1, 8
// requests of 432-3715 keys, 128 CTAs on 132 SMs; docs/performance.md, twenty-first session):
// the kernel took 86.8 us = ~11.7 us of start + 59 tiles of its longest request at ~1.29 us,
// while the batch's 4,272 CTA-tiles spread over the SMs come to ~32 a CTA. Splits launched as
// more CTAs (the balanced plans, v12) queue behind the first wave and each pays a start and
// a merge: measured no faster.
// Measured (twenty-first session, docs/performance.md): refuted as built, 0.83x on the GQA grid
// (1.10x on its long mixed-length case), 0.87-0.89x on SGLang's batch: its own trace put a
// segment at ~3.5-4 us and a cut unit's merge at a CTA's end at 8-19 us. Kept as an option.
// Here:
// - one CTA an SM, in groups of M = p.persist_m (the plan's 128-row blocks a request): CTA x
//   runs row block x % M of group x / M's share. The CTAs of a group read the same keys at
//   the same time, so the second one's loads hit L2 as the two CTAs of a KV head do now;
// - the work is the flat list of key tiles over (request, KV head) units, request-major, each
//   unit ceil((P_b + T_b) / BN) tiles; group g takes tiles [g T / n_g, (g + 1) T / n_g)
//   (T: all units' tiles; n_g: the groups, at most T / kPersistMinTiles of them), so every
//   group has the same tiles (+-1) whatever the lengths. A
//   range covers the end of one unit, whole units and the start of another: its segments;
// - the producer streams the segments' tiles through the slot ring without a break, and each
//   segment's Q into one of two Q buffers with the segment's first tile (once the consumers
//   finished the segment two back with it); the consumers keep the ping-pong turns, and at a
//   segment's first tile they finish the previous segment (its last PV issued with the new QK)
//   and store it;
// - a unit inside one range goes to `out`; a unit cut by a range's edge (only a range's first
//   and last segment can be) leaves fp32 partials in the CTA's slot (0: the range's first
//   segment, 1: its last; part_o / part_lse as (2, CTAs, 128 rows)), and the last of the unit's
//   pieces to count itself on the unit's counter (per (request, KV head, row block), reset by
//   that CTA for the next launch) merges them into `out`.
#pragma once

namespace treeverify {

// Compile-time booleans for a generic lambda's two instantiations (no <type_traits> here).
struct true_type {
  static constexpr bool value = true;
  __device__ constexpr operator bool() const { return true; }
};
struct false_type {
  static constexpr bool value = false;
  __device__ constexpr operator bool() const { return false; }
};

enum : int { kPpConsumers = 4 };  // named barrier of the two consumer warpgroups (256 threads)
// The fewest tiles a group takes (fewer groups where the batch is small): each share pays a
// start and its cut units a merge.
constexpr int kPersistMinTiles = 4;

// Key tiles of each KV head's unit of a request (0 for a padded batch slot: no tree nodes).
template <int BN>
__device__ __forceinline__ int unit_tiles(int prefix, int nodes) {
  return nodes > 0 ? (prefix + nodes + BN - 1) / BN : 0;
}
template <int BN>
__device__ __forceinline__ int persist_tiles(const TreeAttnParams& p, int b) {
  return unit_tiles<BN>(request_kv(p, b).prefix, p.qo_indptr[b + 1] - p.qo_indptr[b]);
}

// All units' tiles (T). Lanes over requests: every lane of the calling warp converged.
template <int BN>
__device__ __forceinline__ int persist_total(const TreeAttnParams& p) {
  int s = 0;
  for (int b = threadIdx.x & 31; b < p.batch; b += 32) s += persist_tiles<BN>(p, b);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s * p.hkv;
}

// The request whose units hold flat tile a (< T), and in `begin` the flat index of its first
// unit: a prefix sum over requests, 32 at a time (warp converged).
template <int BN>
__device__ __forceinline__ int persist_find(const TreeAttnParams& p, int a, int& begin) {
  const int lane = threadIdx.x & 31;
  int base = 0;
  for (int b0 = 0; b0 < p.batch; b0 += 32) {
    const int b = b0 + lane;
    const int mine = b < p.batch ? persist_tiles<BN>(p, b) * p.hkv : 0;
    int incl = mine;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    const unsigned hit = __ballot_sync(0xffffffffu, mine > 0 && base + incl > a);
    if (hit != 0u) {
      const int l = __ffs(hit) - 1;
      begin = base + __shfl_sync(0xffffffffu, incl - mine, l);
      return b0 + l;
    }
    base += __shfl_sync(0xffffffffu, incl, 31);
  }
  begin = base;
  return p.batch;
}

// Group g's range starts at floor(g T / n_g): as (T / n_g) g + ((T % n_g) g) / n_g, in 32 bits
// (T x groups may pass 2^31; a 64-bit division is a called routine whose register saves
// spill).
__device__ __forceinline__ int persist_range_start(int g, int T, int n_g) {
  const int q = T / n_g;
  return q * g + (T - q * n_g) * g / n_g;
}
// The group whose range holds flat tile pos: estimated in floats, then corrected exactly.
__device__ __forceinline__ int persist_group(int pos, int T, int n_g) {
  int g = min(n_g - 1, static_cast<int>(static_cast<float>(pos) * n_g / T));
  while (g > 0 && persist_range_start(g, T, n_g) > pos) --g;
  while (g + 1 < n_g && persist_range_start(g + 1, T, n_g) <= pos) ++g;
  return g;
}

// One request as the walk sees it.
struct PersistReq {
  RequestKV rk;
  int qo0, nodes, tiles;
};
template <int BN>
__device__ __forceinline__ PersistReq persist_req(const TreeAttnParams& p, int b) {
  PersistReq q;
  q.rk = request_kv(p, b);
  q.qo0 = p.qo_indptr[b];
  q.nodes = p.qo_indptr[b + 1] - q.qo0;
  q.tiles = unit_tiles<BN>(q.rk.prefix, q.nodes);
  return q;
}

// A CTA's walk over its group's range [a, b), one (request r, KV head h) unit at a time; ub:
// the flat index of the unit's first tile. ng = min(groups, T / kPersistMinTiles): the groups
// that take tiles, so that no range is empty and a cut unit's pieces are consecutive groups.
// Producer and consumers each walk it the same way.
struct PersistWalk {
  int a, b, T, ub, ng, r, h;
  PersistReq q;
};
template <int BN>
__device__ __forceinline__ PersistWalk persist_start(const TreeAttnParams& p, int n_g, int grp) {
  PersistWalk w;
  w.T = persist_total<BN>(p);
  w.ng = min(n_g, max(1, w.T / kPersistMinTiles));
  w.a = grp < w.ng ? persist_range_start(grp, w.T, w.ng) : w.T;
  w.b = grp < w.ng ? persist_range_start(grp + 1, w.T, w.ng) : w.T;
  w.r = p.batch;
  w.h = 0;
  w.ub = w.T;
  if (w.a < w.b) {
    int begin;
    w.r = persist_find<BN>(p, w.a, begin);
    w.q = persist_req<BN>(p, w.r);
    w.h = (w.a - begin) / w.q.tiles;
    w.ub = begin + w.h * w.q.tiles;
  }
  return w;
}
__device__ __forceinline__ bool persist_more(const PersistWalk& w) {
  return w.ub < w.b;  // past the last request ub is T >= b
}
template <int BN>
__device__ __forceinline__ void persist_next(const TreeAttnParams& p, PersistWalk& w) {
  w.ub += w.q.tiles;
  if (++w.h < p.hkv) return;
  w.h = 0;
  if (++w.r < p.batch) w.q = persist_req<BN>(p, w.r);
}

// The current unit's segment for row block mb: its keys [kv_begin, kv_stop) (n_tiles tiles,
// 0: nothing for this row block), its rows, and how the unit is cut: n_pieces ranges hold
// it, the first in group g0; slot 1 if this segment is not its range's first.
struct PersistSeg {
  int kv_begin, kv_stop, n_tiles, m0, rows, g0, n_pieces, slot, slot0;  // slot0: g0's piece's
};
template <int BN>
__device__ __forceinline__ PersistSeg persist_seg(const PersistWalk& w, int mb, int G) {
  PersistSeg s;
  s.n_tiles = 0;
  s.m0 = mb * 128;
  s.rows = w.q.nodes * G;
  if (s.m0 >= s.rows) return s;
  const int node_hi = min(w.q.nodes, (s.m0 + 127) / G + 1);  // keys the block's rows can see
  const int keys = w.q.rk.prefix + node_hi;
  const int eff = (keys + BN - 1) / BN;
  const int lo = max(w.a, w.ub) - w.ub, hi = min(w.b, w.ub + eff) - w.ub;
  if (lo >= hi) return s;
  s.kv_begin = lo * BN;
  s.kv_stop = min(keys, hi * BN);
  s.n_tiles = hi - lo;
  s.g0 = persist_group(w.ub, w.T, w.ng);
  s.n_pieces = persist_group(w.ub + eff - 1, w.T, w.ng) - s.g0 + 1;
  s.slot = w.a < w.ub ? 1 : 0;
  s.slot0 = persist_range_start(s.g0, w.T, w.ng) < w.ub ? 1 : 0;  // the rule for g0's piece
  return s;
}

// A cut unit's pieces merged into `out` by the 256 consumer threads (ct: 0..255): piece j of
// row i is partial row (slot_j x CTAs + (g0 + j) x M + mb) x 128 + i, slot_0 = whether group g0's
// range starts before the unit, slot_j = 0 after.
template <int D, bool BF16>
__device__ __forceinline__ void persist_merge(const TreeAttnParams& p, int ct, int g0, int n,
                                              bool slot0, int M, int mb, int m0, int rows,
                                              int qo0, int kvh) {
  // Eight rows' loads in flight a thread, a piece a round (two passes over 128 rows at D =
  // 128): with two rows x eight pieces (the split merge's shape) a 128-row merge of 2-3 pieces
  // was eight passes of dependent L2 round trips at the CTA's end (v23's first measurement).
  // Sixteen rows spill.
  constexpr int CH = D / 4, I = 8, U = 1;
  const int G = p.group, total = min(128, rows - m0) * CH;
  const long long base0 = ((long long)g0 * M + mb) * 128;
  const long long first_off = slot0 ? (long long)gridDim.x * 128 : 0;
  for (int idx0 = ct; idx0 < total; idx0 += I * 256) {
    long long base[I];
    int c[I], tok[I], head[I];
#pragma unroll
    for (int i = 0; i < I; ++i) {
      const int idx = idx0 + i * 256, r = min(idx, total - 1) / CH, row = m0 + r;
      c[i] = (idx % CH) * 4;
      tok[i] = qo0 + row / G;
      head[i] = kvh * G + row % G;
      base[i] = idx < total ? base0 + r : -1;
    }
    float4 o[I];
    merge_splits4<D, I, U>(p, base, n, c, o, (long long)M * 128, first_off);
#pragma unroll
    for (int i = 0; i < I; ++i)
      if (base[i] >= 0) store_out4<BF16>(p, tok[i], head[i], c[i], o[i]);
  }
}

template <int D, int BN, int STAGES, bool BF16, int PRODUCER>
__device__ __forceinline__ void gqa_pp_persist_body(const TreeAttnParams& p) {
  using C = GqaPpCfg<D, BN, STAGES>;
  static_assert(PRODUCER == kProducerShared || PRODUCER == kProducerOwnRows ||
                    PRODUCER == kProducerAuto,
                "the cp.async producers");
  constexpr int SMEM_BYTES = C::SMEM_BYTES + C::Q_BYTES;  // a second Q buffer
  // The walk's state costs the producer registers: 104 (the ping-pong kernel's 56 spilled
  // 280-456 B here, 88 still 88 B at D = 128) and 200 a consumer, no spill at D = 64 or 128.
  constexpr int PRODUCER_REGS = 104;
  constexpr int CONSUMER_REGS = (3 * C::LAUNCH_REGS - PRODUCER_REGS) / 2;
  static_assert(PRODUCER_REGS % 8 == 0 && CONSUMER_REGS % 8 == 0, "setmaxnreg counts");
#ifdef TV_EXPECT_SMEM  // the launcher's byte count (variants.py) must match this layout
  static_assert(SMEM_BYTES == TV_EXPECT_SMEM, "variants.py smem_bytes out of date");
#endif
  using T = unsigned short;
  extern __shared__ unsigned char smem_raw[];
  __shared__ int s_pend[2][6];  // the cut units this CTA counts at its end (consumer 0 writes)
  __shared__ int s_last;
  const unsigned raw_u32 = smem_u32(smem_raw);
  unsigned char* base = smem_raw + (((raw_u32 + 1023u) & ~1023u) - raw_u32);
  unsigned char* sQ = base;                       // [2][128 x D]
  unsigned char* sK = sQ + 2 * C::Q_BYTES;        // [STAGES][BN x D]
  unsigned char* sV = sK + STAGES * C::T_BYTES;   // [STAGES][BN x D]
  const T** sRowK = reinterpret_cast<const T**>(sV + STAGES * C::T_BYTES);  // [STAGES][BN]
  const T** sRowV = sRowK + STAGES * BN;                                      // [STAGES][BN]
  const unsigned full0 = smem_u32(sRowV + STAGES * BN);  // [STAGES] mbarriers, 8 B each
  const unsigned empty0 = full0 + 8 * STAGES;            // [STAGES]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wg = __shfl_sync(0xffffffffu, warp >> 2, 0), wi = warp & 3;  // warp-uniform role
  const int g = lane >> 2, tq = lane & 3;
  const int G = p.group, M = p.persist_m, n_g = static_cast<int>(gridDim.x) / M;
  const int grp = static_cast<int>(blockIdx.x) / M, mb = static_cast<int>(blockIdx.x) % M;

  zero_padding_rows<D>(p);
  // Each role walks its range itself, after its register reallocation (state live across that
  // spills); a CTA whose range is empty (fewer tiles than groups) walks nothing and leaves.

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full0 + 8 * s, 128);   // the producer's threads, through cp.async
      mbar_init(empty0 + 8 * s, 256);  // the consumers' threads
    }
  }
  __syncthreads();

  if (wg == 0) {  // ---- producer: each segment's Q, then its K/V tiles, through the ring
    setmaxnreg_dec<PRODUCER_REGS>();
    PersistWalk w = persist_start<BN>(p, n_g, grp);
    const T* kg = static_cast<const T*>(p.k);
    bool own_rows = PRODUCER == kProducerOwnRows;
    if constexpr (PRODUCER == kProducerAuto) own_rows = batch_keys(p) <= kAutoDirectMaxKeys;
    int j = 0, nseg = 0, q_last0 = -1, q_last1 = -1;  // tiles issued; each Q buffer's last tile
    for (; persist_more(w); persist_next<BN>(p, w)) {
      const PersistSeg s = persist_seg<BN>(w, mb, G);
      if (s.n_tiles == 0) continue;
      const int qb = nseg & 1, e = qb ? q_last1 : q_last0;  // scalars: no local array
      // Q buffer qb was last read by tile e's QK. Tiles before j - STAGES are known consumed
      // (their slots were waited for); a later e needs its own wait, exact by parity: tile e
      // + STAGES is not issued yet, so its slot's barrier is at most one phase past tile e's.
      if (e >= 0 && e >= j - STAGES) mbar_wait(empty0 + 8 * (e % STAGES), (e / STAGES) & 1);
      const int P = w.q.rk.prefix, qo0 = w.q.qo0, kvh = w.h;
      load_q_tile<128, C::CH, 128>(sQ + qb * C::Q_BYTES, p, s.m0, s.rows, qo0, kvh, G);
      if (own_rows) {  // two threads a row, each its own lookup (v15)
        const int r = tid >> 1, h = tid & 1;
        PageFetch next = fetch_page(p, w.q.rk, P, s.kv_begin + r, s.kv_stop);
        for (int t = 0; t < s.n_tiles; ++t, ++j) {
          const int slot = j % STAGES;
          if (j >= STAGES) mbar_wait(empty0 + 8 * slot, ((j / STAGES) - 1) & 1);
          const T* kp;
          const T* vp;
          publish_rows<T>(p, next, P, qo0, kvh, s.kv_stop, &kp, &vp);
          if (t + 1 < s.n_tiles)
            next = fetch_page(p, w.q.rk, P, s.kv_begin + (t + 1) * BN + r, s.kv_stop);
          copy_own_row<D, BN>(sK + slot * C::T_BYTES, sV + slot * C::T_BYTES, kp, vp, kg, r, h);
          cp_async_mbar_arrive(full0 + 8 * slot);
        }
      } else {  // row pointers through shared memory, whole rows a copy instruction (v14)
        PageFetch next;
        if (tid < BN) next = fetch_page(p, w.q.rk, P, s.kv_begin + tid, s.kv_stop);
        for (int t = 0; t < s.n_tiles; ++t, ++j) {
          const int slot = j % STAGES;
          if (j >= STAGES) mbar_wait(empty0 + 8 * slot, ((j / STAGES) - 1) & 1);
          if (tid < BN) {
            publish_rows<T>(p, next, P, qo0, kvh, s.kv_stop, &sRowK[slot * BN + tid],
                            &sRowV[slot * BN + tid]);
            if (t + 1 < s.n_tiles)
              next = fetch_page(p, w.q.rk, P, s.kv_begin + (t + 1) * BN + tid, s.kv_stop);
          }
          named_sync(kPpProducer, 128);
          copy_shared_rows<D, BN>(sK + slot * C::T_BYTES, sV + slot * C::T_BYTES,
                                  sRowK + slot * BN, sRowV + slot * BN, kg, tid);
          cp_async_mbar_arrive(full0 + 8 * slot);
        }
      }
      (qb ? q_last1 : q_last0) = j - 1;
      ++nseg;
    }
    cp_async_wait<0>();  // nothing in flight when the warps exit
    return;
  }

  // ---- consumers: 64 rows each, MMAs issued in turns, segment after segment
  setmaxnreg_inc<CONSUMER_REGS>();
  PersistWalk w = persist_start<BN>(p, n_g, grp);
  const int c = wg - 1, ct = tid - 128;
  const int my_turn = c == 0 ? kPpTurn0 : kPpTurn1, other_turn = c == 0 ? kPpTurn1 : kPpTurn0;
  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  float m_run[2] = {-TV_INF, -TV_INF};
  float l_run[2] = {0.f, 0.f};
  unsigned pa[BN / 16][4];  // P of the previous tile (0 before the first: see the ping-pong kernel)
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) pa[kk][0] = pa[kk][1] = pa[kk][2] = pa[kk][3] = 0u;
  const int r0 = c * 64 + 16 * wi + g;  // row within the 128-row block (and + 8)
  const int m0 = mb * 128;
  // The previous segment, finished at the next one's first tile (or after the loop), packed
  // (registers are short here): its rows, first token, unit (request x KV heads + head), first
  // piece's group, and n_pieces x 4 + slot x 2 + slot0.
  int prev_rows = 0, prev_qo0 = 0, prev_unit = 0, prev_g0 = 0, prev_cut = 0, n_pend = 0;
  // Store the previous segment's O: to out (a whole unit) or to this CTA's slot (a cut one,
  // counted and maybe merged at the CTA's end).
  auto finish = [&](const float (&m)[2], const float (&l)[2]) {
    const int n_pieces = prev_cut >> 2;
    if (n_pieces == 1) {
      gqa_store_rows<D, BF16>(p, o, m, l, m0 + r0, prev_rows, prev_qo0, prev_unit % p.hkv, G, 0,
                              1, tq);
      return;
    }
    const float l_tot[2] = {quad_sum(l[0]), quad_sum(l[1])};
    const long long slot_row0 = ((long long)((prev_cut >> 1) & 1) * gridDim.x + blockIdx.x) * 128;
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (m0 + r0 + 8 * h < prev_rows)
        store_partial_row<D>(p, o, h, slot_row0 + r0 + 8 * h, m[h], l_tot[h], tq);
    if (ct == 0 && n_pend < 2) {  // a range's first and last segment, at most
      int* e = s_pend[n_pend];
      e[0] = prev_unit, e[1] = prev_qo0, e[2] = prev_rows, e[3] = prev_g0, e[4] = n_pieces;
      e[5] = prev_cut & 1;
    }
    ++n_pend;
  };
  auto issue_pv = [&](int tile) {
    issue_pv64<D, BN, BF16>(o, pa, smem_u32(sV + (tile % STAGES) * C::T_BYTES));
    wg_commit();
  };
  int it = 0, nseg = 0;
  for (; persist_more(w); persist_next<BN>(p, w)) {
    const PersistSeg sg = persist_seg<BN>(w, mb, G);
    if (sg.n_tiles == 0) continue;
    const int P = w.q.rk.prefix, qo0 = w.q.qo0;
    const unsigned q_addr = smem_u32(sQ + (nseg & 1) * C::Q_BYTES) + c * 64 * 128;
    // One tile; FIRST: a segment's first tile, which also finishes the previous segment
    // (instantiated twice, so the loop over the other tiles stays as lean as the ping-pong
    // kernel's: with the store inside it, its code was ~45% longer).
    auto tile = [&](int t, auto first) {
      const int slot = it % STAGES;
      mbar_wait(full0 + 8 * slot, (it / STAGES) & 1);
      fence_async_smem();  // the producer's cp.async writes -> the tensor cores' reads
      const unsigned k_addr = smem_u32(sK + slot * C::T_BYTES);
      float s[32];
      if (first && c == 1 && it == 0) named_arrive(kPpTurn0, 256);  // consumer 0 issues first
      named_sync(my_turn, 256);
      wg_fence();
      issue_qk64<D, BN, 128, BF16>(s, q_addr, k_addr);
      wg_commit();
      issue_pv(it > 0 ? it - 1 : 0);  // the previous tile's PV, maybe the previous segment's
      named_arrive(other_turn, 256);
      wg_wait1();
      pin(s);
      const bool seg_start = first && nseg > 0;
      float m_prev[2] = {m_run[0], m_run[1]}, l_prev[2] = {l_run[0], l_run[1]};
      if (seg_start) {
        m_run[0] = m_run[1] = -TV_INF;  // alpha = 0 below: O starts over after the store
        l_run[0] = l_run[1] = 0.f;
      }
      float alpha[2];
      tile_softmax<BN / 8>(s, p, sg.kv_begin + t * BN, tq, m0 + r0, P, sg.kv_stop, sg.rows, qo0,
                           G, m_run, l_run, alpha);
      wg_wait0();  // PV of the previous tile done: o final if a segment just ended
      pin(o);
      if (seg_start) finish(m_prev, l_prev);
      if (it > 0) mbar_arrive(empty0 + 8 * ((it - 1) % STAGES));
      rescale_rows(o, alpha);
      pack_p_frags<BN / 8, BF16>(s, pa);
      ++it;
    };
    tile(0, true_type{});
    for (int t = 1; t < sg.n_tiles; ++t) tile(t, false_type{});
    prev_rows = sg.rows, prev_qo0 = qo0, prev_unit = w.r * p.hkv + w.h, prev_g0 = sg.g0;
    prev_cut = sg.n_pieces * 4 + sg.slot * 2 + sg.slot0;
    ++nseg;
  }
  if (it > 0) {  // the last tile's PV, in turn like the others
    named_sync(my_turn, 256);
    wg_fence();
    issue_pv(it - 1);
    if (c == 0) named_arrive(other_turn, 256);
    wg_wait0();
    pin(o);
    finish(m_run, l_run);
  }
  TV_TRACE_MARK(ct == 0, 3);  // scripts/cta_trace.py: this CTA's tiles done (merges follow)
  // The cut units' counts: the last piece of each merges it (the partials reach L2 first).
  for (int k = 0; k < n_pend; ++k) {
    __threadfence();
    named_sync(kPpConsumers, 256);
    const int* e = s_pend[k];
    if (ct == 0) {
      unsigned* ctr = p.split_counters + (long long)e[0] * M + mb;
      const unsigned before = atomicAdd(ctr, 1u);
      s_last = before == static_cast<unsigned>(e[4] - 1);
      if (s_last) *ctr = 0u;  // every piece has counted: ready for the next launch
    }
    named_sync(kPpConsumers, 256);
    if (s_last) {
      __threadfence();  // order the partial reads after the count that said they are complete
      persist_merge<D, BF16>(p, ct, e[3], e[4], e[5] != 0, M, mb, m0, e[2], e[1], e[0] % p.hkv);
    }
  }
}

template <int D, int BN, int STAGES, bool BF16, int PRODUCER>
__global__ void __launch_bounds__(384, 1)
    tree_attn_gqa_pp_persist_sm90(const __grid_constant__ TreeAttnParams p) {
  cta_trace_begin(false);  // word 3: when the CTA's tiles were done, not its block index
  gqa_pp_persist_body<D, BN, STAGES, BF16, PRODUCER>(p);
  cta_trace_end();
}

}  // namespace treeverify
