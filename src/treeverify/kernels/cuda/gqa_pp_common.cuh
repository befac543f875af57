// What the GQA ping-pong kernels share (tree_attention_gqa_pp_sm90.cuh and the 256-row
// consumers, gqa_pp256_consumers.cuh): the CTA's shape and shared-memory layout, the named
// barriers and the producer kinds.
// Included by tree_attention.cu after tree_attention_gqa_sm90.cuh and sm90_async.cuh.
#pragma once

namespace treeverify {

// H: 64-row halves a consumer warpgroup owns (1: 128-row CTAs; 2: 256-row CTAs, v21, one KV
// tile serving twice the rows, so half the KV bytes an SM takes in per FLOP). Q is stored as
// 128-row blocks (one a consumer warpgroup when H = 2), each in load_q_tile's swizzled layout.
template <int D, int BN, int STAGES, int H = 1>
struct GqaPpCfg {
  static constexpr int BM = 128 * H, NT = 384, CH = D / 8;
  static constexpr int Q_BLOCK_BYTES = 128 * D * 2;  // one 128-row block of Q
  static constexpr int Q_BYTES = BM * D * 2;
  static constexpr int T_BYTES = BN * D * 2;  // one K (or V) tile
  // 1 KB alignment slack + Q + STAGES of K and V + K/V row pointers [STAGES][BN] each + the
  // full, empty and peer_empty (MC) mbarriers [STAGES] each.
  static constexpr int SMEM_BYTES =
      1024 + Q_BYTES + 2 * STAGES * T_BYTES + 16 * STAGES * BN + 24 * STAGES;
  // The 256-row CTA's consumers hold twice O: 8 more registers each, from the producer (its
  // direct path fits in 40; they still keep ~4 floats of softmax state in local memory).
  static constexpr int PRODUCER_REGS = H == 1 ? 56 : 40, CONSUMER_REGS = H == 1 ? 224 : 232;
  static constexpr int LAUNCH_REGS = 168;
  static_assert(PRODUCER_REGS + 2 * CONSUMER_REGS == 3 * LAUNCH_REGS, "the register file");
  static_assert(STAGES >= 2 && STAGES <= 4, "slots in flight");
  static_assert(BN == 64 && (D == 64 || D == 128), "tile shapes this kernel is written for");
  static_assert(H == 1 || H == 2, "64 or 128 rows a consumer warpgroup");
};

// Named barriers (0 is __syncthreads): the two consumers' turns (256 threads each: one
// warpgroup syncs, the other arrives) and the producer's own (128).
enum : int { kPpTurn0 = 1, kPpTurn1 = 2, kPpProducer = 3 };

// How the producer warpgroup finds each KV row (the schedules in tree_attention_gqa_pp_sm90.cuh).
enum : int {
  kProducerShared = 0,
  kProducerOwnRows = 1,
  kProducerShuffle = 2,
  kProducerTma = 3,
  kProducerAuto = 4
};
// kProducerAuto's crossover (v15's grid); variants.py's AUTO_DIRECT_MAX_KEYS (a CPU test
// checks they agree).
constexpr int kAutoDirectMaxKeys = 32768;

// kProducerOwnRows: this thread's half h (alternate 16-byte chunks) of row r of a K and a V tile
// (dk / dv: the slot's tiles); kp / vp null: a row past the split's keys, zero-filled (the copy
// still names a valid address, kg).
template <int D, int BN>
__device__ __forceinline__ void copy_own_row(unsigned char* dk, unsigned char* dv,
                                             const unsigned short* kp, const unsigned short* vp,
                                             const unsigned short* kg, int r, int h) {
  const int bytes = kp ? 16 : 0;
  const unsigned short* ks = (kp ? kp : kg) + 8 * h;
  const unsigned short* vs = (vp ? vp : kg) + 8 * h;
#pragma unroll
  for (int k = 0; k < D / 16; ++k) {  // chunks 2k + h of the row
    const unsigned off = sw_off<BN>(r, 2 * k + h);
    cp_async16(dk + off, ks + 16 * k, bytes);
    cp_async16(dv + off, vs + 16 * k, bytes);
  }
}

// kProducerShared: the producer warpgroup's 128 threads copy a K and a V tile whole rows at a
// time from the row pointers published in shared memory (rk / rv: the slot's BN of them).
template <int D, int BN>
__device__ __forceinline__ void copy_shared_rows(unsigned char* dk, unsigned char* dv,
                                                 const unsigned short* const* rk,
                                                 const unsigned short* const* rv,
                                                 const unsigned short* kg, int tid) {
  constexpr int CH = D / 8;
  static_assert(BN * CH % 128 == 0, "whole chunks per producer thread");
#pragma unroll
  for (int k = 0; k < BN * CH / 128; ++k) {
    const int idx = tid + k * 128, r = idx / CH, c = idx % CH;
    const unsigned short* kp = rk[r];
    const unsigned short* vp = rv[r];
    cp_async16(dk + sw_off<BN>(r, c), kp ? kp + c * 8 : kg, kp ? 16 : 0);
    cp_async16(dv + sw_off<BN>(r, c), vp ? vp + c * 8 : kg, vp ? 16 : 0);
  }
}

}  // namespace treeverify
