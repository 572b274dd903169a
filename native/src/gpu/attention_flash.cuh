// Tensor-core flash attention for prefill (FlashAttention-2: Dao, "FlashAttention-2: Faster Attention
// with Better Parallelism and Work Partitioning", 2023): the forward pass of softmax(scale q k^T) v over
// F16 K / V caches with mma.sync m16n8k16 (F16 inputs, F32 accumulation) and an online softmax in F32.
// Included by attention.cu, which takes this path only for gpu::attention(..., exact = false) calls of
// at least kMinRows query rows without a mask on F16 caches of head_dim 64, 128 or 256 (the target's
// prefill chunks); everything else (verify, decode, tree masks, F32 / Q8_0 caches, other head_dims,
// HIP) runs the exact split-K kernel. NVIDIA only (mma.sync / ldmatrix / cp.async inline PTX, sm_80+):
// SPECD_FLASH_ATTN is 0 on HIP. Also compiled for the host by tests/gpu/host_emu/attn_main.cpp
// (SPECD_HOST_EMU: every warp-wide instruction emulated from the PTX ISA fragment layouts), which runs
// the kernel's logic on the CPU against a numpy reference (tests/gpu/test_gpu_flash_attention_host.py).
//
// Row semantics: exactly cpu::attention's without a mask. Query row i (position q_pos[i]) sees the keys
// j in [lo_i, hi_i), lo_i = max(0, q_pos[i] - window + 1) when window > 0 (else 0), hi_i = min(kv_len,
// q_pos[i] + 1) when causal (else kv_len); q head h reads KV head h / (Hq / Hkv); a row without a
// visible key gets zeros.
//
// Work split. A block takes `slabs` slabs of 16 consecutive query rows and `hs` q heads of one KV head's
// GQA group (hs * slabs warps, at most kMaxWarps; a group of more than kMaxWarps heads is split over
// nsub blocks): warp w computes the 16 rows of slab w / hs for head w % hs, i.e. one m16 tile of the
// MMAs, so every K / V tile the block stages in shared memory serves all the group's heads (GQA 6:1:
// one slab of 6 heads, 6 warps; 1:1: 4 slabs of one head). The block walks the key tiles (kKeys keys,
// aligned to multiples of kKeys from key 0) that meet the union of its rows' ranges [kmin, kmax),
// K and V of tile t + 1 loading (cp.async, 16-byte copies, zero-filled outside [kmin, kmax)) while tile
// t is computed (two stages). A warp skips tiles outside its own rows' union (causal: the tiles above
// the diagonal); inside the tile it masks each score whose key is outside its row's range (only when
// the tile is not wholly inside every row's range of the warp).
//
// Arithmetic per warp and key tile (FlashAttention-2, Algorithm 1, one query tile):
//   S = Q K^T            mma m16n8k16: Q staged once per block (F32 q rounded to F16 when staged), K as
//                        stored (F16); products exact, sums in F32 (the tensor core's accumulation)
//   x = S * (scale log2 e)  (-inf where masked)            one F32 multiply, never fused
//   m' = max(m, rowmax x); mu = (m' == -inf ? 0 : m');  alpha = 2^(m - mu);  p = 2^(x - mu)  (ex2.approx)
//   l = l alpha + rowsum p (F32, unrounded p);  O = O alpha + P V  (P rounded to F16 for the MMA, V F16)
// and at the end out = O / l (0 when l == 0: no visible key). A tile fully masked for a row leaves its
// m, l and O unchanged bit for bit (alpha = 1 or O = l = 0, p = 0), and tiles sit at absolute key
// positions, so each row's result depends only on its own q, its key range and the cache: the path is
// deterministic and batch invariant (a row's result does not depend on the other rows of the call), but
// it is not the exact path's arithmetic and not within that path's tolerance.
//
// Error vs the CPU op (derivation in test_gpu_ops2.py's flash tests): with u = 2^-11 (F16 unit
// roundoff), q rounded to F16 perturbs each score by at most u * scale * sum_e |q_e k_e| =: E_i, which
// moves the softmax weights by at most ~2 E_i in L1; P rounded to F16 perturbs each weight by at most u
// relative; the F32 parts (accumulation, ex2.approx ~2^-22) are far below. So |out - cpu| <= max|v| *
// (2 E_i + u) to first order (tests/gpu/flash_ref.py). The bound is loose (the perturbations are random
// in sign): for q, k, v ~ N(0, 1) the largest error of a call is ~1e-4 * max|v| (host emulation), ~6e-4
// with q * 4 (a peaky softmax); the tests allow 2e-3 * max|v|.
// A V element outside a row's range but inside [kmin, kmax) (in the tile of a row's diagonal) is
// multiplied by an exact zero weight. Every cache row below kv_len that the model reads is written, but a
// written F16 value can be inf (|v| > 65504): then the rows of that tile that do not see the key get NaN
// where a call of those rows alone would not (a known limit of this inexact prefill path; the exact
// path's tensor-core chunk pass reads such a chunk once per row instead).
#pragma once

