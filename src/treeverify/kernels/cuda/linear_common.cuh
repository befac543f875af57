// 16-bit element helpers of the linear-layer kernels (decode_gemv.cu, skinny_gemm.cu): a
// streaming weight load, a packed pair of bf16 / fp16 to fp32, fp32 back to bits, and the
// SwiGLU activation of eight elements.
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

// x = silu(gate) * up for eight elements (ACT kernels: the down projection's input computed on
// its load from the gate|up output, one kernel fewer a MLP), rounded as fused_ops.silu_mul
// rounds: silu(g) to the dtype, then the product to the dtype.
template <bool BF16>
__device__ __forceinline__ float round16(float f) {
  const unsigned short b = from_float<BF16>(f);
  return to_float2<BF16>(static_cast<unsigned>(b)).x;
}

// One 32-bit word: two elements. By value, not through a pointer into a uint4 (taking a local
// vector's address put it in local memory on sm_120: 16-24 spill bytes).
template <bool BF16>
__device__ __forceinline__ unsigned silu_mul2(unsigned g, unsigned u) {
  const float2 gf = to_float2<BF16>(g), uf = to_float2<BF16>(u);
  const float a0 = round16<BF16>(gf.x / (1.f + __expf(-gf.x)));
  const float a1 = round16<BF16>(gf.y / (1.f + __expf(-gf.y)));
  return static_cast<unsigned>(from_float<BF16>(a0 * uf.x)) |
         (static_cast<unsigned>(from_float<BF16>(a1 * uf.y)) << 16);
}

template <bool BF16>
__device__ __forceinline__ uint4 silu_mul8(const uint4& g, const uint4& u) {
  return make_uint4(silu_mul2<BF16>(g.x, u.x), silu_mul2<BF16>(g.y, u.y),
                    silu_mul2<BF16>(g.z, u.z), silu_mul2<BF16>(g.w, u.w));
}

}  // namespace treeverify
