// KV-cache write and GQA softmax attention on the GPU; same contracts as cpu::kv_write and
// cpu::attention (cpu/attention.h), for F32, F16 and Q8_0 caches and any head_dim up to 1024
// (64/128/256 in the models; Q8_0 needs head_dim % 32 == 0).
//
// kv_write: one block per (row, KV head), converting with kv_store.cuh's store_kv_row (F32 copies, F16
// rounds to nearest even, Q8_0 is ggml's quantize_row_q8_0_ref; qk_norm_rope's fused cache write stores
// with it too). Bit-identical to the CPU op for finite inputs (NaN payloads may differ). Row indices
// are range/distinctness-checked on the host (a GPU rows tensor is read back) unless `trusted`; the
// kernel skips a row outside [0, capacity) whatever the caller promised.
//
// attention: split-K over fixed chunks of each row's visible-key sequence; see the comment above
// attn_chunk_kernel for the design, the invariance guarantees and the tolerance vs the CPU op. On F16
// caches of head_dim 64 / 128 / 256 (the target's) the chunk pass runs on tensor cores instead
// (attention_chunk_mma.cuh: same chunks, same partials, same combine; use_chunk_mma). With
// exact = false (prefill chunks), calls of at least flash::kMinRows rows without a mask on F16 caches
// of head_dim 64 / 128 / 256 run the tensor-core flash-attention kernel instead (attention_flash.cuh:
// F16 Q and P, ~1e-3 * max|v|; use_flash below lists every condition).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "../cpu/attention.h"
#include "attention_chunk_mma.cuh"
#include "attention_flash.cuh"
#include "attention_mask.cuh"
#include "attention_rows.cuh"
#include "kv_store.cuh"
#include "op_util.cuh"
#include "ops.h"

