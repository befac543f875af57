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
  } else {  // by value: a local's address can put it in local memory (spills on sm_80)
    return make_float2(__half2float(__ushort_as_half(static_cast<unsigned short>(u & 0xffffu))),
                       __half2float(__ushort_as_half(static_cast<unsigned short>(u >> 16))));
  }
}

template <bool BF16>
__device__ __forceinline__ unsigned short from_float(float f) {
  if constexpr (BF16) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
  } else {
    return __half_as_ushort(__float2half_rn(f));
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

// silu(g) = g / (1 + exp(-g)) with Triton's own operations for fused_ops.silu_mul's
// `g / (1.0 + tl.exp(-g))` (its PTX: ex2.approx.f32 of g * -log2(e), add, div.full.f32), so the
// activation is bit-equal to the kernel it replaces. An IEEE division here (div.rn.f32: a
// subroutine call for the slow path, which serialised the activations) made the few-row kernel's
// act instance ~12 us a call at 17 rows of tiny-code's down projection instead of ~3 (H100).
__device__ __forceinline__ float silu_f32(float g) {
  float d;
  asm("{\n .reg .f32 t;\n"
      " mul.f32 t, %1, 0fBFB8AA3B;\n"  // g * -log2(e), Triton's constant
      " ex2.approx.f32 t, t;\n"
      " add.f32 t, t, 0f3F800000;\n"
      " div.full.f32 %0, %1, t;\n}"
      : "=f"(d)
      : "f"(g));
  return d;
}

// One 32-bit word: two elements. By value, not through a pointer into a uint4 (taking a local
// vector's address put it in local memory on sm_120: 16-24 spill bytes).
template <bool BF16>
__device__ __forceinline__ unsigned silu_mul2(unsigned g, unsigned u) {
  const float2 gf = to_float2<BF16>(g), uf = to_float2<BF16>(u);
  const float a0 = round16<BF16>(silu_f32(gf.x));
  const float a1 = round16<BF16>(silu_f32(gf.y));
  return static_cast<unsigned>(from_float<BF16>(a0 * uf.x)) |
         (static_cast<unsigned>(from_float<BF16>(a1 * uf.y)) << 16);
}

template <bool BF16>
__device__ __forceinline__ uint4 silu_mul8(const uint4& g, const uint4& u) {
  return make_uint4(silu_mul2<BF16>(g.x, u.x), silu_mul2<BF16>(g.y, u.y),
                    silu_mul2<BF16>(g.z, u.z), silu_mul2<BF16>(g.w, u.w));
}

// NORM kernels (models/norm_linear.py): the input is rmsnorm(x + residual) made on the load.
// s = x + r rounded to the dtype (as fused_ops.add_rmsnorm rounds the residual add), its
// square summed for the row's rms, and s * gamma (rounded) fed to the product; the row's
// 1 / rms scales the sum at the end: rstd * sum_k (s_k gamma_k) w_k.
template <bool BF16>
__device__ __forceinline__ unsigned add2(unsigned a, unsigned b) {
  const float2 fa = to_float2<BF16>(a), fb = to_float2<BF16>(b);
  return static_cast<unsigned>(from_float<BF16>(fa.x + fb.x)) |
         (static_cast<unsigned>(from_float<BF16>(fa.y + fb.y)) << 16);
}

template <bool BF16>
__device__ __forceinline__ uint4 add8(const uint4& a, const uint4& b) {
  return make_uint4(add2<BF16>(a.x, b.x), add2<BF16>(a.y, b.y), add2<BF16>(a.z, b.z),
                    add2<BF16>(a.w, b.w));
}

template <bool BF16>
__device__ __forceinline__ float sumsq2(unsigned a, float acc) {
  const float2 f = to_float2<BF16>(a);
  return fmaf(f.y, f.y, fmaf(f.x, f.x, acc));
}

template <bool BF16>
__device__ __forceinline__ float sumsq8(const uint4& s, float acc) {
  return sumsq2<BF16>(s.w, sumsq2<BF16>(s.z, sumsq2<BF16>(s.y, sumsq2<BF16>(s.x, acc))));
}

template <bool BF16>
__device__ __forceinline__ unsigned mul2(unsigned a, unsigned b) {
  const float2 fa = to_float2<BF16>(a), fb = to_float2<BF16>(b);
  return static_cast<unsigned>(from_float<BF16>(fa.x * fb.x)) |
         (static_cast<unsigned>(from_float<BF16>(fa.y * fb.y)) << 16);
}

template <bool BF16>
__device__ __forceinline__ uint4 mul8(const uint4& a, const uint4& b) {
  return make_uint4(mul2<BF16>(a.x, b.x), mul2<BF16>(a.y, b.y), mul2<BF16>(a.z, b.z),
                    mul2<BF16>(a.w, b.w));
}

// The operands a NORM kernel reads and writes besides x and W (contiguous (M, K) rows but the
// tap's, `tap_stride` apart). residual null: s = x (a stack's first norm, no add). r_out
// null: nothing written; else CTA 0 writes s there (and to tap, unless null): the residual
// stream after the add, as add_rmsnorm's r_out.
struct NormArgs {
  const unsigned short* residual;
  unsigned short* r_out;
  unsigned short* tap;
  long long tap_stride;
  const unsigned short* gamma;  // (K,) the norm's weight
  float eps;
};

// s for vector i (8 elements) of row m: x's vector plus the residual's, written out by CTA 0.
template <bool BF16>
__device__ __forceinline__ uint4 norm_input(const uint4& xv, const NormArgs& na, int m, int i,
                                            int k, bool write) {
  if (na.residual == nullptr) return xv;
  const long long at = static_cast<long long>(m) * (k >> 3) + i;  // 16-byte vectors
  const uint4 s = add8<BF16>(xv, __ldg(reinterpret_cast<const uint4*>(na.residual) + at));
  if (write && na.r_out != nullptr) {
    reinterpret_cast<uint4*>(na.r_out)[at] = s;
    if (na.tap != nullptr) {
      reinterpret_cast<uint4*>(na.tap + m * na.tap_stride)[i] = s;
    }
  }
  return s;
}

// 1 / rms of a row from its sum of squares over k columns (fused_ops' 1 / sqrt(mean + eps)) by
// the fast reciprocal square root and division: once a row, and no IEEE slow-path subroutine
// (the summation order differs from Triton's reduction anyway: not the same bits).
__device__ __forceinline__ float norm_rstd(float sumsq, int k, float eps) {
  return rsqrtf(__fdividef(sumsq, static_cast<float>(k)) + eps);
}

// A NORM kernel's prologue, by every thread of the CTA once x may be read (after the PDL
// wait): each of the m rows' normalized input s * gamma into shared memory xs, rows `pitch`
// vectors apart, for the product to read instead of x; CTA 0 writes the sum (norm_input);
// each row's 1 / rms into rstd (rows m..ROWS: 0). A warp a row (rows warp, warp + WARPS, ...),
// its lanes striding the row's vectors, then a shuffle reduction: deterministic, and one
// accumulator live (a thread per vector over all rows held 32 sums: 164 registers at 32 rows).
// Once a CTA, not once a warp: the first version made the input in every warp's loop (8x the
// work in the GEMV, 4x in the few-row kernel) and ran the few-row kernel's call at ~6 us
// against ~3.3 plain (H200, 61224e3).
template <bool BF16, int ROWS, int WARPS>
__device__ __forceinline__ void norm_stage(const unsigned short* __restrict__ x, long long x_stride,
                                           int m, int k, const NormArgs& na, uint4* xs, int pitch,
                                           float* rstd) {
  const int kv = k >> 3, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool write = blockIdx.x == 0;
  const uint4* g = reinterpret_cast<const uint4*>(na.gamma);
  for (int r = warp; r < m; r += WARPS) {
    const uint4* xr = reinterpret_cast<const uint4*>(x + r * x_stride);
    float ss = 0.f;
#pragma unroll 4
    for (int i = lane; i < kv; i += 32) {
      const uint4 s = norm_input<BF16>(__ldg(xr + i), na, r, i, k, write);
      ss = sumsq8<BF16>(s, ss);
      xs[r * pitch + i] = mul8<BF16>(s, __ldg(g + i));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    if (lane == 0) rstd[r] = norm_rstd(ss, k, na.eps);
  }
  if (static_cast<int>(threadIdx.x) >= m && threadIdx.x < ROWS) rstd[threadIdx.x] = 0.f;
  __syncthreads();
}

}  // namespace treeverify
