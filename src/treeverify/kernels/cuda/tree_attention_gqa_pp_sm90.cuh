// sm_90a GQA tree-verify kernel, warp-specialised ("pingpong"; TREEVERIFY_CUDA_GQA_SCHEDULE=
// pingpong-auto, the default since v20, and the other ping-pong schedules below; 128-row CTAs;
// v14: 1.12x on the grid's GQA N=64 cases, H200, 34d9489). Included by tree_attention.cu
// after tree_attention_gqa_sm90.cuh, whose work decomposition, split rule, masking and outputs
// it keeps.
//
// Why: the tile schedule (tree_attn_gqa_sm90) runs QK -> softmax -> PV serially in each
// warpgroup and ends every tile with a CTA barrier; on the GQA N=64 cases ncu put 19% of the
// samples on that barrier and the tensor pipe at 34% (docs/performance.md, twelfth session).
// Here:
// - warpgroup 0 is a producer: it loads Q and the K/V tiles (page lookups, cp.async) into
//   STAGES slots, each guarded by a "full" mbarrier (the producer's 128 threads arrive through
//   cp.async.mbarrier.arrive once their copies land) and an "empty" one (the 256 consumer
//   threads arrive once the slot's V has been read);
// - warpgroups 1 and 2 each own 64 rows and take turns (two named barriers) issuing their
//   MMAs: QK of tile j together with PV of tile j-1, so one warpgroup's softmax runs while
//   the other's MMAs keep the tensor pipe busy. No CTA-wide barrier inside the loop;
// - how the producer finds and copies each KV row is a template choice (PRODUCER; the
//   measurements and the ncu profiles behind each are in docs/performance.md, seventeenth and
//   eighteenth sessions):
//   kProducerShared ("pingpong", v14): 64 threads publish row pointers in shared memory, a
//     producer barrier, then whole-row cp.async copies;
//   kProducerOwnRows ("pingpong-direct", v15): two threads a row look its page up themselves
//     and copy alternate 16-byte chunks, pointers in registers (1.03-1.13x on small batches,
//     0.47-0.94x on large ones: 32 bytes of 16 rows an instruction cost DRAM efficiency);
//   kProducerAuto ("pingpong-auto", v20, the default): OwnRows on batches of at most
//     kAutoDirectMaxKeys keys, Shared above, chosen per launch from the batch's lengths, so
//     one captured graph serves both (grid 1.00x, SGLang's GQA batch path 1.10-1.22x);
//   kProducerShuffle ("pingpong-shfl", v16, 1.02x): each warp looks its 16 rows up and hands
//     the pointers over by shuffles, Shared's whole-row copies kept;
//   kProducerTma ("pingpong-tma", v17, 1.01x; entry tree_attn_gqa_pp_tma_sm90): whole tiles of
//     paged keys by TMA, a box a page (or 64 rows of a larger one) and 64-column half, from
//     the tensor maps kernels/cuda/tma.py encodes (p.tma_rows: the box rows, 0 for none);
//     tiles reaching SGLang's extend buffers or the split's end go the Shared way;
// - MC ("pingpong-tma2", v19, 0.93x): the two 128-row CTAs of a KV head as a 2-CTA cluster,
//   rank 0 multicasting each TMA tile's K boxes and rank 1 its V boxes into both; a slot is
//   refilled once both CTAs' consumers freed it (`peer_empty`, arrived on remotely);
// - Q_REGS (TREEVERIFY_CUDA_GQA_Q_REGS=1, v18, 1.01x): Q's fragments loaded into registers once
//   and QK issued as register-A wgmma, half of QK's shared-memory reads;
// - H = 2 (v21; the default's wide shape, TREEVERIFY_CUDA_GQA_256=auto|1, auto by default):
//   256-row CTAs, each consumer warpgroup 128 rows as two halves
//   (gqa_pp256_consumers.cuh), the OwnRows producer (the Shared one spills in the 40
//   registers left to it); one KV tile serves twice the rows;
// - setmaxnreg moves registers from the producer (56) to the consumers (224); the launch must
//   give every thread exactly 168 (384 threads, one CTA an SM), which a CPU test checks.
#pragma once