namespace specd::gpu {

namespace {

using detail::warp_max;

constexpr int kMaxDim = 1024;

void check_cache(const Tensor& c, const char* op, const char* arg) {
  detail::check_gpu(c, op, arg);
  cpu::check_kv_cache_format(c, op, arg);
}

void check_index(const Tensor& t, const char* op, const char* arg, int64_t ndim) {
  check_dtype(t, DType::I32, op, arg);
  check_ndim(t, ndim, op, arg);
  check_contiguous(t, op, arg);
}

// Element c of a cache head row.
template <DType T>
__device__ __forceinline__ float load(const uint8_t* row, int c) {
  if constexpr (T == DType::F32) return reinterpret_cast<const float*>(row)[c];
  if constexpr (T == DType::F16) return detail::f16_at(row, c);
  return detail::q8_0_at(row, c);
}

// ---------------------------------------------------------------------------------------- kv_write

constexpr int kWriteThreads = 128;

template <DType T>
__global__ void __launch_bounds__(kWriteThreads) kv_write_kernel(uint8_t* __restrict__ cache, const float* __restrict__ x,
                                                                 const int32_t* __restrict__ rows, int hkv, int d,
                                                                 int64_t row_stride, int64_t head_stride, int64_t cap) {
  detail::pdl_enter();
  const int64_t i = blockIdx.x / hkv;
  const int g = int(blockIdx.x % hkv);
  if (rows[i] < 0 || rows[i] >= cap) return;  // only reachable with trusted rows; uniform per block
  detail::store_kv_row<T>(cache + int64_t(rows[i]) * row_stride + g * head_stride, x + (i * hkv + g) * d, d,
                          kWriteThreads);
}

// --------------------------------------------------------------------------------------- attention
//
// Split-K ("flash-decoding") attention with fixed chunks of the visible-key sequence.
//
// Each query row i sees an ordered sequence of visible keys (increasing position): [lo, hi) when
// there is no mask, else the positions of [lo, hi) whose mask entry is nonzero (compacted on the
// GPU into idx[i, rank], with the count in cnt[i], by the kernels of attention_mask.cuh: one block per
// (row, segment of 2048 positions), in two passes, count then write). That sequence is
// cut into FIXED chunks of kChunk keys by rank: chunk c holds ranks [kChunk*c, kChunk*c + kChunk).
// The cut depends only on the row's own visible sequence (never on n, on other rows, on the work
// split, nor on the cache rows the keys sit in), so
//   * batch invariance: a row's result is bit-identical whatever the number of rows in the call;
//   * a tree node (mask, keys at rows c + ancestor index) equals the chain verify of its path (keys
//     at rows c + depth) bitwise: both see the same ordered key sequence, hence the same chunks;
//   * a mask of all ones gives exactly the unmasked result.
// Pass 1 (attn_chunk_kernel): one block per (row, KV head, head sub-group, chunk), for up to
// kMaxHs q heads of the GQA group at once, so K and V of the chunk are read once per group; the blocks
// of the rows of one (chunk, KV head) are adjacent in the grid, so a verify's rows read each key from
// HBM once and from L2 after:
//   scores: one (sub)warp of W lanes per key (W = head_dim/8 rounded up to a power of two, <= 32);
//           lane sums its dims 8 at a time (16-byte loads for F16, 2x16 for F32) in a fixed order
//           with fmaf, then a fixed xor butterfly over the W lanes; s = dot * scale;
//   softmax within the chunk (two-pass, exact max): m_c = max s, p = expf(s - m_c),
//           l_c = fixed-order sum of p (lane strides + butterfly);
//   values: thread (dim group, key slice) accumulates p * v over its slice's keys in increasing
//           order; slices are then added in slice order (0, 1, 2, ...) through shared memory.
//   Partials (m_c, l_c, acc_c[dp] incl. the zero padding past d, F32) go to a scratch buffer from the
//   device pool.
// Pass 2 (attn_combine_kernel, attn_combine_groups_kernel; described above them): the chunks of a row in
// groups of 64, each group's M_g = max m_c and fixed-order chains L, acc over its chunks with
// w = expf(m_c - M_g), then the groups' chains in order with w = expf(M_g - M); out = acc / L.
// Chunks beyond the row's visible count are skipped by every launch (no work, no partial), so
// nothing depends on n. No atomics: every reduction has a fixed order. A query with no visible
// key gets zeros.
// Tolerance vs the CPU op (which uses one global max and one running sum in key order, a different
// dot-product order, libm exp): the chunked softmax rescales by expf(m_c - M_g) and expf(M_g - M) (a few
// ulp per weight), so |gpu - cpu| <= ~1e-5 * max|v| (+ ~1e-5 relative); tests use atol = 2e-5 * max|v| +
// rtol 1e-4, unchanged.
// Scratch: rows are processed in slices so the partials stay under kScratchFloats floats (prefill).
// q_pos is checked (>= 0) on the host (one small synchronising read when it is a GPU tensor) unless
// `trusted`. No memory access depends on q_pos: keys are read from [lo, hi) within [0, kv_len) or
// from the compacted mask, and the grid is sized from the host kv_len alone.

constexpr int kChunk = 64;        // keys per chunk (fixed: part of the arithmetic's definition)
constexpr int kThreads = 256;     // threads of a chunk block
constexpr int kMaxHs = 8;         // q heads per chunk block (a GQA group is split above this)
constexpr int kU = 4;             // keys loaded ahead per (sub)warp / slice
constexpr int64_t kScratchFloats = int64_t(32) << 20;  // 128 MiB of partials at most

// The CUDA-core kernels' fields beyond the split-K call's (attention_rows.cuh).
struct AttnParams : detail::SplitKParams {
  int d, dg;            // dg = ceil(d / 8) dim groups (dp = 8 * dg)
  int hs, nsub, w;      // heads per block, sub-groups per KV head, lanes per key
  int vec;              // 16-byte loads allowed (alignment and d % 8 checked on the host)
  float* out;
  float* gpart;  // [rows, hq, combine_groups(nch), dp] the combine's group partials acc_g
  float* gml;    // [rows, hq, combine_groups(nch), 2] (M_g, L_g)
};

using detail::row_range;

// Elements 8g .. 8g+7 of a cache head row (zeros past d).
template <DType T>
__device__ __forceinline__ void load8(const uint8_t* row, int g, int d, int vec, float (&v)[8]) {
  if constexpr (T == DType::Q8_0) {  // d % 32 == 0, so the 8 elements sit in one block
    const uint8_t* blk = row + (g / 4) * 34;
    const float sc = specd_fp16_bits_to_float(uint16_t(blk[0]) | uint16_t(uint16_t(blk[1]) << 8));
    const int8_t* qv = reinterpret_cast<const int8_t*>(blk + 2) + (g % 4) * 8;
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = float(qv[e]) * sc;
  } else if (vec) {
    if constexpr (T == DType::F16) {
      const uint4 raw = reinterpret_cast<const uint4*>(row)[g];
      const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        v[2 * e] = specd_fp16_bits_to_float(uint16_t(w[e] & 0xffffu));
        v[2 * e + 1] = specd_fp16_bits_to_float(uint16_t(w[e] >> 16));
      }
    } else {
      static_assert(T == DType::F32, "load8: F32, F16 or Q8_0 cache rows");
      const float4 a = reinterpret_cast<const float4*>(row)[2 * g];
      const float4 b = reinterpret_cast<const float4*>(row)[2 * g + 1];
      v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
      v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    }
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = 8 * g + e < d ? load<T>(row, 8 * g + e) : 0.0f;
  }
}

// Sum over each group of w lanes (w a power of two <= the warp, uniform over the warp): xor butterfly
// with m = w/2, w/4, ..., 1. Written as the warp-wide butterfly with the steps m >= w skipped, so the
// loop unrolls and the chains of a thread's many sums interleave (a loop bound by w alone runs them one
// after another, each a chain of dependent shuffles); the same adds in the same order.
__device__ __forceinline__ float subwarp_sum(float v, int w) {
#pragma unroll
  for (int m = SPECD_WARP / 2; m > 0; m >>= 1)
    if (m < w) v += SPECD_SHFL_XOR(v, m);  // w uniform: all lanes shuffle
  return v;
}

template <DType KT, DType VT>
__global__ void __launch_bounds__(kThreads) attn_chunk_kernel(const AttnParams P) {
  detail::pdl_enter();
  extern __shared__ __align__(16) float smem[];
  float* qs = smem;                // [hs, dp] (zero padded)
  float* os = qs + P.hs * P.dp;    // [hs, dp]
  float* ss = os + P.hs * P.dp;    // [hs, kChunk] scores, then weights
  int32_t* kp = reinterpret_cast<int32_t*>(ss + P.hs * kChunk);  // [kChunk] key positions
  __shared__ float m_s[kMaxHs], l_s[kMaxHs];

  int64_t b = blockIdx.x;  // rows fastest: the rows of one (chunk, KV head) share its keys through L2
  const int64_t il = b % P.rows, i = P.i0 + il;
  b /= P.rows;
  const int sub = int(b % P.nsub);
  b /= P.nsub;
  const int g = int(b % P.hkv);
  const int c = int(b / P.hkv);
  int64_t lo, cnt;
  row_range(P, i, lo, cnt);
  const int64_t r0 = int64_t(c) * kChunk;
  if (r0 >= cnt) return;  // uniform over the block, before any barrier
  const int cc = int(cnt - r0 < kChunk ? cnt - r0 : kChunk);
  const int h0 = g * P.r + sub * P.hs;
  const int nh = P.r - sub * P.hs < P.hs ? P.r - sub * P.hs : P.hs;
  const int tid = threadIdx.x, lane = tid % SPECD_WARP, warp = tid / SPECD_WARP;
  constexpr int nwarps = kThreads / SPECD_WARP;

  for (int x = tid; x < P.hs * P.dp; x += kThreads) {
    const int h = x / P.dp, e = x % P.dp;
    qs[x] = (h < nh && e < P.d) ? P.q[(i * P.hq + h0 + h) * P.d + e] : 0.0f;
  }
  for (int x = tid; x < cc; x += kThreads)
    kp[x] = P.idx ? P.idx[i * P.kv_len + r0 + x] : int32_t(lo + r0 + x);
  __syncthreads();

  const uint8_t* kbase = P.kc + g * P.k_head_stride;
  const uint8_t* vbase = P.vc + g * P.v_head_stride;

  // Scores: W lanes per key, kw keys per warp, kU keys per (sub)warp per step.
  {
    const int W = P.w, kw = SPECD_WARP / W, slot = lane / W, sl = lane % W;
    for (int base = warp * kw * kU; base < cc; base += nwarps * kw * kU) {  // uniform per warp
      float part[kU][kMaxHs];
#pragma unroll
      for (int u = 0; u < kU; ++u)
#pragma unroll
        for (int h = 0; h < kMaxHs; ++h) part[u][h] = 0.0f;
      for (int gg = sl; gg < P.dg; gg += W) {
        float kv[kU][8];
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int jj = base + u * kw + slot;
          if (jj < cc) {
            load8<KT>(kbase + int64_t(kp[jj]) * P.k_row_stride, gg, P.d, P.vec, kv[u]);
          } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) kv[u][e] = 0.0f;
          }
        }
#pragma unroll
        for (int h = 0; h < kMaxHs; ++h) {
          if (h < nh) {
            const float4 qa = reinterpret_cast<const float4*>(qs + h * P.dp)[2 * gg];
            const float4 qb = reinterpret_cast<const float4*>(qs + h * P.dp)[2 * gg + 1];
            const float qv[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
#pragma unroll
            for (int u = 0; u < kU; ++u)
#pragma unroll
              for (int e = 0; e < 8; ++e) part[u][h] = fmaf(qv[e], kv[u][e], part[u][h]);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int jj = base + u * kw + slot;
#pragma unroll
        for (int h = 0; h < kMaxHs; ++h) {
          if (h < nh) {  // uniform
            const float s = subwarp_sum(part[u][h], W);
            if (sl == 0 && jj < cc) ss[h * kChunk + jj] = s * P.scale;
          }
        }
      }
    }
  }
  __syncthreads();

  // Softmax within the chunk: one warp per head.
  for (int h = warp; h < nh; h += nwarps) {
    float m = -INFINITY;
    for (int t = lane; t < cc; t += SPECD_WARP) m = fmaxf(m, ss[h * kChunk + t]);
    m = warp_max(m);
    float lp = 0.0f;
    for (int t = lane; t < cc; t += SPECD_WARP) {
      const float p = expf(ss[h * kChunk + t] - m);
      ss[h * kChunk + t] = p;
      lp += p;
    }
    const float l = detail::warp_sum(lp);
    if (lane == 0) {
      m_s[h] = m;
      l_s[h] = l;
    }
  }
  __syncthreads();

  // Values: thread = (dim group gg, key slice k); slice k takes keys k, k + ns, ... in order.
  {
    const int ns = kThreads / P.dg;
    const int gg = tid % P.dg, k = tid / P.dg;
    float acc[kMaxHs][8];
#pragma unroll
    for (int h = 0; h < kMaxHs; ++h)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[h][e] = 0.0f;
    if (k < ns) {
      for (int j0 = k; j0 < cc; j0 += ns * kU) {
        float vv[kU][8];
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int jj = j0 + u * ns;
          if (jj < cc) {
            load8<VT>(vbase + int64_t(kp[jj]) * P.v_row_stride, gg, P.d, P.vec, vv[u]);
          } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) vv[u][e] = 0.0f;
          }
        }
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int jj = j0 + u * ns;
          if (jj < cc) {
#pragma unroll
            for (int h = 0; h < kMaxHs; ++h) {
              if (h < nh) {
                const float p = ss[h * kChunk + jj];
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[h][e] = fmaf(p, vv[u][e], acc[h][e]);
              }
            }
          }
        }
      }
    }
    for (int kk = 0; kk < ns; ++kk) {  // slices added in order 0, 1, 2, ...
      if (k == kk) {
#pragma unroll
        for (int h = 0; h < kMaxHs; ++h) {
          if (h < nh) {
#pragma unroll
            for (int e = 0; e < 8; ++e) {
              float* o = os + h * P.dp + gg * 8 + e;
              *o = kk == 0 ? acc[h][e] : *o + acc[h][e];
            }
          }
        }
      }
      __syncthreads();
    }
  }

  for (int x = tid; x < nh * P.dp; x += kThreads) {  // incl. the zero padding d .. dp (the combine's 16-byte copies)
    const int h = x / P.dp, e = x % P.dp;
    P.part[((il * P.hq + h0 + h) * P.nch + c) * int64_t(P.dp) + e] = os[h * P.dp + e];
  }
  if (tid < nh) {
    float* mlp = P.ml + ((il * P.hq + h0 + tid) * P.nch + c) * 2;
    mlp[0] = m_s[tid];
    mlp[1] = l_s[tid];
  }
}

