// y (M, N) = x (M, K) W (N, K)^T (+ bias) for decode rows (M = 1; the template takes more):
// models/gemv.py.
//
// A decode step's linear layers are matrix-vector products bound by HBM bandwidth. cuBLAS tiles
// them 64 outputs per CTA (32-48 CTAs for a 2-3k-output projection on 132 SMs) or splits K and
// adds a reduce kernel; here one warp owns one weight row and streams it with 16-byte
// non-allocating loads, UNROLL of them in flight per lane, while x (a few KB, shared by every
// warp) comes through L1. 8 warps (rows) per CTA; fp32 sums, one warp-shuffle reduction per row,
// no atomics: a deterministic order per shape, the same eager and inside a CUDA graph.
// Requires K % 8 == 0 and 16-byte aligned rows (the launcher checks).

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "linear_common.cuh"
#include "pdl.cuh"

namespace treeverify {

constexpr int kGemvWarps = 8;
constexpr int kGemvUnroll = 8;  // 16-byte loads in flight per lane: 4 KB per warp

template <bool BF16>
__device__ __forceinline__ float dot8(const uint4& a, const uint4& b, float acc) {
  const unsigned* pa = reinterpret_cast<const unsigned*>(&a);
  const unsigned* pb = reinterpret_cast<const unsigned*>(&b);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 fa = to_float2<BF16>(pa[i]), fb = to_float2<BF16>(pb[i]);
    acc = fmaf(fa.x, fb.x, acc);
    acc = fmaf(fa.y, fb.y, acc);
  }
  return acc;
}

// One tile of a weight row: UNROLL 16-byte loads a lane, all in flight before any is used.
__device__ __forceinline__ void load_weights(const uint4* wr, int base, int kv,
                                             uint4 (&wv)[kGemvUnroll]) {
#pragma unroll
  for (int u = 0; u < kGemvUnroll; ++u) {
    const int i = base + 32 * u;
    wv[u] = i < kv ? ld_stream(wr + i) : make_uint4(0, 0, 0, 0);
  }
}

// ACT: x holds M rows of a gate|up output (2K columns, x_stride apart) and the GEMV's input is
// silu(gate) * up, made on the load (linear_common.cuh silu_mul8; models/gemv.py
// down_of_silu): the MLP's activation kernel is gone.
// NORM: the input is rmsnorm(x + residual) by gamma (linear_common.cuh NormArgs, norm_stage;
// models/norm_linear.py): the add and norm kernel in front of the projection is gone. The CTA
// makes the M rows' inputs into dynamic shared memory (M K 2 bytes) after the PDL wait and
// scales each sum by its row's 1 / rms; CTA 0 writes the residual stream's sum.
template <int M, bool BF16, bool ACT, bool NORM>
__global__ void __launch_bounds__(kGemvWarps * 32)
    decode_gemv(const unsigned short* __restrict__ x, long long x_stride,
                const unsigned short* __restrict__ w, long long w_stride,
                const unsigned short* __restrict__ bias, unsigned short* __restrict__ y,
                long long y_stride, int n, int k, const unsigned short* __restrict__ residual,
                unsigned short* __restrict__ r_out, unsigned short* __restrict__ tap,
                long long tap_stride, const unsigned short* __restrict__ gamma, float eps) {
  static_assert(!(ACT && NORM), "one prologue a kernel");
  extern __shared__ uint4 norm_xs[];  // NORM: (M, K / 8) the rows' normalized inputs
  __shared__ float norm_rstd_rows[NORM ? M : 1];
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * kGemvWarps + (threadIdx.x >> 5);
  const uint4* wr = reinterpret_cast<const uint4*>(w + row * w_stride);  // read where row < n
  const int kv = k >> 3;  // 16-byte vectors per row
  float acc[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.f;
  // Programmatic dependent launch (models/gemv.py, on sm_90+): this kernel may start while
  // the one before it still runs. The weights depend on no earlier kernel, so the first tile's
  // loads go out before the wait (a whole row where K <= 2048); x is read after it. Every
  // thread waits, those past the last row too, so that this grid's completion still means
  // the previous kernel's (stream order for the kernels after it, as in the split merge).
  uint4 wv[kGemvUnroll];
  if (row < n) load_weights(wr, lane, kv, wv);
  pdl_wait();
  if constexpr (NORM) {  // every thread, those past the last row too (a barrier inside)
    const NormArgs na{residual, r_out, tap, tap_stride, gamma, eps};
    norm_stage<BF16, M, kGemvWarps>(x, x_stride, M, k, na, norm_xs, kv, norm_rstd_rows);
  }
  if (row >= n) return;
  pdl_trigger();
  for (int base = lane; base < kv; base += 32 * kGemvUnroll) {
    if (base != lane) load_weights(wr, base, kv, wv);
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) {
      const int i = base + 32 * u;
      if (i < kv) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
          const uint4* xr = reinterpret_cast<const uint4*>(x + m * x_stride);
          uint4 xv;
          if constexpr (ACT) {
            xv = silu_mul8<BF16>(__ldg(xr + i), __ldg(xr + kv + i));  // up: k columns on
          } else if constexpr (NORM) {
            xv = norm_xs[m * kv + i];
          } else {
            xv = __ldg(xr + i);
          }
          acc[m] = dot8<BF16>(wv[u], xv, acc[m]);
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], off);
    if constexpr (NORM) acc[m] *= norm_rstd_rows[m];
  }
  if (lane == 0) {
    float b = 0.f;
    if (bias != nullptr) b = to_float2<BF16>(static_cast<unsigned>(bias[row])).x;
#pragma unroll
    for (int m = 0; m < M; ++m) y[m * y_stride + row] = from_float<BF16>(acc[m] + b);
  }
}

}  // namespace treeverify
