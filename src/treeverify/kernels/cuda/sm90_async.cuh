// sm_90 asynchronous-copy and synchronisation primitives the warp-specialised kernels share:
// mbarriers (init, arrive, parity wait, transaction bytes, remote arrival in a cluster),
// cp.async completion on an mbarrier, setmaxnreg, TMA tensor loads (plain and multicast) and
// thread-block-cluster rank and barrier. PTX wrappers only, no policy. Included by
// tree_attention.cu before the kernels that use them (tree_attention_gqa_pp_sm90.cuh).
#pragma once

namespace treeverify {

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("{\n .reg .b64 state;\n mbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(
                   bar)
               : "memory");
}
// Spin until the barrier's phase with this parity has completed. CLUSTER: a barrier that other
// CTAs of the cluster arrive on (acquire at cluster scope).
#define TV_MBAR_WAIT_LOOP(SEM)                                                  \
  "{\n .reg .pred ready;\n"                                                    \
  "TV_MBAR_RETRY:\n"                                                           \
  " mbarrier.try_wait.parity" SEM ".shared::cta.b64 ready, [%0], %1;\n"        \
  " @!ready bra TV_MBAR_RETRY;\n}\n"
template <bool CLUSTER = false>
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  if constexpr (CLUSTER)
    asm volatile(TV_MBAR_WAIT_LOOP(".acquire.cluster")::"r"(bar), "r"(parity) : "memory");
  else
    asm volatile(TV_MBAR_WAIT_LOOP("")::"r"(bar), "r"(parity) : "memory");
}
// Arrive on `bar` when every earlier cp.async of this thread has landed; noinc: the arrival is
// one of the barrier's expected count.
__device__ __forceinline__ void cp_async_mbar_arrive(unsigned bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
// Expect `bytes` more transaction bytes in the barrier's current phase (TMA completions).
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
// `count` arrivals at once (one thread standing in for the warpgroup's 128).
__device__ __forceinline__ void mbar_arrive_count(unsigned bar, unsigned count) {
  asm volatile("{\n .reg .b64 state;\n mbarrier.arrive.shared::cta.b64 state, [%0], %1;\n}\n" ::"r"(
                   bar),
               "r"(count)
               : "memory");
}
// A tensor map (CUtensorMap, 128 bytes, 64-byte aligned) passed as a __grid_constant__ kernel
// parameter; the host encodes it (kernels/cuda/tma.py).
struct alignas(64) TmaDesc {
  unsigned long long opaque[16];
};
// One TMA box of a rank-4 map (coordinates innermost first) into shared memory at `dst`,
// completing `bytes` of the barrier's transaction count when it lands.
__device__ __forceinline__ void tma_load_4d(unsigned dst, const TmaDesc* map, unsigned bar, int c0,
                                            int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}
// The same box multicast into the shared memory of every CTA in `mask` (same offsets), each
// CTA's barrier at `bar` completing the bytes it received.
__device__ __forceinline__ void tma_load_4d_mc(unsigned dst, const TmaDesc* map, unsigned bar,
                                               int c0, int c1, int c2, int c3,
                                               unsigned short mask) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%2, %3, %4, %5}], [%6], %7;\n" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
      "r"(bar), "h"(mask)
      : "memory");
}
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// Every thread of both CTAs of the cluster (release / acquire: barrier inits, remote arrivals).
__device__ __forceinline__ void cluster_sync_all() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
// `count` arrivals on the barrier at the same offset in cluster CTA `peer`.
__device__ __forceinline__ void mbar_arrive_remote(unsigned bar, unsigned peer, unsigned count) {
  asm volatile(
      "{\n .reg .b32 ra;\n mapa.shared::cluster.u32 ra, %0, %1;\n"
      " mbarrier.arrive.release.cluster.shared::cluster.b64 _, [ra], %2;\n}\n" ::"r"(bar),
      "r"(peer), "r"(count)
      : "memory");
}

}  // namespace treeverify
