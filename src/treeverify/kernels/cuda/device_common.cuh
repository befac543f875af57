// Device-side pieces every tree-verify kernel shares: the parameter struct, PTX wrappers for
// cp.async / ldmatrix / mma.sync, warp reductions, and the request, split and page-lookup rules.
// Included by tree_attention.cu (and, through it, by the sm_90a kernels).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "pdl.cuh"

namespace treeverify {

#define TV_INF __int_as_float(0x7f800000)  // NVRTC has no <math.h> INFINITY

// Kernel parameters, passed by value (one struct, filled by kernels/cuda/launch.py; the
// field order and types there must match this struct exactly).
struct TreeAttnParams {
  const void* q;            // (total_q, Hq, Dqk)
  const void* k;            // k cache base
  const void* v;            // v cache base (GQA) / unused (MLA: V is k's first DV columns)
  void* out;                // (total_q, Hq, Dv)
  float* part_o;            // (max_splits, total_q_cap, Hq, Dv) fp32 partial outputs
  float* part_lse;          // (max_splits, total_q_cap, Hq) log2-domain LSE of each split
  const void* block_table;  // int32 or int64 page ids
  const int* prefix_lens;   // (B,) or null when kv_indptr is given
  const int* kv_indptr;     // (B+1,) SGLang prefix indptr into block_table, or null
  const int* qo_indptr;     // (B+1,)
  const unsigned* tree_mask;  // (total_q, mask_words)
  const void* k_ext;        // SGLang: tree nodes' K (total_q, Hkv, Dqk), or null (in cache)
  const void* v_ext;        // SGLang: tree nodes' V, or null
  long long q_stride_tok, q_stride_head;
  long long k_stride_page, k_stride_slot, k_stride_head;
  long long v_stride_page, v_stride_slot, v_stride_head;
  long long o_stride_tok, o_stride_head;
  long long kext_stride_tok, kext_stride_head, vext_stride_tok, vext_stride_head;
  long long bt_stride;      // row stride of block_table when kv_indptr is null
  int bt_i64;               // 1: block_table holds int64 ids
  int batch, hq, hkv, group, page_size, mask_words;
  int max_splits, chunk, total_q_cap;
  float scale_log2;         // sm_scale * log2(e)
  unsigned* split_counters;  // per (m-tile, request x KV head) of the grid: zero between launches
  int fused_merge_bytes;    // split tiles whose merge reads at most this merge in the forward
  int fwd_bm;               // the forward's rows per CTA (the merge kernel finds a row's tile)
  int out_rows;             // rows of out; those past the last request's tree are zeroed
  int balance_div;          // > 0: balanced splits, a split at least the batch's keys / this
  int merge_heads;          // heads one merge-kernel CTA merges (grid.y = ceil(hq / this))
  int tma_rows;             // GQA "pingpong-tma": rows of a K/V TMA box, or 0: no TMA tiles
  int persist_m;            // GQA "pingpong-persist": 128-row blocks a request (CTAs a group)
  int split_order;          // balanced plans: 1 = later splits take the requests longest first
  int fused_merge_ilp;      // 1: a tile merged in the forward keeps its loads by split count
};

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)),
               "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

template <bool BF16>
__device__ __forceinline__ void mma16816(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
  if constexpr (BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

template <bool BF16>
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
  if constexpr (BF16) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
  }
}

__device__ __forceinline__ void pair_barrier(int id, int nthreads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(nthreads));
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Where request b's KV lives: prefix length, and the offset of its row in the page table.
struct RequestKV {
  int prefix, row_off;
};
__device__ __forceinline__ RequestKV request_kv(const TreeAttnParams& p, int b) {
  RequestKV r;
  if (p.kv_indptr != nullptr) {
    r.row_off = p.kv_indptr[b];
    r.prefix = p.kv_indptr[b + 1] - r.row_off;
  } else {
    r.prefix = p.prefix_lens[b];
    r.row_off = static_cast<int>(b * p.bt_stride);
  }
  return r;
}

