// The consumers of the GQA ping-pong kernel's 256-row CTA (v21: a shape of the default
// schedule, TREEVERIFY_CUDA_GQA_256=auto, the default, takes it where batch x KV heads fill
// the GPU's SMs; gqa_pp_body with H = 2,
// tree_attention_gqa_pp_sm90.cuh). Included by
// tree_attention.cu after gqa_pp_common.cuh.
//
// Why: every 128-row GQA kernel we have takes in ~13-16 B of KV a cycle an SM, whichever
// producer feeds it (cp.async, TMA, multicast; docs/performance.md, eighteenth session), and a
// 128-row tile needs ~30 B a cycle to keep the tensor cores busy. One KV tile serving 256 rows
// (a tree of 64 nodes x 4 query heads: one CTA a KV head) halves the bytes a FLOP needs.
//
// Each consumer warpgroup owns 128 rows as two 64-row halves (h). A turn on the tensor pipe is
// the 128-row kernel's, at half granularity: QK of one half with PV of the other half's last
// P, so each turn issues the same MMAs (64 x 64 x D, then 64 x D x 64) and the softmax of one
// half runs while the other warpgroup's turn keeps the tensor pipe busy. Per tile a warpgroup
// takes two turns: [QK h0(t), PV h1(t-1)], [QK h1(t), PV h0(t)]; one turn more ends it (PV
// h1 of the last tile). Live fragments: O of both halves (2 x D/2), one S (32), one P (16).
#pragma once

namespace treeverify {

// Consumer warpgroup c (0 or 1) of a 256-row CTA: rows c * 128 + h * 64 + (16 wi + g, + 8) of
// the tile at m0; the K/V tiles the producer fills into STAGES slots (full / empty mbarriers).
template <int D, int BN, int STAGES, bool BF16>
__device__ __forceinline__ void gqa_pp256_consume(const TreeAttnParams& p,
                                                  const unsigned char* sQ,
                                                  const unsigned char* sK,
                                                  const unsigned char* sV, unsigned full0,
                                                  unsigned empty0, int c, int m0, int rows,
                                                  int qo0, int kvh, int G, int P, int kv_begin,
                                                  int kv_stop, int n_tiles, int split,
                                                  int n_splits) {
  using C = GqaPpCfg<D, BN, STAGES, 2>;
  const int tid = threadIdx.x, lane = tid & 31, wi = (tid >> 5) & 3;
  const int g = lane >> 2, tq = lane & 3;
  const int my_turn = c == 0 ? kPpTurn0 : kPpTurn1, other_turn = c == 0 ? kPpTurn1 : kPpTurn0;
  float o0[D / 2], o1[D / 2];  // O of half 0 and half 1
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o0[i] = o1[i] = 0.f;
  float m_run[2][2] = {{-TV_INF, -TV_INF}, {-TV_INF, -TV_INF}};
  float l_run[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
  // P of each half's last tile, the A fragments of its PV; zero before the first tile, so the
  // first turn's PV (half 1 of "tile -1") adds nothing (P = 0 against tile 0's landed, finite
  // V): the PV issue stays unconditional (a wgmma behind a branch serialises, ptxas C7519).
  unsigned pa0[BN / 16][4], pa1[BN / 16][4];
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
    for (int e = 0; e < 4; ++e) pa0[kk][e] = pa1[kk][e] = 0u;
  const unsigned q_addr = smem_u32(sQ) + c * C::Q_BLOCK_BYTES;  // this warpgroup's 128 rows
  const int r0 = c * 128 + 16 * wi + g;  // row within the CTA tile of half 0 (and + 8)

  // One turn: QK of half h on tile `tile` into s, then PV of the other half's P (pa) against
  // V of `pv_tile`, as two commit groups; returns with S landed (the PV may still run).
  auto turn = [&](int h, float (&s)[32], int tile, const unsigned (&pa)[BN / 16][4],
                  float (&o)[D / 2], int pv_tile) {
    const unsigned k_addr = smem_u32(sK + (tile % STAGES) * C::T_BYTES);
    const unsigned v_addr = smem_u32(sV + (pv_tile % STAGES) * C::T_BYTES);
    named_sync(my_turn, 256);
    wg_fence();
    issue_qk64<D, BN, 128, BF16>(s, q_addr + h * 64 * 128, k_addr);
    wg_commit();
    issue_pv64<D, BN, BF16>(o, pa, v_addr);
    wg_commit();
    named_arrive(other_turn, 256);  // the other warpgroup issues while this one does softmax
    wg_wait1();                     // S landed (the PV may still run)
    pin(s);
  };
  // The online softmax of half h's S on tile `tile`: its P into pa once the PV in flight (the
  // other half's) is done, and O of this half rescaled (its own last PV finished a turn ago).
  auto softmax = [&](int h, float (&s)[32], int tile, unsigned (&pa)[BN / 16][4],
                     float (&o)[D / 2]) {
    float alpha[2];
    tile_softmax<BN / 8>(s, p, kv_begin + tile * BN, tq, m0 + r0 + h * 64, P, kv_stop, rows, qo0,
                         G, m_run[h], l_run[h], alpha);
    wg_wait0();  // the other half's PV done: its P registers and O settled
    pin(o0);
    pin(o1);
    rescale_rows(o, alpha);
    pack_p_frags<BN / 8, BF16>(s, pa);
  };

  // Turns: each warpgroup syncs on its own barrier and arrives on the other's once a turn;
  // consumer 1 arrives once first (consumer 0 goes first) and skips its last arrival, so every
  // sync is matched by exactly one arrival.
  if (c == 1 && n_tiles > 0) named_arrive(kPpTurn0, 256);
  for (int it = 0; it < n_tiles; ++it) {
    const int slot = it % STAGES;
    mbar_wait(full0 + 8 * slot, (it / STAGES) & 1);
    fence_async_smem();  // the producer's cp.async writes -> the tensor cores' reads
    float s[32];         // 64 rows x 64 keys of one half
    turn(0, s, it, pa1, o1, it > 0 ? it - 1 : 0);  // QK h0(it), PV h1(it - 1)
    softmax(0, s, it, pa0, o0);
    // PV h1(it - 1) done: tile it - 1's K and V are read by both halves
    if (it > 0) mbar_arrive(empty0 + 8 * ((it - 1) % STAGES));
    turn(1, s, it, pa0, o0, it);  // QK h1(it), PV h0(it)
    softmax(1, s, it, pa1, o1);
  }
  if (n_tiles > 0) {  // PV h1 of the last tile, in turn like the others
    const unsigned v_addr = smem_u32(sV + ((n_tiles - 1) % STAGES) * C::T_BYTES);
    named_sync(my_turn, 256);
    wg_fence();
    issue_pv64<D, BN, BF16>(o1, pa1, v_addr);
    wg_commit();
    if (c == 0) named_arrive(other_turn, 256);  // consumer 1 syncs once more; 0 does not
    wg_wait0();
    pin(o1);
  }
  gqa_store_rows<D, BF16>(p, o0, m_run[0], l_run[0], m0 + r0, rows, qo0, kvh, G, split,
                             n_splits, tq);
  gqa_store_rows<D, BF16>(p, o1, m_run[1], l_run[1], m0 + r0 + 64, rows, qo0, kvh, G, split,
                             n_splits, tq);
}

}  // namespace treeverify