namespace treeverify {

// The kernel's body; `tmk` / `tmv` (kProducerTma only): the K and V pools' tensor maps; H:
// 64-row halves a consumer warpgroup owns (2: the 256-row CTA, gqa_pp256_consumers.cuh).
template <int D, int BN, int STAGES, bool BF16, int PRODUCER, bool Q_REGS, bool MC, int H = 1>
__device__ __forceinline__ void gqa_pp_body(const TreeAttnParams& p, const TmaDesc* tmk,
                                            const TmaDesc* tmv) {
  using C = GqaPpCfg<D, BN, STAGES, H>;
  static_assert(H == 1 || (PRODUCER != kProducerTma && !Q_REGS && !MC),
                "the 256-row CTA takes the cp.async producers, Q from shared memory");
#ifdef TV_EXPECT_SMEM  // the launcher's byte count (variants.py) must match this layout
  static_assert(C::SMEM_BYTES == TV_EXPECT_SMEM, "variants.py smem_bytes out of date");
#endif
  constexpr int BM = C::BM;
  using T = unsigned short;
  extern __shared__ unsigned char smem_raw[];
  const unsigned raw_u32 = smem_u32(smem_raw);
  unsigned char* base = smem_raw + (((raw_u32 + 1023u) & ~1023u) - raw_u32);
  unsigned char* sQ = base;
  unsigned char* sK = sQ + C::Q_BYTES;           // [STAGES][BN x D]
  unsigned char* sV = sK + STAGES * C::T_BYTES;  // [STAGES][BN x D]
  const T** sRowK = reinterpret_cast<const T**>(sV + STAGES * C::T_BYTES);  // [STAGES][BN]
  const T** sRowV = sRowK + STAGES * BN;                                      // [STAGES][BN]
  const unsigned full0 = smem_u32(sRowV + STAGES * BN);  // [STAGES] mbarriers, 8 B each
  const unsigned empty0 = full0 + 8 * STAGES;            // [STAGES]
  const unsigned peer_empty0 = empty0 + 8 * STAGES;      // [STAGES], MC only

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // The warpgroup's role, visibly warp-uniform to the compiler (a shuffle from lane 0): a
  // role branch it cannot prove uniform makes it serialise every wgmma behind it (C7519).
  const int wg = __shfl_sync(0xffffffffu, warp >> 2, 0), wi = warp & 3;
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
  TV_TRACE_MARK(tid == 0 && n_tiles != -1, 8);
  // kProducerTma: tiles 0 .. n_tma - 1 (whole tiles of paged keys below the split's end and,
  // with MC or SGLang's extend buffers, below the tree: then both CTAs of a pair agree on it)
  // come by TMA. MC pairs share them when both CTAs have rows (uniform over the cluster).
  int n_tma = 0;
  bool mc = false;
  unsigned rank = 0;
  if constexpr (PRODUCER == kProducerTma) {
    if (p.tma_rows > 0) {
      mc = MC && rows > ((static_cast<int>(blockIdx.x) | 1) * BM);
      const int lim = (p.k_ext != nullptr || mc) ? min(P, kv_stop) : kv_stop;
      n_tma = min(n_tiles, max(0, (lim - kv_begin) / BN));
    }
    if (mc) rank = cluster_rank();
  }

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full0 + 8 * s, 128);   // the producer's threads, through cp.async
      mbar_init(empty0 + 8 * s, 256);  // the consumers' threads
      if (mc) mbar_init(peer_empty0 + 8 * s, 256);  // the partner's consumers, 32 a warp
    }
#ifdef TV_CTA_TRACE  // Q's own barrier (mark 14): a slot only MC uses
    if (!mc) mbar_init(peer_empty0, 128);
