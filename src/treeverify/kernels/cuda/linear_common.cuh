// 16-bit element helpers of the linear-layer kernels (decode_gemv.cu, skinny_gemm.cu): a
// streaming weight load, a packed pair of bf16 / fp16 to fp32, and fp32 back to bits.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace treeverify {

// Streamed once: don't displace x (and whatever else lives in L1) with weight lines.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

template <bool BF16>
__device__ __forceinline__ float2 to_float2(unsigned u) {
  if constexpr (BF16) {
    return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
  } else {
    __half2 h = *reinterpret_cast<__half2*>(&u);
    return __half22float2(h);
  }
}

template <bool BF16>
__device__ __forceinline__ unsigned short from_float(float f) {
  if constexpr (BF16) {
    __nv_bfloat16 h = __float2bfloat16_rn(f);
    return *reinterpret_cast<unsigned short*>(&h);
  } else {
    __half h = __float2half_rn(f);
    return *reinterpret_cast<unsigned short*>(&h);
  }
}

}  // namespace treeverify
