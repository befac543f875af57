// y (M, N) = x (M, K) W (N, K)^T (+ bias) for a few rows (2 <= M <= 32): models/gemv.py.
//
// A verify forward at batch 1 (a budget-16 tree: 17 rows) and a DFlash drafter's block (16 rows)
// multiply a handful of rows by small weights (tiny-code: 0.1-4 MB). cuBLAS takes ~2.7-3.2 us a
// call there on the H200 (scripts/gemv_bench.py), ~1 us more than the one-row GEMV: the work is
// a few hundred ns of tensor-core time, so the call is launch and latency. Here one CTA owns
// sixteen outputs (W's rows as the MMA's m dimension) for every row of x (its n dimension, in
// n8 tiles): its four warps split K, each runs m16n8k16 MMAs (mma.sync: sm_80 and up) over its
// share, and warp 0 adds the four partial tiles in a fixed order (deterministic; no atomics; the
// same eager and inside a CUDA graph). A first version with x's rows as the m dimension (m16
// tiles, eight outputs a CTA) lost to cuBLAS from 17 rows on (two m16 tiles: 32 rows padded,
// 92 registers; H100, e3f2922).
//
// Fragments without ldmatrix or shared memory: the MMA sums over its 16 k indices in any order,
// so a k-step need not take 16 consecutive columns, only the same 16 for x and W. For a 32-column
// chunk c, the lane with k-group q = lane % 4 loads one 16-byte vector of its W row and of its x
// rows, columns [32c + 8q, 32c + 8q + 8): words 0-1 feed the chunk's first k-step (its k pairs
// 2q and 2q + 8), words 2-3 the second. Both operands use that mapping, so the products pair up.
//
// Requires K % 32 == 0, N % 16 == 0 and 16-byte aligned rows (the launcher checks). Rows of x past
// M are read as zeros and never stored.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "linear_common.cuh"
#include "pdl.cuh"