#endif
    if (mc) asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  // Barriers initialised before anyone (with MC: either CTA) arrives on or waits for them.
  if (mc) cluster_sync_all();
  else __syncthreads();
  TV_TRACE_MARK(tid == 0, 9);

  if (wg == 0) {  // ---- producer: Q, then the K/V tiles into STAGES slots
    setmaxnreg_dec<C::PRODUCER_REGS>();
    const T* kg = static_cast<const T*>(p.k);
    // Q lands with tile 0's copies; 128-row blocks (H of them), each in its own layout.
#pragma unroll
    for (int qb = 0; qb < H; ++qb)
      load_q_tile<128, C::CH, 128>(sQ + qb * C::Q_BLOCK_BYTES, p, m0 + qb * 128, rows, qo0, kvh,
                                   G);
    TV_TRACE_MARK(tid == 0, 10);
#ifdef TV_CTA_TRACE
    if (!mc) cp_async_mbar_arrive(peer_empty0);  // when Q's copies land (mark 14)
#endif
    bool own_rows = PRODUCER == kProducerOwnRows;
    if constexpr (PRODUCER == kProducerAuto) {
      const int keys = batch_keys(p);
      own_rows = keys <= kAutoDirectMaxKeys;
      TV_TRACE_MARK(tid == 0 && keys != -1, 11);
    }
    if constexpr (PRODUCER == kProducerShuffle) {
      // A warp instruction copies RPW whole rows (CH threads a row); over its STEPS steps warp w
      // copies rows w * RPW + g + STEP_ROWS * k (g = lane / CH), 16 rows. Lane l owns one of
      // them (l & 15 picks it; lanes 0-15 hand out K pointers, 16-31 V ones), so the row a lane
      // copies in step k is owned by lane g + RPW * k (+16 for V). Every row a lane copies has
      // the same swizzle (STEP_ROWS is a multiple of 8): destinations differ by immediates.
      constexpr int RPW = 32 / C::CH, STEP_ROWS = 128 / C::CH, STEPS = BN * C::CH / 128;
      static_assert(RPW * STEPS == 16 && STEP_ROWS % 8 == 0, "16 rows a warp, fixed swizzle");
      const int w = tid >> 5, lane = tid & 31, g = lane / C::CH, c = lane % C::CH;
      const int own = w * RPW + (lane & 15) % RPW + STEP_ROWS * ((lane & 15) / RPW);
      const unsigned dst0 = sw_off<BN>(w * RPW + g, c);
      PageFetch next = fetch_page(p, rk, P, kv_begin + own, kv_stop);
      for (int j = 0; j < n_tiles; ++j) {
        const int slot = j % STAGES;
        if (j >= STAGES) mbar_wait(empty0 + 8 * slot, ((j / STAGES) - 1) & 1);
        const T* kp;
        const T* vp;
        publish_rows<T>(p, next, P, qo0, kvh, kv_stop, &kp, &vp);
        const unsigned long long mine = reinterpret_cast<unsigned long long>(lane < 16 ? kp : vp);
        if (j + 1 < n_tiles) next = fetch_page(p, rk, P, kv_begin + (j + 1) * BN + own, kv_stop);
        unsigned char* dk = sK + slot * C::T_BYTES + dst0;
        unsigned char* dv = sV + slot * C::T_BYTES + dst0;
#pragma unroll
        for (int k = 0; k < STEPS; ++k) {
          const T* kr = reinterpret_cast<const T*>(__shfl_sync(0xffffffffu, mine, g + RPW * k));
          const T* vr =
              reinterpret_cast<const T*>(__shfl_sync(0xffffffffu, mine, 16 + g + RPW * k));
          cp_async16(dk + k * STEP_ROWS * 128, kr ? kr + c * 8 : kg, kr ? 16 : 0);
          cp_async16(dv + k * STEP_ROWS * 128, vr ? vr + c * 8 : kg, vr ? 16 : 0);
        }
        cp_async_mbar_arrive(full0 + 8 * slot);
      }
    } else if (own_rows) {  // kProducerOwnRows, or kProducerAuto on a small batch
      static_assert(2 * BN == 128 && C::CH % 2 == 0, "two producer threads a row");
      const int r = tid >> 1, h = tid & 1;
      PageFetch next = fetch_page(p, rk, P, kv_begin + r, kv_stop);
      for (int j = 0; j < n_tiles; ++j) {
        const int slot = j % STAGES;
        if (j >= STAGES) mbar_wait(empty0 + 8 * slot, ((j / STAGES) - 1) & 1);
        const T* kp;
        const T* vp;
        publish_rows<T>(p, next, P, qo0, kvh, kv_stop, &kp, &vp);
        TV_TRACE_MARK(j == 0 && tid == 0 && kp != vp, 12);
        // The next tile's lookup in flight while this one is copied and its slot frees up.
        if (j + 1 < n_tiles) next = fetch_page(p, rk, P, kv_begin + (j + 1) * BN + r, kv_stop);
        copy_own_row<D, BN>(sK + slot * C::T_BYTES, sV + slot * C::T_BYTES, kp, vp, kg, r, h);
        cp_async_mbar_arrive(full0 + 8 * slot);
        TV_TRACE_MARK(j == 0 && tid == 0, 4);
      }
    } else {  // kProducerShared (Auto on a large batch); kProducerTma after its TMA tiles
      int j0 = 0;
      if constexpr (PRODUCER == kProducerTma)
      {  // kProducerTma's first tiles by TMA (gqa_pp_tma_producer.cuh)
        j0 = tma_tiles<D, BN, STAGES>(p, rk, n_tma, kvh, kv_begin, sK, sV, full0, empty0, tmk,
                                      tmv, mc, rank, peer_empty0);
        // Warp 0 waited for every slot in order: the cp.async path's own waits, from tile
        // n_tma on, then see each empty barrier at most one phase behind (a parity wait is
        // exact there).
        if (j0 > 0) named_sync(kPpProducer, 128);
      }
      PageFetch next;
      if (tid < BN) next = fetch_page(p, rk, P, kv_begin + j0 * BN + tid, kv_stop);
      for (int j = j0; j < n_tiles; ++j) {
        const int slot = j % STAGES;
        if (j >= STAGES) mbar_wait(empty0 + 8 * slot, ((j / STAGES) - 1) & 1);
        if (tid < BN) {
          publish_rows<T>(p, next, P, qo0, kvh, kv_stop, &sRowK[slot * BN + tid],
                          &sRowV[slot * BN + tid]);
          // The next tile's page lookup in flight while this one is copied and the next slot
          // frees up.
          if (j + 1 < n_tiles)
            next = fetch_page(p, rk, P, kv_begin + (j + 1) * BN + tid, kv_stop);
        }
        named_sync(kPpProducer, 128);  // tile j's row pointers published
        copy_shared_rows<D, BN>(sK + slot * C::T_BYTES, sV + slot * C::T_BYTES,
                                sRowK + slot * BN, sRowV + slot * BN, kg, tid);
        cp_async_mbar_arrive(full0 + 8 * slot);
        TV_TRACE_MARK(j == 0 && tid == 0, 4);
      }
    }
    cp_async_wait<0>();  // nothing in flight when the CTA moves on (n_tiles == 0: Q alone)
    setmaxnreg_inc<C::LAUNCH_REGS>();  // after the consumers gave theirs back (epilogue)
  } else if constexpr (H == 2) {  // ---- consumers: 128 rows each (gqa_pp256_consumers.cuh)
    setmaxnreg_inc<C::CONSUMER_REGS>();
    gqa_pp256_consume<D, BN, STAGES, BF16>(p, sQ, sK, sV, full0, empty0, wg - 1, m0, rows, qo0,
                                           kvh, G, P, kv_begin, kv_stop, n_tiles, split,
                                           n_splits);
    setmaxnreg_dec<C::LAUNCH_REGS>();
  } else {  // ---- consumers: 64 rows each, MMAs issued in turns
    setmaxnreg_inc<C::CONSUMER_REGS>();
    TV_TRACE_MARK(tid == 128, 13);
#ifdef TV_CTA_TRACE
    if (tid == 128 && !mc) {
      mbar_wait(peer_empty0, 0);
      TV_TRACE_MARK(true, 14);
    }
#endif
    const int c = wg - 1;
    const int my_turn = c == 0 ? kPpTurn0 : kPpTurn1, other_turn = c == 0 ? kPpTurn1 : kPpTurn0;
    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    float m_run[2] = {-TV_INF, -TV_INF};
    float l_run[2] = {0.f, 0.f};
    // P of the previous tile, the A fragments of its PV; zero before the first tile, whose
    // iteration then issues a PV of P = 0 against tile 0's V (landed, finite): the PV issue is
    // unconditional, since a wgmma behind a branch the compiler cannot prove warpgroup-uniform
    // serialises every wgmma (ptxas C7519).
    unsigned pa[BN / 16][4];
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) pa[kk][0] = pa[kk][1] = pa[kk][2] = pa[kk][3] = 0u;
    const unsigned q_addr = smem_u32(sQ) + c * 64 * 128;  // this warpgroup's 64 rows
    const int r0 = c * 64 + 16 * wi + g;                  // row within the CTA tile (and + 8)
    // Q_REGS: this warp's 16 rows of Q as wgmma A fragments, k-step kk in qa[kk] (the
    // mma.sync m16n8k16 A layout); Q lands with tile 0, so the first full barrier covers it.
    unsigned qa[Q_REGS ? D / 16 : 1][4];
    if constexpr (Q_REGS) {
      if (n_tiles > 0) {
        mbar_wait(full0, 0);
        const int qrow = c * 64 + 16 * wi + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
          ldsm_x4(qa[kk], sQ + sw_off<BM>(qrow, 2 * kk + (lane >> 4)));
      }
    }
    if (c == 1 && n_tiles > 0) named_arrive(kPpTurn0, 256);  // consumer 0 issues first
    auto issue_pv = [&](int tile) {
      issue_pv64<D, BN, BF16>(o, pa, smem_u32(sV + (tile % STAGES) * C::T_BYTES));
      wg_commit();
    };
    for (int it = 0; it < n_tiles; ++it) {
      const int slot = it % STAGES;
      mbar_wait(full0 + 8 * slot, (it / STAGES) & 1);
      TV_TRACE_MARK(it == 0 && tid == 128, 5);
      fence_async_smem();  // the producer's cp.async writes -> the tensor cores' reads
      const unsigned k_addr = smem_u32(sK + slot * C::T_BYTES);
      float s[32];  // 64 rows x 64 tokens per warpgroup
      named_sync(my_turn, 256);
      wg_fence();
      if constexpr (Q_REGS) {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          const unsigned long long db =
              sw128_desc(k_addr + (kk >> 2) * (BN * 128) + (kk & 3) * 32, 16, 1024);
          mma_qk64_rs<D, BF16>(s, qa[kk], db, kk > 0);
        }
      } else {
        issue_qk64<D, BN, BM, BF16>(s, q_addr, k_addr);
      }
      wg_commit();
      issue_pv(it > 0 ? it - 1 : 0);
      named_arrive(other_turn, 256);  // the other warpgroup issues while this one does softmax
      wg_wait1();  // S of tile it (PV of tile it-1 may still run)
      pin(s);

      float alpha[2];
      tile_softmax<BN / 8>(s, p, kv_begin + it * BN, tq, m0 + r0, P, kv_stop, rows, qo0, G, m_run,
                           l_run, alpha);
      wg_wait0();  // PV of tile it-1 done: o and pa free, its slot's V read
      pin(o);
      if (it > 0) {
        mbar_arrive(empty0 + 8 * ((it - 1) % STAGES));
        // MC: the partner refills this slot in both CTAs; tell it this warp is done with it.
        if (mc && it - 1 < n_tma && lane == 0)
          mbar_arrive_remote(peer_empty0 + 8 * ((it - 1) % STAGES), rank ^ 1u, 32);
      }
      rescale_rows(o, alpha);
      pack_p_frags<BN / 8, BF16>(s, pa);
    }
    if (n_tiles > 0) {  // the last tile's PV, in turn like the others
      named_sync(my_turn, 256);
      wg_fence();
      issue_pv(n_tiles - 1);
      if (c == 0) named_arrive(other_turn, 256);  // consumer 1 syncs once more; 0 does not
      wg_wait0();
      pin(o);
    }
    TV_TRACE_MARK(tid == 128, 6);

    gqa_store_rows<D, BF16>(p, o, m_run, l_run, m0 + r0, rows, qo0, kvh, G, split, n_splits,
                               tq);
    TV_TRACE_MARK(tid == 128, 7);
    setmaxnreg_dec<C::LAUNCH_REGS>();  // back to the launch's share for the merge below
  }
  // MC: neither CTA leaves while the other may still arrive on its barriers.
  if (mc) cluster_sync_all();
  if (n_splits > 1 && merged_in_forward<D>(p, n_splits, min(BM, rows - m0)))
    merge_tile_if_last<D, BF16>(p, qo0, kvh, m0, BM, rows, n_splits);
}

template <int D, int BN, int STAGES, bool BF16, int PRODUCER = kProducerShared,
          bool Q_REGS = false, int H = 1>
__global__ void __launch_bounds__(384, 1)
    tree_attn_gqa_pp_sm90(const __grid_constant__ TreeAttnParams p) {
  static_assert(PRODUCER != kProducerTma, "the TMA producer's entry is tree_attn_gqa_pp_tma_sm90");
  cta_trace_begin(true);
  gqa_pp_body<D, BN, STAGES, BF16, PRODUCER, Q_REGS, false, H>(p, nullptr, nullptr);
  cta_trace_end();
}

// MC: launched as 2-CTA clusters along x (kernels/cuda/launch.py), grid x even.
template <int D, int BN, int STAGES, bool BF16, bool Q_REGS = false, bool MC = false>
__global__ void __launch_bounds__(384, 1)
    tree_attn_gqa_pp_tma_sm90(const __grid_constant__ TreeAttnParams p,
                              const __grid_constant__ TmaDesc tmk,
                              const __grid_constant__ TmaDesc tmv) {
  gqa_pp_body<D, BN, STAGES, BF16, kProducerTma, Q_REGS, MC>(p, &tmk, &tmv);
}

}  // namespace treeverify