// The combine runs in two levels so that a long row's chunks are read by many blocks at once (one block per
// row and head had left a 131k-key decode 96 blocks, each waiting on one tile of partials after another):
// Level 1 (attn_combine_kernel): one block per (row of the slice, q head, kCombineDims output elements,
// group of kGroupChunks chunks g); thread = output element e. The group's partials are staged into shared
// memory at once (cp.async on sm_80+, else a plain copy), then each thread runs the fixed-order chains
// L = fmaf(l_c, w_c, L), acc = fmaf(w_c, acc_c, acc) over the group's chunks c in order, w_c = expf(m_c - M_g),
// M_g = max m_c of the group. A row of one group (at most 4096 visible keys) writes acc / L as its output;
// otherwise the group writes (M_g, L_g, acc_g) to the group partials.
// Level 2 (attn_combine_groups_kernel), rows of more than one group: M = max M_g, then for g = 0, 1, ... in
// order w_g = expf(M_g - M), L = fmaf(L_g, w_g, L), acc = fmaf(w_g, acc_g, acc); out = acc / L.
// The groups are cut by chunk rank, so both levels depend on the row's own visible keys only (batch
// invariance as for the chunks); a weight is expf(m_c - M_g) * expf(M_g - M) instead of expf(m_c - M), a
// few ulp apart, inside the tolerance above.
constexpr int kCombineDims = 64, kGroupChunks = 64;  // 16 KiB of partials per level-1 block