// The request with `rank` requests longer than it (ties: the lower index first), batch <= 32.
// Every warp ranks the batch itself, lanes over requests: no shared memory, no barrier, so all
// 32 lanes of the calling warp must be converged.
__device__ __forceinline__ int request_by_length_rank(const TreeAttnParams& p, int rank) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  int keys = -1;  // lanes past the batch rank last
  if (lane < p.batch)
    keys = request_kv(p, lane).prefix + p.qo_indptr[lane + 1] - p.qo_indptr[lane];
  int longer = 0;
#pragma unroll 8  // not 32: fully unrolled, all 32 shuffles' results would be live at once
  for (int j = 0; j < 32; ++j) {
    const int k = __shfl_sync(0xffffffffu, keys, j);
    longer += (k > keys) || (k == keys && j < lane);
  }
  const unsigned hit = __ballot_sync(0xffffffffu, lane < p.batch && longer == rank);
  return hit ? __ffs(hit) - 1 : rank;
}

// The forward grid: (m-tiles, splits, requests x KV heads), or for balanced plans
// (p.balance_div > 0) (m-tiles, requests x KV heads, splits): splits vary slowest, so the hardware
// dispatches every request's first split before any later one. When a batch of mixed lengths
// fills the GPU with its first splits, the long requests' later splits then start on the SMs
// that the short requests free, instead of taking slots at launch ahead of other requests'
// first splits (v12: with splits in y, balancing gained nothing on SGLang's full batch).
//
// Within a later split's slice (v27; p.split_order, TREEVERIFY_CUDA_SPLIT_ORDER=longest, the
// default) the rows go to the requests longest first: those CTAs start one by one as first
// splits end, so the longest remainders should start first (longest-processing-time-first
// scheduling). In request order, SGLang's page-1 GQA batch started its longest request's
// second half ~20 us after a shorter one's (scripts/sim_verify_schedule.py: 74.9 -> 66.6 us
// modelled; measured on the H200 89.2 -> 81.7 us, docs/performance.md, v27).
__device__ __forceinline__ int cta_request_head(const TreeAttnParams& p) {
  if (p.balance_div <= 0) return static_cast<int>(blockIdx.z);
  const int bh = static_cast<int>(blockIdx.y);
  if (p.split_order == 0 || blockIdx.z == 0 || p.batch > 32) return bh;  // splits.py mirrors
  return request_by_length_rank(p, bh / p.hkv) * p.hkv + bh % p.hkv;
}
__device__ __forceinline__ int cta_split(const TreeAttnParams& p) {
  return static_cast<int>(p.balance_div > 0 ? blockIdx.z : blockIdx.y);
}

// Programmatic dependent launch (sm_90+; TREEVERIFY_CUDA_PDL, by default where the forward
// grid is one wave, kernels/cuda/runner.py): each forward CTA signals at
// its start that the merge kernel after it may be scheduled; the merge kernel's CTAs decide
// whether they have anything to merge (most exit) and wait for the forward grid to finish and
// its writes to be visible only before reading the partials. No-ops in a normal launch and
// before sm_90.
// (pdl_trigger / pdl_wait: pdl.cuh.)

// Keys of the whole batch, sum over requests of P_b + T_b (the balanced split rule below, the
// GQA ping-pong kernel's producer choice). Every warp computes it for itself, lanes over
// requests (no shared memory, no barrier), so every lane of the calling warp must be
// converged; a CTA of fewer than 32 threads (the merge for DV = 64 has 16) reduces over its own
// lanes.
__device__ __forceinline__ int batch_keys(const TreeAttnParams& p) {
  int s;
  if (p.kv_indptr != nullptr) {
    s = p.kv_indptr[p.batch] - p.kv_indptr[0];
  } else {
    const int lanes = blockDim.x < 32 ? static_cast<int>(blockDim.x) : 32;  // a power of two
    const unsigned mask = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1u;
    s = 0;
    for (int b = threadIdx.x & (lanes - 1); b < p.batch; b += lanes) s += p.prefix_lens[b];
    for (int o = lanes >> 1; o > 0; o >>= 1) s += __shfl_xor_sync(mask, s, o, lanes);
  }
  return s + p.qo_indptr[p.batch] - p.qo_indptr[0];
}
// batch_keys for the balanced split rule: 0 when the plan does not balance.
__device__ __forceinline__ int batch_kv_sum(const TreeAttnParams& p) {
  return p.balance_div > 0 ? batch_keys(p) : 0;
}

