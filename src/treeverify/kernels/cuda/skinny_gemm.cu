// y (M, N) = x (M, K) W (N, K)^T (+ bias) for a few rows (2 <= M <= 32): models/gemv.py.
//
// A verify forward at batch 1 (a budget-16 tree: 17 rows) and a DFlash drafter's block (16 rows)
// multiply a handful of rows by small weights (tiny-code: 0.1-4 MB). cuBLAS takes ~2.7-3.2 us a
// call there on the H200 (scripts/gemv_bench.py), ~1 us more than the one-row GEMV: the work is
// a few hundred ns of tensor-core time, so the call is launch and latency. Here one CTA owns
// eight outputs (an n8 tile of W's rows) for every row of x: its four warps split K, each runs
// m16n8k16 MMAs (mma.sync: sm_80 and up) over its share, and warp 0 adds the four partial tiles
// in a fixed order (deterministic; no atomics; the same eager and inside a CUDA graph).
//
// Fragments without ldmatrix or shared memory: the MMA sums over its 16 k indices in any order,
// so a k-step need not take 16 consecutive columns, only the same 16 for x and W. For a 32-column
// chunk c, the lane with k-group q = lane % 4 loads one 16-byte vector of its W row and of its x
// rows, columns [32c + 8q, 32c + 8q + 8): words 0-1 feed the chunk's first k-step (its k pairs
// 2q and 2q + 8), words 2-3 the second. Both operands use that mapping, so the products pair up.
//
// Requires K % 32 == 0, N % 8 == 0 and 16-byte aligned rows (the launcher checks). Rows of x past
// M are read as zeros and never stored.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "pdl.cuh"

namespace treeverify {

constexpr int kSkinnyWarps = 4;  // warps of a CTA, splitting K
constexpr int kSkinnyUnroll = 4;  // chunks a warp loads before it multiplies

__device__ __forceinline__ uint4 skinny_ld_stream(const uint4* p) {  // W: read once
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

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

template <bool BF16>
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
  if constexpr (BF16) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
  } else {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
  }
}

template <bool BF16>
__device__ __forceinline__ float bias_at(const unsigned short* bias, int col) {
  const unsigned short b = bias[col];
  if constexpr (BF16) {
    return __uint_as_float(static_cast<unsigned>(b) << 16);
  } else {
    return __half2float(*reinterpret_cast<const __half*>(&b));
  }
}

// MT m16 tiles of x rows (M <= 16 * MT).
template <int MT, bool BF16>
__global__ void __launch_bounds__(kSkinnyWarps * 32)
    skinny_gemm(const unsigned short* __restrict__ x, long long x_stride, int m,
                const unsigned short* __restrict__ w, long long w_stride,
                const unsigned short* __restrict__ bias, unsigned short* __restrict__ y,
                long long y_stride, int n, int k) {
  __shared__ float partials[kSkinnyWarps - 1][MT][4][32];  // warps 1.. -> warp 0
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int q = lane & 3, g = lane >> 2;  // k-group; row within 8 (of W's tile and of x's)
  const int n0 = blockIdx.x * 8;
  const int chunks = k >> 5;
  // lane's vector of chunk c: W row n0 + g, x row r, at vector index 4c + q
  const uint4* wr = reinterpret_cast<const uint4*>(w + static_cast<long long>(n0 + g) * w_stride);
  float acc[MT][4];
#pragma unroll
  for (int t = 0; t < MT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;

  // The weights depend on no earlier kernel: the first chunks' loads go out before the
  // programmatic-launch wait (models/gemv.py); x is read after it.
  uint4 wv[kSkinnyUnroll];
  const uint4 zero = make_uint4(0, 0, 0, 0);
  int c0 = warp;
#pragma unroll
  for (int u = 0; u < kSkinnyUnroll; ++u) {
    const int c = c0 + u * kSkinnyWarps;
    wv[u] = c < chunks ? skinny_ld_stream(wr + 4 * c + q) : zero;
  }
  pdl_wait();
  pdl_trigger();
  for (; c0 < chunks; c0 += kSkinnyUnroll * kSkinnyWarps) {
    if (c0 != warp) {
#pragma unroll
      for (int u = 0; u < kSkinnyUnroll; ++u) {
        const int c = c0 + u * kSkinnyWarps;
        wv[u] = c < chunks ? skinny_ld_stream(wr + 4 * c + q) : zero;
      }
    }
    uint4 xv[kSkinnyUnroll][2 * MT];  // rows g + 8j of x, j = 0 .. 2MT-1
#pragma unroll
    for (int u = 0; u < kSkinnyUnroll; ++u) {
      const int c = c0 + u * kSkinnyWarps;
#pragma unroll
      for (int j = 0; j < 2 * MT; ++j) {
        const int r = g + 8 * j;
        xv[u][j] = (c < chunks && r < m)
                       ? __ldg(reinterpret_cast<const uint4*>(x + r * x_stride) + 4 * c + q)
                       : zero;
      }
    }
#pragma unroll
    for (int u = 0; u < kSkinnyUnroll; ++u) {
      if (c0 + u * kSkinnyWarps < chunks) {
#pragma unroll
        for (int t = 0; t < MT; ++t) {
          const uint4 lo = xv[u][2 * t], hi = xv[u][2 * t + 1];  // rows g and g + 8 of tile t
          mma_16816<BF16>(acc[t], lo.x, hi.x, lo.y, hi.y, wv[u].x, wv[u].y);  // first k-step
          mma_16816<BF16>(acc[t], lo.z, hi.z, lo.w, hi.w, wv[u].z, wv[u].w);  // second
        }
      }
    }
  }

  if (warp > 0) {
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) partials[warp - 1][t][i][lane] = acc[t][i];
  }
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int p = 0; p < kSkinnyWarps - 1; ++p)
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[t][i] += partials[p][t][i][lane];
  // C fragment: c0, c1 at row g, columns 2q, 2q + 1 of the tile; c2, c3 at row g + 8
  const int col = n0 + 2 * q;
  float b0 = 0.f, b1 = 0.f;
  if (bias != nullptr) {
    b0 = bias_at<BF16>(bias, col);
    b1 = bias_at<BF16>(bias, col + 1);
  }
#pragma unroll
  for (int t = 0; t < MT; ++t) {
    const int r0 = 16 * t + g, r1 = r0 + 8;
    if (r0 < m)
      *reinterpret_cast<unsigned*>(y + r0 * y_stride + col) =
          pack2<BF16>(acc[t][0] + b0, acc[t][1] + b1);
    if (r1 < m)
      *reinterpret_cast<unsigned*>(y + r1 * y_stride + col) =
          pack2<BF16>(acc[t][2] + b0, acc[t][3] + b1);
  }
}

}  // namespace treeverify