// Groups per (row, q head) bounding every row's, and the level-1 block's dynamic shared memory.
__host__ __device__ inline int combine_groups(int nch) { return (nch + kGroupChunks - 1) / kGroupChunks; }
inline size_t combine_smem(int nch) {
  return size_t(nch < kGroupChunks ? (nch > 0 ? nch : 1) : kGroupChunks) * kCombineDims * sizeof(float);
}

// 16 bytes of partials into shared memory (zeros when !valid; src must still be a valid address).
__device__ __forceinline__ void stage16(float* dst, const float* src, bool valid) {
#if SPECD_FLASH_ATTN && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  detail::flash::cp_async16(reinterpret_cast<uint16_t*>(dst), reinterpret_cast<const uint8_t*>(src), valid);
#else
  *reinterpret_cast<float4*>(dst) = valid ? *reinterpret_cast<const float4*>(src) : make_float4(0.f, 0.f, 0.f, 0.f);
#endif
}
__device__ __forceinline__ void stage_wait_all() {
#if SPECD_FLASH_ATTN && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  detail::flash::cp_async_commit();
  detail::flash::cp_async_wait<0>();
#endif
}

// M over the block's kCombineDims threads, each holding v (every thread gets it).
__device__ __forceinline__ float block_max(float v, float* red) {
  v = warp_max(v);
  if (threadIdx.x % SPECD_WARP == 0) red[threadIdx.x / SPECD_WARP] = v;
  __syncthreads();
  v = red[0];
#pragma unroll
  for (int x = 1; x < kCombineDims / SPECD_WARP; ++x) v = fmaxf(v, red[x]);
  return v;
}

__global__ void __launch_bounds__(kCombineDims) attn_combine_kernel(const AttnParams P) {
  detail::pdl_enter();
  extern __shared__ __align__(16) float acc_s[];  // [group chunks][kCombineDims]
  __shared__ float w_s[kGroupChunks], l_s[kGroupChunks], red[kCombineDims / SPECD_WARP];
  const int slices = (P.d + kCombineDims - 1) / kCombineDims, ngr = combine_groups(P.nch);
  const int g = int(blockIdx.x % ngr), slice = int(blockIdx.x / ngr % slices);
  const int h = int(blockIdx.x / (int64_t(ngr) * slices) % P.hq);
  const int64_t il = blockIdx.x / (int64_t(ngr) * slices * P.hq), i = P.i0 + il;
  const int t = threadIdx.x, e = slice * kCombineDims + t;
  int64_t lo, cnt;
  row_range(P, i, lo, cnt);
  const int nc = int((cnt + kChunk - 1) / kChunk), c0 = g * kGroupChunks;
  float* o = P.out + (i * P.hq + h) * P.d + e;
  if (nc == 0 && g == 0 && e < P.d) *o = 0.0f;  // a query without keys
  if (c0 >= nc) return;  // uniform over the block
  const int tn = min(kGroupChunks, nc - c0);
  const float* ml = P.ml + ((il * P.hq + h) * P.nch + c0) * 2;
  // The slice's outputs of chunk c: kCombineDims floats at acc0 + c * dp, of which `pieces` 16-byte
  // pieces hold dims below dp (both chunk passes write the zero padding d .. dp).
  const float* acc0 = P.part + ((il * P.hq + h) * P.nch + c0) * int64_t(P.dp) + slice * kCombineDims;
  const int pieces = min(kCombineDims, P.dp - slice * kCombineDims) / 4;
  for (int x = t; x < tn * (kCombineDims / 4); x += kCombineDims) {
    const int c = x / (kCombineDims / 4), pc = x % (kCombineDims / 4);
    const bool ok = pc < pieces;
    stage16(acc_s + c * kCombineDims + 4 * pc, ok ? acc0 + c * int64_t(P.dp) + 4 * pc : acc0, ok);
  }
  // A max is order-free: M_g is the same whichever thread reads which chunk.
  const float m = t < tn ? ml[2 * t] : -INFINITY;
  const float M = block_max(m, red);
  if (t < tn) {
    w_s[t] = expf(m - M);
    l_s[t] = ml[2 * t + 1];
  }
  stage_wait_all();
  __syncthreads();  // the group's partials and weights are visible
  float L = 0.0f, acc = 0.0f;
  const float* const a = acc_s + t;
  auto step = [&](int x) {
    L = fmaf(l_s[x], w_s[x], L);
    acc = fmaf(w_s[x], a[x * kCombineDims], acc);
  };
  if (tn == kGroupChunks) {  // unrolled: the shared-memory loads run ahead of the two chains
#pragma unroll 16
    for (int x = 0; x < kGroupChunks; ++x) step(x);
  } else {
    for (int x = 0; x < tn; ++x) step(x);
  }
  if (nc <= kGroupChunks) {  // one group: this is the output
    if (e < P.d) *o = __fdiv_rn(acc, L);
    return;
  }
  const int64_t gi = (il * P.hq + h) * ngr + g;
  if (e < P.dp) P.gpart[gi * P.dp + e] = acc;
  if (t == 0 && slice == 0) {  // (every slice has the same M_g, L_g)
    P.gml[2 * gi] = M;
    P.gml[2 * gi + 1] = L;
  }
}