#ifndef SPECD_HOST_EMU
#include "common.cuh"  // portability.h: SPECD_HIP, before it is tested below
#endif

#if !SPECD_HIP
#define SPECD_FLASH_ATTN 1
#else
#define SPECD_FLASH_ATTN 0
#endif

#if SPECD_FLASH_ATTN
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "attention_rows.cuh"
#include "pdl.cuh"
#include "warp_reduce.cuh"

namespace specd::gpu::detail::flash {

constexpr int kMinRows = 64;   // query rows from which an exact=false call takes this path
constexpr int kKeys = 64;      // keys per K / V tile
constexpr int kMaxWarps = 8;   // warps per block (hs * slabs)
constexpr int kStages = 2;     // K / V tiles in flight (double buffering)

// Whether head_dim d has an instance (the swizzle needs d / 8 >= 8 chunks per row).
inline bool supported_dim(int64_t d) { return d == 64 || d == 128 || d == 256; }

struct Params {
  const float* q;                       // F32 [n, hq, D], contiguous, 16-byte aligned
  const uint8_t* kc;                    // F16 caches [capacity, hkv, D], head rows 16-byte aligned
  const uint8_t* vc;
  int64_t k_row_stride, k_head_stride;  // bytes
  int64_t v_row_stride, v_head_stride;
  const int32_t* q_pos;                 // [n]
  float* out;                           // F32 [n, hq, D]
  int64_t n, window;
  int kv_len, causal, hq, hkv, r;       // r = hq / hkv
  int hs, nsub, slabs, row_blocks;      // the launch plan (Plan)
  float scale_log2;                     // scale * log2(e)
};

// The launch plan of n query rows, hkv KV heads of r q heads each, head_dim d: heads per block hs
// (nsub blocks per KV head), slabs of 16 rows per block, warps = hs * slabs, the grid and the dynamic
// shared memory (Q of every warp, then kStages K tiles, then kStages V tiles, F16).
struct Plan {
  int hs, nsub, slabs, warps;
  int64_t row_blocks, blocks;
  size_t smem;
};

inline Plan plan(int64_t n, int64_t hkv, int64_t r, int64_t d) {
  Plan p{};
  p.nsub = int((r + kMaxWarps - 1) / kMaxWarps);
  p.hs = int((r + p.nsub - 1) / p.nsub);
  p.slabs = (4 + p.hs - 1) / p.hs;  // at least 4 warps per block (1:1 -> 4 slabs of 64 rows)
  p.warps = p.hs * p.slabs;
  p.row_blocks = (n + 16 * p.slabs - 1) / (16 * p.slabs);
  p.blocks = p.row_blocks * hkv * p.nsub;
  p.smem = size_t(p.warps * 16 + 2 * kStages * kKeys) * size_t(d) * 2;
  return p;
}

// Params of a call of plan ``pl``: its geometry, the launch plan and scale * log2(e); the caller sets
// the pointers and strides (q, kc, vc, the strides, q_pos, out).
inline Params params(const Plan& pl, int64_t n, int64_t hq, int64_t hkv, int64_t kv_len, int64_t window, bool causal,
                     double scale) {
  Params P{};
  P.n = n;
  P.window = window;
  P.kv_len = int(kv_len);
  P.causal = causal ? 1 : 0;
  P.hq = int(hq);
  P.hkv = int(hkv);
  P.r = int(hq / hkv);
  P.hs = pl.hs;
  P.nsub = pl.nsub;
  P.slabs = pl.slabs;
  P.row_blocks = int(pl.row_blocks);
  P.scale_log2 = float(scale * 1.4426950408889634);  // log2(e)
  return P;
}

// Largest dynamic shared memory an instance may be launched with (kMaxWarps warps).
inline size_t max_smem(int64_t d) { return size_t(kMaxWarps * 16 + 2 * kStages * kKeys) * size_t(d) * 2; }

// --- instructions -------------------------------------------------------------------------------

// d += a * b, mma.sync m16n8k16 row.col f16 x f16 -> f32 (PTX ISA "Matrix fragments for mma.m16n8k16",
// lane = 4 g + t): A reg0 = (row g, k 2t, 2t+1), reg1 = (row g+8, k 2t..), reg2 = (row g, k 8+2t..),
// reg3 = (row g+8, k 8+2t..); B reg0 = (k 2t, 2t+1, col g), reg1 = (k 8+2t.., col g); the lower 16 bits
// hold the lower k. C/D: d0, d1 = (row g, col 2t, 2t+1), d2, d3 = (row g+8, col 2t, 2t+1).
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(SPECD_HOST_EMU)
  specd_emu_mma(d, a, make_uint2(b0, b1));
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();  // never launched below sm_80 (the build targets sm_90)
#endif
}

// ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16: lanes 8 m .. 8 m + 7 give the addresses of the 8
// rows (16 bytes each) of matrix m; register m of lane 4 g + t = (row g, elements 2t, 2t+1), or with
// trans = (rows 2t, 2t+1, element g) (lower 16 bits: the first).
template <bool Trans>
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const uint16_t* p) {
#if defined(SPECD_HOST_EMU)
  specd_emu_ldmatrix_x4(r, p, Trans);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t a = uint32_t(__cvta_generic_to_shared(p));
  if constexpr (Trans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  }
#else
  __trap();
#endif
}

// 16 bytes global -> shared without registers (cp.async.cg); zero-filled instead when !valid (src is
// then not read, but must still be a valid address).
__device__ __forceinline__ void cp_async16(uint16_t* dst, const uint8_t* src, bool valid) {
#if defined(SPECD_HOST_EMU)
  specd_emu_cp_async16(dst, src, valid);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t s = uint32_t(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(valid ? 16 : 0) : "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if !defined(SPECD_HOST_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
// Waits until at most N of this thread's committed groups are pending (the emulation copies at once).
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if !defined(SPECD_HOST_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// 2^x (ex2.approx.ftz.f32: relative error ~2^-22, 2^-inf = +0).
__device__ __forceinline__ float ex2(float x) {
#if defined(SPECD_HOST_EMU)
  return std::exp2(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

// Two floats rounded to F16 (nearest even) in one register, lo in the lower 16 bits.
__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
#if defined(SPECD_HOST_EMU)
  return uint32_t(f16_rn(lo)) | (uint32_t(f16_rn(hi)) << 16);
#else
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
#endif
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, SPECD_SHFL_XOR(v, 1));
  return fmaxf(v, SPECD_SHFL_XOR(v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v = __fadd_rn(v, SPECD_SHFL_XOR(v, 1));
  return __fadd_rn(v, SPECD_SHFL_XOR(v, 2));
}

// --- layout ----------------------------------------------------------------------------------------

// Offset (in F16 elements) of 16-byte chunk c of row `row` in a [rows][D] F16 tile in shared memory,
// XOR-swizzled (chunk c of row r stored at chunk c ^ (r % 8)) so that the 8 row addresses of an
// ldmatrix matrix (8 consecutive rows, one chunk) and the 16-byte stores hit 8 distinct bank groups.
template <int D>
__device__ __forceinline__ int swz(int row, int c) {
  return row * D + ((c ^ (row & 7)) << 3);
}

// Row i's visible key range [lo, hi) (lo = kv_len, hi = 0 when empty or past n).
__device__ __forceinline__ void row_range(const Params& P, int64_t i, int& lo, int& hi) {
  lo = P.kv_len;
  hi = 0;
  if (i >= P.n) return;
  int64_t l, h;
  visible_range(P.q_pos[i], P.window, P.causal != 0, P.kv_len, l, h);
  if (l < h) {
    lo = int(l);
    hi = int(h);
  }
}

// --- the kernel ------------------------------------------------------------------------------------

// Blocks per multiprocessor an instance is compiled for (registers: 65536 / (256 threads * blocks)):
// head_dim 64 fits 2 (<= 128 registers, no spills; ptxas -v), 128 and 256 need more than 128.
__host__ __device__ constexpr int min_blocks(int d) { return d == 64 ? 2 : 1; }

// One block per (row block, KV head, head sub-group), row blocks in reverse order (causal: the rows
// with the most keys start first). hs * slabs warps; dynamic shared memory Plan::smem.
template <int D>
__global__ void __launch_bounds__(kMaxWarps * 32, min_blocks(D)) attn_flash_kernel(const Params P) {
  pdl_enter();
  static_assert(D % 64 == 0 && D <= 256, "head_dim 64, 128 or 256");
  constexpr int kC = D / 8;  // 16-byte chunks per row
#if defined(SPECD_HOST_EMU)
  uint16_t* const sQ = reinterpret_cast<uint16_t*>(specd_emu_dyn_smem);
#else
  extern __shared__ __align__(16) uint16_t flash_smem[];
  uint16_t* const sQ = flash_smem;
#endif
  __shared__ int s_lo[kMaxWarps], s_hi[kMaxWarps];
  const int nw = P.hs * P.slabs, nthr = nw * 32;
  uint16_t* const sK = sQ + nw * 16 * D;
  uint16_t* const sV = sK + kStages * kKeys * D;

  int64_t b = blockIdx.x;
  const int sub = int(b % P.nsub);
  b /= P.nsub;
  const int g = int(b % P.hkv);
  const int64_t rb = P.row_blocks - 1 - b / P.hkv;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int hh = warp % P.hs, slab = warp / P.hs;
  const bool active = sub * P.hs + hh < P.r;  // a ragged last head sub-group leaves warps idle
  const int h = g * P.r + sub * P.hs + hh;
  const int64_t row0 = rb * 16 * P.slabs + int64_t(slab) * 16;  // first query row of the warp
  const int gq = lane >> 2, tq = lane & 3;

  // Key ranges: the warp's rows (lanes 16..31 repeat 0..15), the thread's rows gq and gq + 8.
  int wlo, whi, wlomax, whimin;
  {
    int lo, hi;
    row_range(P, row0 + (lane & 15), lo, hi);
    wlo = warp_min(lo);
    whi = warp_max(hi);
    wlomax = warp_max(lo);
    whimin = warp_min(hi);
    if (lane == 0) {
      s_lo[warp] = wlo;
      s_hi[warp] = whi;
    }
  }
  int lo0, hi0, lo1, hi1;
  row_range(P, row0 + gq, lo0, hi0);
  row_range(P, row0 + gq + 8, lo1, hi1);

  // Q of every warp: F32 -> F16 (nearest even), zeros past n and for idle warps.
  for (int x = tid; x < nw * 16 * kC; x += nthr) {
    const int rr = x / kC, c = x % kC, w = rr / 16;
    const int64_t i = rb * 16 * P.slabs + int64_t(w / P.hs) * 16 + rr % 16;
    const int hw = sub * P.hs + w % P.hs;
    uint4 v = {0u, 0u, 0u, 0u};
    if (i < P.n && hw < P.r) {
      const float4* src = reinterpret_cast<const float4*>(P.q + (i * P.hq + g * P.r + hw) * D) + 2 * c;
      const float4 a = src[0], bq = src[1];
      v.x = pack_f16x2(a.x, a.y);
      v.y = pack_f16x2(a.z, a.w);
      v.z = pack_f16x2(bq.x, bq.y);
      v.w = pack_f16x2(bq.z, bq.w);
    }
    *reinterpret_cast<uint4*>(sQ + w * 16 * D + swz<D>(rr % 16, c)) = v;
  }
  __syncthreads();
  int kmin = P.kv_len, kmax = 0;
  for (int w = 0; w < nw; ++w) {
    kmin = min(kmin, s_lo[w]);
    kmax = max(kmax, s_hi[w]);
  }
  const int tile0 = kmin / kKeys;
  const int ntiles = kmax > kmin ? (kmax + kKeys - 1) / kKeys - tile0 : 0;  // uniform over the block

  const uint8_t* const kbase = P.kc + int64_t(g) * P.k_head_stride;
  const uint8_t* const vbase = P.vc + int64_t(g) * P.v_head_stride;
  // K and V of tile t into stage t % kStages: keys outside [kmin, kmax) zero-filled.
  auto load_tile = [&](int t) {
    const int j0 = (tile0 + t) * kKeys;
    uint16_t* const dk = sK + (t % kStages) * kKeys * D;
    uint16_t* const dv = sV + (t % kStages) * kKeys * D;
    for (int x = tid; x < kKeys * kC; x += nthr) {
      const int jr = x / kC, c = x % kC, j = j0 + jr;
      const bool ok = j >= kmin && j < kmax;
      const int64_t jj = ok ? j : kmin;  // a valid row either way (not read when !ok)
      cp_async16(dk + swz<D>(jr, c), kbase + jj * P.k_row_stride + c * 16, ok);
      cp_async16(dv + swz<D>(jr, c), vbase + jj * P.v_row_stride + c * 16, ok);
    }
    cp_async_commit();
  };

  float o[D / 8][4];
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
    for (int c = 0; c < 4; ++c) o[nt][c] = 0.0f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;  // rows gq, gq + 8 (l: this lane's columns)
  const uint16_t* const q_w = sQ + warp * 16 * D;
  // ldmatrix row / chunk offsets of this lane (see ldsm_x4): Q (A: matrices rows 0-7 / 8-15 x chunk
  // 2kc / 2kc+1), K (B of key n-tiles 2np, 2np+1: matrices keys 0-7 / 8-15 of the pair x chunk 2kc /
  // 2kc+1), V (B of dim n-tiles 2np, 2np+1, transposed: matrices keys 0-7 / 8-15 x chunk 2np / 2np+1).
  const int a_row = (lane & 7) + 8 * ((lane >> 3) & 1), a_c = lane >> 4;
  const int k_row = (lane & 7) + 8 * (lane >> 4), k_c = (lane >> 3) & 1;
  const int v_row = (lane & 7) + 8 * ((lane >> 3) & 1), v_c = lane >> 4;

  if (ntiles > 0) load_tile(0);
  for (int t = 0; t < ntiles; ++t) {
    if (t + 1 < ntiles) {
      load_tile(t + 1);
      cp_async_wait<1>();  // tile t landed (this thread's copies)
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // every thread's copies of tile t visible
    const int j0 = (tile0 + t) * kKeys;
    if (active && j0 < whi && j0 + kKeys > wlo) {  // warp-uniform: the tile meets a row of the warp
      const uint16_t* const ks = sK + (t % kStages) * kKeys * D;
      const uint16_t* const vs = sV + (t % kStages) * kKeys * D;
      float s[kKeys / 8][4];
#pragma unroll
      for (int nt = 0; nt < kKeys / 8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) s[nt][c] = 0.0f;
#pragma unroll
      for (int kc = 0; kc < D / 16; ++kc) {
        uint32_t a[4];
        ldsm_x4<false>(a, q_w + swz<D>(a_row, 2 * kc + a_c));
#pragma unroll
        for (int np = 0; np < kKeys / 16; ++np) {
          uint32_t bk[4];
          ldsm_x4<false>(bk, ks + swz<D>(16 * np + k_row, 2 * kc + k_c));
          mma(s[2 * np], a, bk[0], bk[1]);
          mma(s[2 * np + 1], a, bk[2], bk[3]);
        }
      }
      // Online softmax (log2 domain). Element (nt, c): row gq (c < 2) or gq + 8, key j0 + 8 nt + 2 tq + c % 2.
      const bool full = wlomax <= j0 && j0 + kKeys <= whimin;  // every key visible to every row of the warp
      float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < kKeys / 8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int j = j0 + 8 * nt + 2 * tq + (c & 1);
          const bool vis = full || (c < 2 ? (j >= lo0 && j < hi0) : (j >= lo1 && j < hi1));
          const float x = vis ? __fmul_rn(s[nt][c], P.scale_log2) : -INFINITY;
          s[nt][c] = x;
          if (c < 2) mx0 = fmaxf(mx0, x);
          else mx1 = fmaxf(mx1, x);
        }
      mx0 = quad_max(mx0);
      mx1 = quad_max(mx1);
      const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
      const float mu0 = mn0 == -INFINITY ? 0.0f : mn0, mu1 = mn1 == -INFINITY ? 0.0f : mn1;
      const float al0 = ex2(__fsub_rn(m0, mu0)), al1 = ex2(__fsub_rn(m1, mu1));
      m0 = mn0;
      m1 = mn1;
      float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
      for (int nt = 0; nt < kKeys / 8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float p = ex2(__fsub_rn(s[nt][c], c < 2 ? mu0 : mu1));
          s[nt][c] = p;
          if (c < 2) ps0 = __fadd_rn(ps0, p);
          else ps1 = __fadd_rn(ps1, p);
        }
      l0 = __fmaf_rn(l0, al0, ps0);
      l1 = __fmaf_rn(l1, al1, ps1);
#pragma unroll
      for (int nt = 0; nt < D / 8; ++nt) {
        o[nt][0] = __fmul_rn(o[nt][0], al0);
        o[nt][1] = __fmul_rn(o[nt][1], al0);
        o[nt][2] = __fmul_rn(o[nt][2], al1);
        o[nt][3] = __fmul_rn(o[nt][3], al1);
      }
      // O += P V: the S accumulators of key n-tiles 2kk, 2kk+1 are the A fragment of k-step kk.
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk) {
        const uint32_t a[4] = {pack_f16x2(s[2 * kk][0], s[2 * kk][1]), pack_f16x2(s[2 * kk][2], s[2 * kk][3]),
                               pack_f16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                               pack_f16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
        for (int np = 0; np < D / 16; ++np) {
          uint32_t bv[4];
          ldsm_x4<true>(bv, vs + swz<D>(16 * kk + v_row, 2 * np + v_c));
          mma(o[2 * np], a, bv[0], bv[1]);
          mma(o[2 * np + 1], a, bv[2], bv[3]);
        }
      }
    }
    __syncthreads();  // stage t % kStages is refilled by the next iteration's load
  }

  // out = O / l (zeros for a row without a visible key: l == 0, O == 0).
  l0 = quad_sum(l0);
  l1 = quad_sum(l1);
  const float inv0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, inv1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
  if (active) {
    const int64_t i0 = row0 + gq, i1 = row0 + gq + 8;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
      const int e = 8 * nt + 2 * tq;
      if (i0 < P.n)
        *reinterpret_cast<float2*>(P.out + (i0 * P.hq + h) * D + e) =
            make_float2(__fmul_rn(o[nt][0], inv0), __fmul_rn(o[nt][1], inv0));
      if (i1 < P.n)
        *reinterpret_cast<float2*>(P.out + (i1 * P.hq + h) * D + e) =
            make_float2(__fmul_rn(o[nt][2], inv1), __fmul_rn(o[nt][3], inv1));
    }
  }
}

}  // namespace specd::gpu::detail::flash

#endif  // SPECD_FLASH_ATTN