namespace treeverify {

constexpr int kSkinnyWarps = 4;  // warps of a CTA, splitting K
constexpr int kSkinnyUnroll = 4;  // chunks a warp loads before it multiplies

template <bool BF16>
__device__ __forceinline__ void mma_16816(float (&c)[4], unsigned a0, unsigned a1, unsigned a2,
                                          unsigned a3, unsigned b0, unsigned b1) {
  if constexpr (BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// NT n8 tiles of x rows (M <= 8 * NT). The MMA's m dimension is the CTA's 16 outputs (weight
// rows o0 + g and o0 + g + 8), its n dimension x's rows: a 17-row verify pads to 24, not 32, and
// a CTA of 16 outputs loads each chunk of x once for twice the outputs.
// ACT: as decode_gemv's, x holds a gate|up output and the input is silu(gate) * up.
// NORM: as decode_gemv's, the input is rmsnorm(x + residual) by gamma, made once a CTA into
// dynamic shared memory (M rows of K / 8 vectors padded to 4 mod 8); CTA 0 writes the sum;
// warp 0 scales its sums by the rows' 1 / rms.
template <int NT, bool BF16, bool ACT, bool NORM>
__global__ void __launch_bounds__(kSkinnyWarps * 32)
    skinny_gemm(const unsigned short* __restrict__ x, long long x_stride, int m,
                const unsigned short* __restrict__ w, long long w_stride,
                const unsigned short* __restrict__ bias, unsigned short* __restrict__ y,
                long long y_stride, int n, int k, const unsigned short* __restrict__ residual,
                unsigned short* __restrict__ r_out, unsigned short* __restrict__ tap,
                long long tap_stride, const unsigned short* __restrict__ gamma, float eps) {
  static_assert(!(ACT && NORM), "one prologue a kernel");
  // chunks in flight a warp (registers: W 8U, x 4U NT; ACT holds gate and up: 8U NT)
  constexpr int U = (NT <= 3 && !ACT) ? 4 : 2;
  __shared__ float partials[kSkinnyWarps - 1][NT][4][32];  // warps 1.. -> warp 0
  extern __shared__ uint4 norm_xs[];  // NORM: (M, pitch) the rows' normalized inputs
  __shared__ float norm_rstd_rows[NORM ? 8 * NT : 1];
  // rows of K / 8 vectors padded to 4 mod 8: a 16-byte load is served a quarter-warp at a time,
  // and its eight lanes (rows g, g + 1 x k-groups 0..3) then fall on eight distinct 16-byte
  // bank groups (K / 8 + 1 put rows g and g + 1 on overlapping ones: 8 wavefronts, not 4)
  const int norm_pitch = (k >> 3) | 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int q = lane & 3, g = lane >> 2;  // k-group; row within 8
  const int o0 = blockIdx.x * 16;
  const int chunks = k >> 5;
  // lane's vector of chunk c: W rows o0 + g and o0 + g + 8, x rows 8t + g, at index 4c + q
  const uint4* wlo = reinterpret_cast<const uint4*>(w + static_cast<long long>(o0 + g) * w_stride);
  const uint4* whi = wlo + w_stride;  // 8 rows on: 8 * w_stride elements = w_stride vectors
  float acc[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;

  // The weights depend on no earlier kernel: the first chunks' loads go out before the
  // programmatic-launch wait (models/gemv.py); x is read after it. Without the branch around
  // them ptxas hoisted the wait above the loads (SASS: ACQBULK first), so nothing overlapped.
  uint4 wa[U], wb[U];
  const uint4 zero = make_uint4(0, 0, 0, 0);
  int c0 = warp;
  if (c0 < chunks) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * kSkinnyWarps;
      wa[u] = c < chunks ? ld_stream(wlo + 4 * c + q) : zero;
      wb[u] = c < chunks ? ld_stream(whi + 4 * c + q) : zero;
    }
  }
  pdl_wait();
  if constexpr (NORM) {
    const NormArgs na{residual, r_out, tap, tap_stride, gamma, eps};
    norm_stage<BF16, 8 * NT, kSkinnyWarps>(x, x_stride, m, k, na, norm_xs, norm_pitch,
                                           norm_rstd_rows);
  }
  pdl_trigger();
  for (; c0 < chunks; c0 += U * kSkinnyWarps) {
    if (c0 != warp) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = c0 + u * kSkinnyWarps;
        wa[u] = c < chunks ? ld_stream(wlo + 4 * c + q) : zero;
        wb[u] = c < chunks ? ld_stream(whi + 4 * c + q) : zero;
      }
    }
    uint4 xv[U][NT];  // x row 8t + g
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * kSkinnyWarps;
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const int r = 8 * t + g;
        const uint4* xr = reinterpret_cast<const uint4*>(x + r * x_stride) + 4 * c + q;
        if (c < chunks && r < m) {
          if constexpr (ACT) {
            xv[u][t] = silu_mul8<BF16>(__ldg(xr), __ldg(xr + (k >> 3)));  // up: k columns on
          } else if constexpr (NORM) {
            xv[u][t] = norm_xs[r * norm_pitch + 4 * c + q];
          } else {
            xv[u][t] = __ldg(xr);
          }
        } else {
          xv[u][t] = zero;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (c0 + u * kSkinnyWarps < chunks) {
        const uint4 lo = wa[u], hi = wb[u];  // outputs o0 + g and o0 + g + 8
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          mma_16816<BF16>(acc[t], lo.x, hi.x, lo.y, hi.y, xv[u][t].x, xv[u][t].y);  // k-step 1
          mma_16816<BF16>(acc[t], lo.z, hi.z, lo.w, hi.w, xv[u][t].z, xv[u][t].w);  // k-step 2
        }
      }
    }
  }

  if (warp > 0) {
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) partials[warp - 1][t][i][lane] = acc[t][i];
  }
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int p = 0; p < kSkinnyWarps - 1; ++p)
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[t][i] += partials[p][t][i][lane];
  // D fragment: d0, d1 at output o0 + g, x rows 8t + 2q and 8t + 2q + 1; d2, d3 at o0 + g + 8
  if constexpr (NORM) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const float r0 = norm_rstd_rows[8 * t + 2 * q], r1 = norm_rstd_rows[8 * t + 2 * q + 1];
      acc[t][0] *= r0;
      acc[t][2] *= r0;
      acc[t][1] *= r1;
      acc[t][3] *= r1;
    }
  }
  float b_lo = 0.f, b_hi = 0.f;
  if (bias != nullptr) {
    b_lo = to_float2<BF16>(static_cast<unsigned>(bias[o0 + g])).x;
    b_hi = to_float2<BF16>(static_cast<unsigned>(bias[o0 + g + 8])).x;
  }
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int r0 = 8 * t + 2 * q, r1 = r0 + 1;
    if (r0 < m) {
      y[r0 * y_stride + o0 + g] = from_float<BF16>(acc[t][0] + b_lo);
      y[r0 * y_stride + o0 + g + 8] = from_float<BF16>(acc[t][2] + b_hi);
    }
    if (r1 < m) {
      y[r1 * y_stride + o0 + g] = from_float<BF16>(acc[t][1] + b_lo);
      y[r1 * y_stride + o0 + g + 8] = from_float<BF16>(acc[t][3] + b_hi);
    }
  }
}

}  // namespace treeverify