__global__ void __launch_bounds__(kCombineDims) attn_combine_groups_kernel(const AttnParams P) {
  detail::pdl_enter();
  __shared__ float red[kCombineDims / SPECD_WARP];
  const int slices = (P.d + kCombineDims - 1) / kCombineDims, ngr = combine_groups(P.nch);
  const int64_t il = blockIdx.x / (int64_t(P.hq) * slices), i = P.i0 + il;
  const int h = int(blockIdx.x / slices % P.hq), t = threadIdx.x;
  const int e = int(blockIdx.x % slices) * kCombineDims + t;
  int64_t lo, cnt;
  row_range(P, i, lo, cnt);
  const int ng = combine_groups(int((cnt + kChunk - 1) / kChunk));
  if (ng <= 1) return;  // written by level 1 (uniform over the block)
  const float* gml = P.gml + (il * P.hq + h) * ngr * 2;
  const float* gacc = P.gpart + (il * P.hq + h) * ngr * int64_t(P.dp) + (e < P.dp ? e : 0);
  float M = -INFINITY;
  for (int x = t; x < ng; x += kCombineDims) M = fmaxf(M, gml[2 * x]);
  M = block_max(M, red);
  float L = 0.0f, acc = 0.0f;
#pragma unroll 8
  for (int x = 0; x < ng; ++x) {
    const float w = expf(gml[2 * x] - M);
    L = fmaf(gml[2 * x + 1], w, L);
    acc = fmaf(w, gacc[x * int64_t(P.dp)], acc);
  }
  if (e < P.d) P.out[(i * P.hq + h) * P.d + e] = __fdiv_rn(acc, L);
}

// The q / cache / position / output fields that AttnParams and flash::Params share.
template <class Params>
void set_views(Params& P, const Tensor& q, const Tensor& kc, const Tensor& vc, const Tensor& q_pos, const Tensor& out) {
  P.q = q.ptr<float>();
  P.kc = static_cast<const uint8_t*>(kc.data);
  P.vc = static_cast<const uint8_t*>(vc.data);
  P.k_row_stride = kc.strides[0];
  P.k_head_stride = kc.strides[1];
  P.v_row_stride = vc.strides[0];
  P.v_head_stride = vc.strides[1];
  P.q_pos = q_pos.ptr<int32_t>();
  P.out = out.ptr<float>();
}

// Whether a cache's data and every head row are 16-byte aligned (16-byte loads and copies).
bool rows_aligned16(const Tensor& c) {
  return detail::aligned16(c.data) && c.strides[0] % 16 == 0 && c.strides[1] % 16 == 0;
}

// Whether the chunk pass has so few (row, KV head, chunk) blocks that the GPU would idle: then one
// q head per block (hs = 1), so a GQA group's heads run in parallel blocks rather than one after
// another in one block (K/V of a chunk are then read once per head, from L2). hs never changes a
// head's arithmetic (each head has its own q row, scores, softmax and accumulators, and how keys
// and dims are split over threads depends on head_dim only), so any choice keeps every result and
// batch invariance. nch = ceil(kv_len / kChunk) bounds the active chunks per row from above (inside
// a CUDA graph kv_len is only a bound): a loose bound can only keep the wider default.
bool few_chunk_blocks(int64_t n, int64_t hkv, int64_t nch) {
  return n * hkv * nch < 2 * int64_t(detail::sm_count());
}

template <DType KT>
void launch_chunks(DType vt, const AttnParams& P, unsigned blocks, size_t shmem, cudaStream_t s) {
  switch (vt) {
    case DType::F32:
      detail::launch_kernel<attn_chunk_kernel<KT, DType::F32>>("attn_chunk_kernel", blocks, kThreads, shmem, s, P);
      break;
    case DType::F16:
      detail::launch_kernel<attn_chunk_kernel<KT, DType::F16>>("attn_chunk_kernel", blocks, kThreads, shmem, s, P);
      break;
    default:
      detail::launch_kernel<attn_chunk_kernel<KT, DType::Q8_0>>("attn_chunk_kernel", blocks, kThreads, shmem, s, P);
      break;
  }
}

#if SPECD_FLASH_ATTN
namespace cmma = detail::chunk_mma;
static_assert(cmma::kChunk == kChunk, "the tensor-core chunk pass writes the combine's chunks");

// Whether the exact path's chunk pass runs on tensor cores (attention_chunk_mma.cuh): F16 K and V caches
// of head_dim 64, 128 or 256 with 16-byte aligned head rows, on an sm_80+ device. Depends on the caches
// and the device alone (never on the rows, the mask or the window), so every call on a model's caches
// takes the same path.
bool use_chunk_mma(const Tensor& kc, const Tensor& vc, int64_t d) {
  if (kc.dtype != DType::F16 || vc.dtype != DType::F16 || !cmma::supported_dim(d)) return false;
  return detail::compute_major() >= 8 && rows_aligned16(kc) && rows_aligned16(vc);
}