// Splits of request b: the plan fixes (max_splits, chunk = the split granularity, a multiple
// of the KV tile); the split length follows the request's own length on the device: its keys
// spread over up to max_splits splits of whole `chunk` units, so a short request in a bucket
// sized for long ones still fills the GPU (v7), and one captured grid serves every length. A
// request longer than max_splits * chunk (the SGLang drop-in only estimates lengths) gets
// longer splits instead of losing its tail. Balanced plans (balance_div > 0, batch > 1: the
// grid has room for more splits than a uniform batch uses) also make no split shorter than
// kv_batch / balance_div, the batch's mean share of one wave: a uniform batch splits exactly as
// without balancing, and in a batch of mixed lengths the long requests take the spare splits
// instead of setting the kernel's time alone (v12). The forward and merge kernels call these.
__device__ __forceinline__ int split_chunk(const TreeAttnParams& p, int kv_total, int kv_batch) {
  int c = max(p.chunk, (kv_total + p.max_splits - 1) / p.max_splits);
  if (p.balance_div > 0) c = max(c, (kv_batch + p.balance_div - 1) / p.balance_div);
  return (c + p.chunk - 1) / p.chunk * p.chunk;
}
__device__ __forceinline__ int num_splits(const TreeAttnParams& p, int kv_total, int kv_batch) {
  const int c = split_chunk(p, kv_total, kv_batch);
  return max(1, (kv_total + c - 1) / c);
}

// Token -> cache row addresses, fetched a tile ahead. Looking the page id up costs a dependent
// global load (hundreds of cycles); doing it inside the cp.async loop serialises one per chunk.
// Instead thread i < BN loads the page of token i of a future tile into a register early
// (fetch_page) and, once other work has hidden the latency, turns it into row pointers in
// shared memory (publish_rows) that every thread's cp.async then reads.
struct PageFetch {
  long long page;  // -1: past the range, or a tree node read from the extend buffers
  int t;
};
__device__ __forceinline__ PageFetch fetch_page(const TreeAttnParams& p, const RequestKV& rk,
                                                int P, int t, int kv_stop) {
  PageFetch f{-1, t};
  if (t < kv_stop && !(t >= P && p.k_ext != nullptr)) {
    const int pi = t / p.page_size;
    f.page = p.bt_i64 ? static_cast<const long long*>(p.block_table)[rk.row_off + pi]
                      : static_cast<long long>(
                            static_cast<const int*>(p.block_table)[rk.row_off + pi]);
  }
  return f;
}
template <typename T>
__device__ __forceinline__ void publish_rows(const TreeAttnParams& p, const PageFetch& f, int P,
                                             int qo0, int kvh, int kv_stop, const T** k_row,
                                             const T** v_row) {
  const T* kp = nullptr;
  const T* vp = nullptr;
  if (f.t < kv_stop) {
    if (f.page < 0) {  // tree node in SGLang's extend buffers
      const long long e = qo0 + (f.t - P);
      kp = static_cast<const T*>(p.k_ext) + e * p.kext_stride_tok + kvh * p.kext_stride_head;
      vp = static_cast<const T*>(p.v_ext) + e * p.vext_stride_tok + kvh * p.vext_stride_head;
    } else {
      const int slot = f.t % p.page_size;
      kp = static_cast<const T*>(p.k) + f.page * p.k_stride_page + slot * p.k_stride_slot +
           kvh * p.k_stride_head;
      vp = static_cast<const T*>(p.v) + f.page * p.v_stride_page + slot * p.v_stride_slot +
           kvh * p.v_stride_head;
    }
  }
  *k_row = kp;
  if (v_row != nullptr) *v_row = vp;
}

}  // namespace treeverify
