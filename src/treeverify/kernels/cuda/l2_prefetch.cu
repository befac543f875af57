// Pulls byte ranges of global memory into L2 and nothing else (models/l2_prefetch.py): no
// register loads, no writes, so it is correct to run beside any kernel and to finish late.
// A decode step's attention, rope and norms leave HBM idle for microseconds between the GEMVs
// that stream weights; this kernel, on a side branch of the captured step, fills that time with
// the next GEMVs' weights, so they read them from L2.
//
// Up to three ranges a launch, each cut into kPrefetchPiece-byte pieces spread over the grid
// (the first range's pieces first: the order the step reads them). sm_90+: one bulk prefetch a
// piece (the TMA unit walks it); older arches: one prefetch.global.L2 a 32-byte sector.
// Ranges must start 16-byte aligned with sizes a multiple of 16 (the launcher trims them).

namespace treeverify {

constexpr int kPrefetchThreads = 128;
constexpr long long kPrefetchPiece = 4096;

__device__ __forceinline__ void prefetch_piece(const char* p, long long bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"((unsigned)bytes)
               : "memory");
#else
  for (long long off = 0; off < bytes; off += 32) {
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p + off));
  }
#endif
}

__device__ __forceinline__ void prefetch_range(const char* base, long long bytes, long long first,
                                               long long stride) {
  for (long long off = first * kPrefetchPiece; off < bytes; off += stride * kPrefetchPiece) {
    const long long left = bytes - off;
    prefetch_piece(base + off, left < kPrefetchPiece ? left : kPrefetchPiece);
  }
}

__global__ void __launch_bounds__(kPrefetchThreads)
    l2_prefetch(const char* a, long long a_bytes, const char* b, long long b_bytes, const char* c,
                long long c_bytes) {
  const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long stride = (long long)gridDim.x * blockDim.x;
  if (a != nullptr) prefetch_range(a, a_bytes, first, stride);
  if (b != nullptr) prefetch_range(b, b_bytes, first, stride);
  if (c != nullptr) prefetch_range(c, c_bytes, first, stride);
}

}  // namespace treeverify