// The chunk pass of one slice of rows on tensor cores.
void launch_chunk_mma(const AttnParams& A, int64_t d, cudaStream_t s, const char* op) {
  // Without a window every row's chunk c starts at rank 64 c from position 0: rows pack into m-tiles (the
  // kernel reads a chunk once per row instead where the rows' compacted positions differ under a mask or
  // a key some row does not see holds a non-finite V).
  const bool packed = A.window == 0;
  const int64_t resident = int64_t(detail::sm_count()) * cmma::kMinBlocks * cmma::kWarps;
  const cmma::Plan pl = cmma::plan(A.rows, A.r, A.hkv, A.nch, packed, resident, int(d));
  detail::check_grid(pl.blocks, op);
  SPECD_CHECK(A.dp == d, op, ": the tensor-core chunk pass writes partials of head_dim ", d, ", not ", A.dp);
  cmma::Params P{};
  static_cast<detail::SplitKParams&>(P) = A;
  cmma::set_plan(P, pl);
  const unsigned blocks = unsigned(pl.blocks);
  const bool idx = A.idx != nullptr;
  constexpr unsigned threads = cmma::kWarps * 32;
  const bool launched = cmma::with_instance(int(d), pl.ds, [&](auto dc, auto dsc) {
    constexpr int D = decltype(dc)::value, DS = decltype(dsc)::value;
    const char* name = "attn_chunk_mma_kernel";
    if (idx)
      detail::launch_kernel<cmma::attn_chunk_mma_kernel<D, true, DS>>(name, blocks, threads, 0, s, P);
    else
      detail::launch_kernel<cmma::attn_chunk_mma_kernel<D, false, DS>>(name, blocks, threads, 0, s, P);
  });
  SPECD_CHECK(launched, op, ": no tensor-core chunk pass for head_dim ", d, " with ", pl.ds, " warps per chunk");
}
#endif  // SPECD_FLASH_ATTN

// ----------------------------------------------------------------------------- flash attention

#if SPECD_FLASH_ATTN
namespace flash = detail::flash;

// Dynamic shared memory a flash block may use: the device's opt-in limit less 1 KiB for the kernel's
// static arrays (64 bytes).
size_t flash_smem_limit() { return size_t(std::max(0, detail::max_smem_optin() - 1024)); }

// Whether a checked call (n >= 1 rows, kv_len >= 1) runs attn_flash_kernel: the caller allows the
// inexact path (exact == false: the target's prefill chunks), n >= flash::kMinRows (64: the verify
// widths 1..16 and short prefill tails keep the split-K kernel; 64 rows of the 27B are a grid of only
// 4 row blocks x 4 KV heads, still expected to beat the CUDA-core kernel but not yet timed: tune with
// tools/device/gpu_report.py), no mask (tree verify, drafter blocks), F16 K and V caches,
// head_dim 64, 128 or 256, q / cache head rows 16-byte aligned (cp.async and float4 loads), and the
// block's shared memory within the device's opt-in limit (head_dim 256 with 8 warps: 192 KiB; H100 /
// H200 allow 227 KiB). Causal or not, windowed or not: the kernel masks each row's [lo, hi) as the
// split-K kernel computes it.
bool use_flash(const Tensor& q, const Tensor& kc, const Tensor& vc, const cpu::AttentionArgs& a, bool exact) {
  const int64_t n = q.dim(0), hq = q.dim(1), d = q.dim(2), hkv = kc.dim(1);
  if (exact || a.mask || n < flash::kMinRows || !flash::supported_dim(d)) return false;
  if (kc.dtype != DType::F16 || vc.dtype != DType::F16 || detail::compute_major() < 8) return false;
  if (!detail::aligned16(q.data) || !rows_aligned16(kc) || !rows_aligned16(vc)) return false;
  return flash::plan(n, hkv, hq / hkv, d).smem <= flash_smem_limit();
}

