// Per-CTA timing for scripts/cta_trace.py, in diagnostic builds only (TV_CTA_TRACE: the script
// compiles the GQA ping-pong kernels with it, under a variant name of their own; never a shipped
// variant). Without TV_CTA_TRACE every helper here compiles to nothing.
#pragma once

namespace treeverify {

#ifdef TV_CTA_TRACE
// Each CTA writes kTraceWords words into tv_cta_trace[kTraceWords * its linear block index]: [0] start
// ns (thread 0, before any work), [1] end ns (the latest warp's, atomicMax, after the body
// returned, early exits included), [2] SM id, [3] blockIdx x | y << 20 | z << 40 (the
// persistent kernel: when its tiles were done), then the ping-pong kernel's phases
// (TV_TRACE_MARK; 0 where a CTA never got there), thread 0 (the producer's first) and thread
// 128 (consumer 0's first): [8] the request's indptrs loaded (the exit checks passed), [9] the
// mbarriers initialised, [10] Q's copies issued, [11] the producer chosen (the batch's keys
// loaded), [12] tile 0's first row address known (its page looked up; the own-rows producer),
// [4] tile 0's copies issued (thread 0's; a mark for every producer thread's spilled the
// producer, at its 56 registers); [13] consumer 0 got its registers, [14] it saw Q land (Q's
// copies arrive on a barrier of their own in this build only: tile 0's barrier completes after
// them, a cp.async arrival counts the thread's earlier copies too), [5] it saw tile 0 land, [6]
// its tiles done, [7] its rows stored (the merge, if any, follows). A mark whose condition reads
// a loaded value waits for that load. When and where each CTA ran, and where a short CTA's
// fixed cost goes.
extern "C" {
__device__ unsigned long long* tv_cta_trace = nullptr;
}
constexpr int kTraceWords = 16;
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned long long* cta_trace_slot() {
  const unsigned long long y = blockIdx.y, z = blockIdx.z;
  return tv_cta_trace + kTraceWords * (blockIdx.x + gridDim.x * (y + gridDim.y * z));
}
#define TV_TRACE_MARK(cond, word)                                                      \
  do {                                                                                 \
    if ((cond) && tv_cta_trace != nullptr) cta_trace_slot()[word] = global_ns();      \
  } while (0)
// Words 0 and 2 (and 3: the block index, when `index`) at the CTA's entry, before any work.
__device__ __forceinline__ void cta_trace_begin(bool index) {
  if (threadIdx.x != 0 || tv_cta_trace == nullptr) return;
  unsigned smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  unsigned long long* slot = cta_trace_slot();
  slot[0] = global_ns();
  slot[2] = smid;
  if (index)
    slot[3] = blockIdx.x | (static_cast<unsigned long long>(blockIdx.y) << 20) |
              (static_cast<unsigned long long>(blockIdx.z) << 40);
}
// Word 1, the latest warp's, after the body returned (early exits included).
__device__ __forceinline__ void cta_trace_end() {
  if ((threadIdx.x & 31) == 0 && tv_cta_trace != nullptr)
    atomicMax(cta_trace_slot() + 1, global_ns());
}
#else
#define TV_TRACE_MARK(cond, word) \
  do {                            \
  } while (0)
__device__ __forceinline__ void cta_trace_begin(bool) {}
__device__ __forceinline__ void cta_trace_end() {}
#endif

}  // namespace treeverify
