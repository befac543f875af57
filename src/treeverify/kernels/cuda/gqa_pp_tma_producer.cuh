// The GQA ping-pong kernel's TMA producer phase (schedules "pingpong-tma" / "pingpong-tma2" of
// tree_attention_gqa_pp_sm90.cuh). Included by tree_attention.cu after sm90_async.cuh.
#pragma once

namespace treeverify {

// kProducerTma's first phase, run by the whole producer warpgroup: tiles 0 .. n_tma - 1 (those
// whose keys all lie in the paged pool below the split's end) by TMA from warp 0; returns
// n_tma, where the cp.async path takes over once the caller has met its warpgroup at a named
// barrier. Lane l of warp 0 owns boxes l and l + 32 of a tile (a box: R = p.tma_rows rows of
// one page, one 64-column half), looks their pages up a tile ahead and issues them; lane 0
// tells the slot's full barrier the bytes to expect and arrives for the warpgroup (count 128).
// Tile 0 also carries Q (load_q_tile's cp.async): there every producer thread arrives through
// cp.async instead.
// MC (`mc` true for this cluster): each CTA issues half the boxes (rank 0 K, rank 1 V) into
// both CTAs, and refills a slot only once the partner's consumers freed it too (peer_empty0).
template <int D, int BN, int STAGES>
__device__ __forceinline__ int tma_tiles(const TreeAttnParams& p, const RequestKV& rk, int n_tma,
                                         int kvh, int kv_begin, unsigned char* sK,
                                         unsigned char* sV, unsigned full0, unsigned empty0,
                                         const TmaDesc* tmk, const TmaDesc* tmv, bool mc,
                                         unsigned rank, unsigned peer_empty0) {
  constexpr int T_BYTES = BN * D * 2;  // one K (or V) tile, GqaPpCfg::T_BYTES
  const int R = p.tma_rows;
  if (n_tma == 0) return 0;
  const int tid = threadIdx.x, lane = tid & 31;
  if (tid >= 32) {
    cp_async_mbar_arrive(full0);  // this thread's Q copies, with tile 0 (96 of the 128)
  } else {
    const int NB = BN / R, ps = p.page_size;  // boxes a tile (the host makes R divide BN)
    auto page_of = [&](int j, int i) -> int {
      if (i >= NB) return 0;
      const int pi = (kv_begin + j * BN + i * R) / ps;
      return p.bt_i64 ? static_cast<int>(
                            static_cast<const long long*>(p.block_table)[rk.row_off + pi])
                      : static_cast<const int*>(p.block_table)[rk.row_off + pi];
    };
    int pg0 = page_of(0, lane), pg1 = page_of(0, lane + 32);
    for (int j = 0; j < n_tma; ++j) {
      const int slot = j % STAGES;
      const unsigned full = full0 + 8 * slot;
      if (j >= STAGES) {
        mbar_wait(empty0 + 8 * slot, ((j / STAGES) - 1) & 1);
        if (mc) mbar_wait<true>(peer_empty0 + 8 * slot, ((j / STAGES) - 1) & 1);
      }
      const int cur0 = pg0, cur1 = pg1;
      if (j + 1 < n_tma) {  // the next tile's pages in flight while this one is issued
        pg0 = page_of(j + 1, lane);
        pg1 = page_of(j + 1, lane + 32);
      }
      if (lane == 0) mbar_expect_tx(full, 2 * T_BYTES);
      __syncwarp();
      const unsigned dk = smem_u32(sK + slot * T_BYTES), dv = smem_u32(sV + slot * T_BYTES);
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int i = lane + 32 * u;
        if (i < NB) {
          const int t = kv_begin + j * BN + i * R;
          const int in_page = t % ps, page = u == 0 ? cur0 : cur1;
#pragma unroll
          for (int h = 0; h < D / 64; ++h) {  // rows i*R.. of the tile's 64-column half h
            const unsigned off = h * (BN * 128) + i * R * 128;
            if (!mc) {
              tma_load_4d(dk + off, tmk, full, h * 64, kvh, in_page, page);
              tma_load_4d(dv + off, tmv, full, h * 64, kvh, in_page, page);
            } else if (rank == 0) {
              tma_load_4d_mc(dk + off, tmk, full, h * 64, kvh, in_page, page, 3);
            } else {
              tma_load_4d_mc(dv + off, tmv, full, h * 64, kvh, in_page, page, 3);
            }
          }
        }
      }
      __syncwarp();
      if (j == 0) cp_async_mbar_arrive(full);  // with this lane's Q copies (32 of the 128)
      else if (lane == 0) mbar_arrive_count(full, 128);
    }
  }
  return n_tma;  // the caller meets its producer warpgroup at a named barrier next
}

}  // namespace treeverify