// Launches attn_flash_kernel<D>; the first call per instance raises its dynamic shared memory limit to
// what its largest plan needs, capped at flash_smem_limit() (use_flash checked the plan against it).
template <int D>
void launch_flash(const flash::Params& P, const flash::Plan& pl, cudaStream_t s) {
  static const bool limit_set = [] {
    const int bytes = int(std::min(flash::max_smem(D), flash_smem_limit()));
    SPECD_GPU_CHECK(cudaFuncSetAttribute(flash::attn_flash_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    return true;
  }();
  (void)limit_set;
  detail::launch_kernel<flash::attn_flash_kernel<D>>("attn_flash_kernel", unsigned(pl.blocks), unsigned(pl.warps * 32),
                                                      pl.smem, s, P);
}

Tensor flash_attention(const Tensor& q, const Tensor& kc, const Tensor& vc, const Tensor& q_pos,
                       const cpu::AttentionArgs& a, const char* op) {
  const int64_t n = q.dim(0), hq = q.dim(1), d = q.dim(2), hkv = kc.dim(1);
  const flash::Plan pl = flash::plan(n, hkv, hq / hkv, d);
  detail::check_grid(pl.blocks, op);
  SPECD_CHECK(pl.row_blocks <= 0x7fffffff, op, ": too many rows for one launch (", n, ")");
  Tensor out = Tensor::empty(q.shape, DType::F32, Device::GPU);
  Tensor dpos = detail::i32_on_gpu(q_pos);
  const double scale = a.scale ? double(*a.scale) : 1.0 / std::sqrt(double(d));
  flash::Params P = flash::params(pl, n, hq, hkv, a.kv_len, a.window, a.causal, scale);
  set_views(P, q, kc, vc, dpos, out);
  cudaStream_t s = detail::stream();
  switch (d) {
    case 64: launch_flash<64>(P, pl, s); break;
    case 128: launch_flash<128>(P, pl, s); break;
    default: launch_flash<256>(P, pl, s); break;
  }
  return out;
}
#endif  // SPECD_FLASH_ATTN

}  // namespace

void kv_write(const Tensor& cache, const Tensor& x, const Tensor& rows, bool trusted) {
  const char* op = "kv_write";
  check_cache(cache, op, "cache");
  detail::check_gpu_tensor(x, DType::F32, 3, op, "x");
  check_index(rows, op, "rows", 1);
  cpu::check_kv_write_shapes(cache, x, rows, op, "cache", "x");
  const int64_t n = x.dim(0), cap = cache.dim(0), hkv = cache.dim(1), d = cache.dim(2);
  SPECD_CHECK(d <= 0x7fffffff && hkv <= 0x7fffffff, op, ": cache dimensions too large");
  if (detail::check_on_host(rows, trusted)) cpu::check_kv_rows(detail::host_i32(rows), cap, op);
  if (n == 0 || hkv == 0 || d == 0) return;
  detail::check_grid(n * hkv, op);
  detail::EnqueueGuard guard;  // in place (no output allocation): waits while another thread captures
  Tensor drows = detail::i32_on_gpu(rows);
  auto* dst = static_cast<uint8_t*>(cache.data);
  const unsigned blocks = unsigned(n * hkv);
  cudaStream_t s = detail::stream();
  const int64_t rs = cache.strides[0], hs = cache.strides[1];
  switch (cache.dtype) {
    case DType::F32:
      detail::launch_kernel<kv_write_kernel<DType::F32>>("kv_write_kernel", blocks, kWriteThreads, 0, s, dst,
                                                         x.ptr<float>(), drows.ptr<int32_t>(), int(hkv), int(d), rs, hs,
                                                         cap);
      break;
    case DType::F16:
      detail::launch_kernel<kv_write_kernel<DType::F16>>("kv_write_kernel", blocks, kWriteThreads, 0, s, dst,
                                                         x.ptr<float>(), drows.ptr<int32_t>(), int(hkv), int(d), rs, hs,
                                                         cap);
      break;
    default:
      detail::launch_kernel<kv_write_kernel<DType::Q8_0>>("kv_write_kernel", blocks, kWriteThreads, 0, s, dst,
                                                          x.ptr<float>(), drows.ptr<int32_t>(), int(hkv), int(d), rs,
                                                          hs, cap);
      break;
  }
}

Tensor attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& q_pos,
                 const cpu::AttentionArgs& a, bool trusted, bool exact) {
  const char* op = "attention";
  detail::check_gpu_tensor(q, DType::F32, 3, op, "q");
  check_cache(k_cache, op, "k_cache");
  check_cache(v_cache, op, "v_cache");
  SPECD_CHECK(k_cache.shape == v_cache.shape, op, ": k_cache and v_cache shapes differ");
  int64_t n = q.dim(0), hq = q.dim(1), d = q.dim(2), hkv = k_cache.dim(1);
  SPECD_CHECK(k_cache.dim(2) == d, op, ": cache head_dim ", k_cache.dim(2), " differs from q head_dim ", d);
  SPECD_CHECK(hkv > 0 && hq % hkv == 0, op, ": q heads (", hq, ") must be a multiple of cache KV heads (", hkv, ")");
  SPECD_CHECK(a.kv_len >= 0 && a.kv_len <= k_cache.dim(0), op, ": kv_len must be in [0, capacity=", k_cache.dim(0),
              "], got ", a.kv_len);
  SPECD_CHECK(a.window >= 0, op, ": window must be >= 0, got ", a.window);
  check_index(q_pos, op, "q_pos", 1);
  SPECD_CHECK(q_pos.dim(0) == n, op, ": q_pos has ", q_pos.dim(0), " entries, q has ", n, " rows");
  if (a.mask) {
    check_index(*a.mask, op, "mask", 2);
    SPECD_CHECK(a.mask->dim(0) == n && a.mask->dim(1) == a.kv_len, op, ": mask must have shape [", n, ", ",
                a.kv_len, "] (n, kv_len), got [", a.mask->dim(0), ", ", a.mask->dim(1), "]");
  }
  if (a.scale) SPECD_CHECK(std::isfinite(*a.scale), op, ": scale must be finite, got ", *a.scale);
  SPECD_CHECK(d <= kMaxDim, op, ": the GPU op supports head_dim <= ", kMaxDim, ", got ", d);
  SPECD_CHECK(a.kv_len <= 0x7fffffff, op, ": kv_len too large");
  if (detail::check_on_host(q_pos, trusted)) {
    std::vector<int32_t> pv = detail::host_i32(q_pos);
    for (int64_t i = 0; i < n; ++i)
      SPECD_CHECK(pv[size_t(i)] >= 0, "attention: q_pos must be >= 0, got ", pv[size_t(i)], " at index ", i);
  }
  if (n == 0 || hq == 0 || d == 0 || a.kv_len == 0) return Tensor::zeros(q.shape, DType::F32, Device::GPU);
#if SPECD_FLASH_ATTN
  if (use_flash(q, k_cache, v_cache, a, exact)) return flash_attention(q, k_cache, v_cache, q_pos, a, op);
#else
  (void)exact;
#endif
  Tensor out = Tensor::empty(q.shape, DType::F32, Device::GPU);
  Tensor dpos = detail::i32_on_gpu(q_pos);
  Tensor dmask = a.mask ? detail::i32_on_gpu(*a.mask) : Tensor();
  cudaStream_t s = detail::stream();

  const int64_t r = hq / hkv, dg = (d + 7) / 8, dp = dg * 8;
  const int64_t nch = (a.kv_len + kChunk - 1) / kChunk;
  const int64_t hs_max =
      few_chunk_blocks(n, hkv, nch) ? 1 : std::max<int64_t>(1, std::min<int64_t>(kMaxHs, 2048 / dp));
  const int64_t nsub = (r + hs_max - 1) / hs_max, hs = (r + nsub - 1) / nsub;
  int w = 1;
  while (w < dg && w < SPECD_WARP) w *= 2;
  // 16-byte loads: d % 8 == 0 and every head row 16-byte aligned (Q8_0 always decodes bytewise).
  auto aligned = [&](const Tensor& c) { return c.dtype == DType::Q8_0 || rows_aligned16(c); };
  const bool vec = d % 8 == 0 && aligned(k_cache) && aligned(v_cache);

  AttnParams P{};
  set_views(P, q, k_cache, v_cache, dpos, out);
  P.kv_len = a.kv_len;
  P.window = a.window;
  P.causal = a.causal ? 1 : 0;
  P.hq = int(hq);
  P.hkv = int(hkv);
  P.r = int(r);
  P.d = int(d);
  P.dg = int(dg);
  P.dp = int(dp);
  P.hs = int(hs);
  P.nsub = int(nsub);
  P.nch = int(nch);
  P.w = w;
  P.vec = vec ? 1 : 0;
  P.scale = a.scale ? *a.scale : float(1.0 / std::sqrt(double(d)));

  Tensor idx, cnt, seg;
  if (a.mask) {  // visible positions of each row, compacted (so chunks follow the visible sequence)
    idx = Tensor::empty({n, a.kv_len}, DType::I32, Device::GPU);
    cnt = Tensor::empty({n}, DType::I32, Device::GPU);
    detail::mask::Params M{};
    M.mask = dmask.ptr<int32_t>();
    M.q_pos = dpos.ptr<int32_t>();
    M.kv_len = a.kv_len;
    M.window = a.window;
    M.causal = P.causal;
    M.nseg = detail::mask::segments(a.kv_len);
    M.idx = idx.ptr<int32_t>();
    M.cnt = cnt.ptr<int32_t>();
    const int64_t blocks = n * M.nseg;
    detail::check_grid(blocks, op);
    if (M.nseg > 1) {  // pass 1: the segments' counts (a row of one segment starts at rank 0)
      seg = Tensor::empty({n, M.nseg}, DType::I32, Device::GPU);
      M.seg = seg.ptr<int32_t>();
      detail::launch_kernel<detail::mask::attn_mask_count_kernel>("attn_mask_count_kernel", unsigned(blocks),
                                                                  detail::mask::kThreads, 0, s, M);
    }
    detail::launch_kernel<detail::mask::attn_mask_compact_kernel>("attn_mask_compact_kernel", unsigned(blocks),
                                                                  detail::mask::kThreads, 0, s, M);
    P.idx = idx.ptr<int32_t>();
    P.cnt = cnt.ptr<int32_t>();
  }

  // Partials for a slice of rows; slicing never changes a row's arithmetic.
  const int64_t ngr = combine_groups(int(nch));
  const int64_t per_row = hq * nch * (dp + 2) + (ngr > 1 ? hq * ngr * (dp + 2) : 0);
  const int64_t rows_per = std::max<int64_t>(1, std::min<int64_t>(n, kScratchFloats / per_row));
  Tensor scratch = Tensor::empty({rows_per * per_row}, DType::F32, Device::GPU);
  const size_t shmem = size_t(2 * hs * dp + hs * kChunk) * sizeof(float) + kChunk * sizeof(int32_t);
  const int64_t combine_slices = (d + kCombineDims - 1) / kCombineDims;
#if SPECD_FLASH_ATTN
  const bool chunk_mma = use_chunk_mma(k_cache, v_cache, d);
#endif
  for (int64_t i0 = 0; i0 < n; i0 += rows_per) {
    const int64_t rows = std::min(rows_per, n - i0);
    P.i0 = i0;
    P.rows = rows;
    P.part = scratch.ptr<float>();
    P.ml = scratch.ptr<float>() + rows * hq * nch * dp;
    P.gpart = P.ml + rows * hq * nch * 2;
    P.gml = P.gpart + rows * hq * ngr * dp;
#if SPECD_FLASH_ATTN
    if (chunk_mma) {
      launch_chunk_mma(P, d, s, op);
    } else
#endif
    {
      const int64_t blocks = rows * hkv * nsub * nch;
      detail::check_grid(blocks, op);
      switch (k_cache.dtype) {
        case DType::F32: launch_chunks<DType::F32>(v_cache.dtype, P, unsigned(blocks), shmem, s); break;
        case DType::F16: launch_chunks<DType::F16>(v_cache.dtype, P, unsigned(blocks), shmem, s); break;
        default: launch_chunks<DType::Q8_0>(v_cache.dtype, P, unsigned(blocks), shmem, s); break;
      }
    }
    detail::check_grid(rows * hq * combine_slices * ngr, op);
    detail::launch_kernel<attn_combine_kernel>("attn_combine_kernel", unsigned(rows * hq * combine_slices * ngr),
                                               kCombineDims, combine_smem(P.nch), s, P);
    if (ngr > 1)  // some row may have more than one group
      detail::launch_kernel<attn_combine_groups_kernel>("attn_combine_groups_kernel", unsigned(rows * hq * combine_slices),
                                                        kCombineDims, 0, s, P);
  }
  return out;
}

}  // namespace specd::gpu
