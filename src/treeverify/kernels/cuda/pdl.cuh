// Programmatic dependent launch (PDL, sm_90+): a kernel launched with it may start while the
// kernel before it on the stream still runs. pdl_wait blocks until that kernel has finished and
// its writes are visible; pdl_trigger lets the kernel after this one start early. Both are
// no-ops where the launch did not ask for PDL, and compiled out below sm_90.
// Included by device_common.cuh (the tree-verify kernels), decode_gemv.cu and skinny_gemm.cu.
#pragma once

namespace treeverify {

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

}  // namespace treeverify
