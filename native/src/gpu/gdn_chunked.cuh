// Gated DeltaNet on the GPU, the chunked (prefill) recurrence: kernels and their shared fields, included by
// ssm.cu (the token-by-token kernels and the launches) and compiled for the host by the emulation harness
// tests/gpu/host_emu/gdn_main.cpp.
#pragma once

#ifndef SPECD_HOST_EMU
#include "common.cuh"
#endif

#include <cstdint>

#include "dyn_smem.cuh"
#include "pdl.cuh"

namespace specd::gpu::detail::gdn {

// One gated_delta_net call: q, k [T, hk, dk], v [T, hv, dv], g, beta [T, hv] (contiguous, F32), the state
// [hv, dv, dk] read from state and written to state_out (may be state), checkpoints [T, hv, dv, dk] or null.
struct Params {
  const float *q, *k, *v, *g, *beta;
  const float* state;
  float* state_out;  // == state when in place
  float* ckpt;
  float scale;
  int64_t T;
  int hk, hv, dk, dv;
  float* out;
};

// The inexact prefill path of gated_delta_net (ssm.cu) (exact = false, T >= kGdnChunk tokens, no checkpoints): the chunkwise form
// of the gated delta rule (Yang, Kautz, Hatamizadeh, "Gated Delta Networks", ICLR 2025, §3; the WY
// representation of DeltaNet's chunked training, Yang et al. 2024), so a chunk's 64 tokens are a few
// small matrix products instead of 64 dependent steps. Per value head and chunk of n <= 64 tokens
// (rows i, j; S0 the state before the chunk, [dv, dk]; q already scaled):
//   G_i = g_1 + ... + g_i (log decay since the chunk start), Gamma_i = exp(G_i);
//   A_ij = beta_i exp(G_i - G_j) (k_i . k_j) for j < i, else 0; (I + A) is unit lower triangular;
//   U = (I + A)^-1 diag(beta) V, W = (I + A)^-1 diag(beta Gamma) K   (forward substitution);
//   D = U - W S0^T (the rows d_i of the token-by-token update, S <- S + d_i k_i^T);
//   O = diag(Gamma) Q S0^T + P D, P_ij = exp(G_i - G_j) (q_i . k_j) for j <= i, else 0;
//   S = Gamma_n S0 + D^T diag(exp(G_n - G_i)) K.
// This is the token recursion rearranged (exact in real arithmetic; checked against it in float64 by
// tests/gpu/test_gpu_gdn_chunked_host.py's reference), in F32 with other rounding: tolerance vs the CPU
// op 1e-4 * max|ref| + 1e-4 relative, as the token kernel's. A gate below kMinGate is taken as kMinGate: its
// decay exp(g) is 0 in F32 either way (the state restarts), and the prefix sums stay finite and accurate
// (a gate of -inf would make exp(G_i - G_j) NaN; one of -1e5 would swamp the others' digits). Two kernels:
//   gdn_chunk_prep_kernel, one block per (value head, chunk), all chunks at once (they do not depend on
//   the state): G, P, U and W into scratch;
//   gdn_chunk_state_kernel, one block per (value head, kGdnChunkRows state rows), the chunks in order:
//   state row r only meets column r of D and of O, so row blocks are independent. Its three products run on
//   tensor cores (3xTF32, F32-level accuracy) on CUDA, as FP32 fmaf chains on HIP (the #if SPECD_HIP below).

constexpr int kGdnChunk = 64;        // tokens per chunk (part of the path's arithmetic)
constexpr int kGdnChunkThreads = 256;
constexpr int kGdnChunkRows = 16;    // state rows per block of the state pass
constexpr float kMinGate = -104.0f;  // expf(-104) rounds to 0 in F32

struct GdnChunkScratch {
  float* U;  // [hv, T, dv]
  float* W;  // [hv, T, dk]
  float* P;  // [hv, chunks, 64, 64]
  float* G;  // [hv, T]
  int chunks;
};

// Dynamic shared memory of the two kernels for head dims dk, dv (size_t: any dv the op accepts). The prep
// kernel's v rows reuse the q rows' space when they fit (dv <= dk + 1): 81.5 KiB for the 27B, two blocks per SM.
__host__ __device__ constexpr bool gdn_v_in_q(int64_t dk, int64_t dv) { return dv <= dk + 1; }
constexpr size_t gdn_prep_smem(int64_t dk, int64_t dv) {
  return (size_t(2 * kGdnChunk) * size_t(dk + 1) + size_t(kGdnChunk * (kGdnChunk + 1) + 3 * kGdnChunk) +
          (gdn_v_in_q(dk, dv) ? 0 : size_t(kGdnChunk) * size_t(dv))) * 4;
}
// The state kernel's slab buffer (floats): a chunk's rows x half of dk (W, Q: rows of dk / 2 + 4 floats), which
// also holds half its rows x dk (K: rows of dk + 4 on HIP, dk + 8 on CUDA; 32 (dk + 8) = 64 (dk / 2 + 4)).
__host__ __device__ constexpr int gdn_state_slab(int dk) { return kGdnChunk * (dk / 2 + 4); }
#if SPECD_HIP
// Two slabs, P, the state rows, D^T, G and exp(G_n - G): 64 KiB at dk 128, three blocks per SM.
constexpr size_t gdn_state_smem(int dk) {
  return size_t(2 * gdn_state_slab(dk) + kGdnChunk * (kGdnChunk + 4) + kGdnChunkRows * (dk + 4) +
                kGdnChunkRows * (kGdnChunk + 4) + 2 * kGdnChunk) * 4;
}
#else
// Two slabs, P, the state rows, D^T as (hi, lo) pairs, G and exp(G_n - G): 68.25 KiB at dk 128, three blocks per SM.
constexpr size_t gdn_state_smem(int dk) {
  return size_t(2 * gdn_state_slab(dk) + kGdnChunk * (kGdnChunk + 4) + kGdnChunkRows * (dk + 4) +
                kGdnChunkRows * (2 * kGdnChunk + 8) + 2 * kGdnChunk) * 4;
}
#endif

// Stages N 16-byte pieces per thread (piece x = threadIdx.x + it * kGdnChunkThreads, it < N): every load(x)
// is issued before the first store(x, value), so a stage costs one memory round trip, not N (the compiler
// cannot move a global load above a store to shared memory through generic pointers).
template <int N, class Load, class Store>
__device__ __forceinline__ void staged(const Load& load, const Store& store) {
  float4 v[N];
#pragma unroll
  for (int it = 0; it < N; ++it) v[it] = load(int(threadIdx.x) + it * kGdnChunkThreads);
#pragma unroll
  for (int it = 0; it < N; ++it) store(int(threadIdx.x) + it * kGdnChunkThreads, v[it]);
}
// 16-byte loads and stores (the emulation aborts on a misaligned one, as the GPU would fault).
__device__ __forceinline__ void check16(const void* p) {
#if defined(SPECD_HOST_EMU)
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) __trap();
#else
  (void)p;
#endif
}
__device__ __forceinline__ float4 ld4(const float* p) { return check16(p), *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void st4(float* p, float4 v) { check16(p), *reinterpret_cast<float4*>(p) = v; }
__device__ __forceinline__ float4 scaled(float4 v, float s) {
  return make_float4(__fmul_rn(v.x, s), __fmul_rn(v.y, s), __fmul_rn(v.z, s), __fmul_rn(v.w, s));
}
constexpr float4 kZero4 = {0.0f, 0.0f, 0.0f, 0.0f};
// x, hidden from the optimizer: an address computed from it is recomputed in each iteration of the state
// kernel's chunk loop (a few integer ops on parameters) instead of being hoisted out of the loop into registers
// held throughout it, which its 80-register budget does not hold (ptxas spilled them; the tensor-core kernel
// still spills 52 bytes at dk 128, 4 at dk 64). NVIDIA only: on AMD
// the "r" constraint names a scalar (wave-uniform) register, and x differs per thread.
__device__ __forceinline__ int opaque(int x) {
#if !defined(SPECD_HOST_EMU) && !SPECD_HIP
  asm volatile("" : "+r"(x));
#endif
  return x;
}

template <int DK>
__global__ void __launch_bounds__(kGdnChunkThreads) gdn_chunk_prep_kernel(const Params P, const GdnChunkScratch X) {
  pdl_enter();
  constexpr int C = kGdnChunk, KS = DK + 1;
  float* const sm = dyn_smem();
  float* Ks = sm;                // [C][KS] k rows (zeros past n)
  float* Qs = Ks + C * KS;       // [C][KS] scale * q rows
  float* As = Qs + C * KS;       // [C][C + 1] A
  float* Gs = As + C * (C + 1);  // [C] G
  float* Bs = Gs + C;            // [C] beta
  float* BGs = Bs + C;           // [C] beta Gamma (W's right-hand sides, once per row)
  float* Vs = gdn_v_in_q(DK, P.dv) ? Qs : BGs + C;  // [C][dv] v rows (staged once q . k is done)
  const int c = int(blockIdx.x % X.chunks), j = int(blockIdx.x / X.chunks), kh = j % P.hk, tid = threadIdx.x;
  const int64_t t0 = int64_t(c) * C;
  const int n = P.T - t0 < C ? int(P.T - t0) : C;
  constexpr int NK = C * DK / 4 / kGdnChunkThreads, Q4 = DK / 4;  // k / q pieces per thread, per row
  auto src = [&](int x) { return ((t0 + x / Q4) * P.hk + kh) * DK + 4 * (x % Q4); };
  auto put = [&](float* dst, int x, float4 f) {
    float* d = dst + (x / Q4) * KS + 4 * (x % Q4);  // KS is odd: no 16-byte stores
    d[0] = f.x, d[1] = f.y, d[2] = f.z, d[3] = f.w;
  };
  staged<NK>([&](int x) { return x / Q4 < n ? ld4(P.k + src(x)) : kZero4; }, [&](int x, float4 f) { put(Ks, x, f); });
  staged<NK>([&](int x) { return x / Q4 < n ? scaled(ld4(P.q + src(x)), P.scale) : kZero4; },
             [&](int x, float4 f) { put(Qs, x, f); });
  if (tid < C) {
    const float g = tid < n ? P.g[(t0 + tid) * P.hv + j] : 0.0f;
    Gs[tid] = g < kMinGate ? kMinGate : g;  // (a NaN gate stays NaN, as in the token kernel)
    Bs[tid] = tid < n ? P.beta[(t0 + tid) * P.hv + j] : 0.0f;
  }
  __syncthreads();
  if (tid == 0)  // the prefix sum, in token order
    for (int i = 1; i < n; ++i) Gs[i] = __fadd_rn(Gs[i - 1], Gs[i]);
  // k_i . k_j and q_i . k_j for a 4 x 4 tile (i = 4 ti + a, j = 4 tj + b) per thread
  const int ti = tid / 16, tj = tid % 16;
  float kk[4][4] = {}, qk[4][4] = {};
#pragma unroll 2
  for (int e = 0; e < DK; ++e) {
    float ki[4], qi[4], kj[4];
#pragma unroll
    for (int a = 0; a < 4; ++a) ki[a] = Ks[(4 * ti + a) * KS + e], qi[a] = Qs[(4 * ti + a) * KS + e], kj[a] = Ks[(4 * tj + a) * KS + e];
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int b = 0; b < 4; ++b) kk[a][b] = fmaf(ki[a], kj[b], kk[a][b]), qk[a][b] = fmaf(qi[a], kj[b], qk[a][b]);
  }
  __syncthreads();  // Gs complete, Qs read
  float* Pg = X.P + (int64_t(j) * X.chunks + c) * C * C;
#pragma unroll
  for (int a = 0; a < 4; ++a)
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const int i = 4 * ti + a, jj = 4 * tj + b;
      const float r = jj <= i && i < n ? expf(Gs[i] - Gs[jj]) : 0.0f;  // only j <= i: G_i - G_j <= 0 for g <= 0
      As[i * (C + 1) + jj] = jj < i ? Bs[i] * r * kk[a][b] : 0.0f;
      Pg[i * C + jj] = r * qk[a][b];
    }
  if (tid < n) X.G[int64_t(j) * P.T + t0 + tid] = Gs[tid];
  if (tid < C) BGs[tid] = Bs[tid] * expf(Gs[tid]);
  const int V4 = P.dv / 4;  // dv % 16 == 0; a run-time size: 4 pieces per thread at a time
  for (int x0 = 0; x0 < C * V4; x0 += 4 * kGdnChunkThreads)
    staged<4>([&](int x) { x += x0; return x < C * V4 && x / V4 < n ? ld4(P.v + ((t0 + x / V4) * P.hv + j) * P.dv + 4 * (x % V4)) : kZero4; },
              [&](int x, float4 f) { if (x + x0 < C * V4) st4(Vs + 4 * (x + x0), f); });
  __syncthreads();
  // Forward substitution, one column per thread: x_i = rhs_i - sum_{j<i} A_ij x_j (rows past n: zeros). The
  // sum runs as two interleaved chains (even and odd j), so a row waits on i / 2 dependent FMAs.
  for (int col = tid; col < P.dv + DK; col += kGdnChunkThreads) {
    const bool isu = col < P.dv;
    const int e = isu ? col : col - P.dv;
    float x[C];
#pragma unroll
    for (int i = 0; i < C; ++i) {
      float s0 = isu ? Bs[i] * Vs[i * P.dv + e] : BGs[i] * Ks[i * KS + e], s1 = 0.0f;
#pragma unroll
      for (int jj = 0; jj + 1 < i; jj += 2) {
        s0 = fmaf(-As[i * (C + 1) + jj], x[jj], s0);
        s1 = fmaf(-As[i * (C + 1) + jj + 1], x[jj + 1], s1);
      }
      if (i % 2 == 1) s0 = fmaf(-As[i * (C + 1) + i - 1], x[i - 1], s0);
      x[i] = s0 + s1;
    }
    float* dst = isu ? X.U + (int64_t(j) * P.T + t0) * P.dv + e : X.W + (int64_t(j) * P.T + t0) * DK + e;
    const int stride = isu ? P.dv : DK;
#pragma unroll
    for (int i = 0; i < C; ++i)
      if (i < n) dst[int64_t(i) * stride] = x[i];
  }
}

// The state pass streams each chunk's operands through two slab buffers, every matrix in two halves: W and
// scale * Q by halves of dk (the sums over e run over the first half, then the second), exp(G_n - G_i) K by
// halves of the chunk's rows (the sum over i likewise). A step computes with one slab while the next one is in
// flight from global memory into registers, stored to the other buffer after the step's arithmetic (one
// barrier a step): the loads' round trips overlap arithmetic instead of stalling all the block's warps at a
// barrier. Six steps a chunk, slab k of a chunk in buffer k % 2 (in flight during the step in parentheses):
//   1. D = U - W S0^T over W's first half (W's second half, U)   2. its second half; D^T stored (Q's first half)
//   3. Q S0^T, first half (Q's second half)   4. second half, then O = Gamma . + P D (K's first rows)
//   5. S over rows i < 32 (K's other rows, half of the next chunk's P)
//   6. S over i >= 32 (the next chunk's W first half, G, the other half of P)
// Two kernels do it: on CUDA the products on tensor cores (3xTF32), on HIP in FP32 FMAs.
//
// The state pass's staging of a chunk's operands, shared by both state kernels: thread tid's 16-byte pieces of
// the W / Q slabs (a chunk's rows x half of dk, rows ES floats apart), the K slabs (half a chunk's rows x dk,
// rows KSTR apart), P's halves and G. Thread tid takes row tid / E4 (K: / K4) + it * ER (KR) of a slab, so
// every piece's address is one per-thread base plus a constant (or a multiple of a parameter): few registers
// held across the chunk loop. load_* fill registers (rows past n: zeros), put_* store them to shared memory.
template <int DK, int KSTR>
struct StateStaging {
  static constexpr int C = kGdnChunk, H = C / 2, SE = DK / 2, ES = SE + 4, PS = C + 4, E4 = SE / 4, K4 = DK / 4;
  static constexpr int NP = C * SE / 4 / kGdnChunkThreads, ER = kGdnChunkThreads / E4, KR = kGdnChunkThreads / K4;
  static constexpr int NPP = C * C / 8 / kGdnChunkThreads, PR = kGdnChunkThreads / (C / 4);
  static_assert(NP * 4 * kGdnChunkThreads == C * SE && H * DK == C * SE, "whole slabs");
  using Slab = float4[NP];
  using PHalf = float4[NPP];
  const Params& P;
  const GdnChunkScratch& X;
  float* Ps;        // [C][PS] P
  const float* Es;  // [C] exp(G_n - G_i), K~'s row scales
  int j, kh, tid, er, ec, kr, kc, qk_stride;
  __device__ __forceinline__ StateStaging(const Params& P_, const GdnChunkScratch& X_, int j_, int kh_, float* Ps_,
                                          const float* Es_)
      : P(P_), X(X_), Ps(Ps_), Es(Es_), j(j_), kh(kh_), tid(int(threadIdx.x)), er(tid / E4), ec(4 * (tid % E4)),
        kr(tid / K4), kc(4 * (tid % K4)), qk_stride(P_.hk * DK) {}
  // Slab `half` of the dk halves of rows 0..n-1 at base + i * stride (W, Q), and its store (q scaled).
  __device__ __forceinline__ void load_e(Slab& v, const float* base, int stride, int half, int n) const {
    const float* src = base + opaque(er) * stride + ec + half * SE;
#pragma unroll
    for (int it = 0; it < NP; ++it) v[it] = er + it * ER < n ? ld4(src + it * ER * stride) : kZero4;
  }
  __device__ __forceinline__ void put_e(float* buf, const Slab& v, int n, bool q) const {
#pragma unroll
    for (int it = 0; it < NP; ++it)
      st4(buf + (er + it * ER) * ES + ec, q && er + it * ER < n ? scaled(v[it], P.scale) : v[it]);
  }
  // Rows half * H .. half * H + H - 1 of K, and their store scaled by exp(G_n - G_i) (Es, step 3).
  __device__ __forceinline__ void load_k(Slab& v, const float* base, int half, int n) const {
    const float* src = base + (half * H + opaque(kr)) * qk_stride + kc;
#pragma unroll
    for (int it = 0; it < NP; ++it) v[it] = half * H + kr + it * KR < n ? ld4(src + it * KR * qk_stride) : kZero4;
  }
  __device__ __forceinline__ void put_k(float* buf, const Slab& v, int half) const {
#pragma unroll
    for (int it = 0; it < NP; ++it) st4(buf + (kr + it * KR) * KSTR + kc, scaled(v[it], Es[half * H + kr + it * KR]));
  }
  // P in two halves of rows (steps 5 and 6 load one each: fewer registers in flight at a time).
  __device__ __forceinline__ void load_p(PHalf& v, int c, int half) const {
    const float* Pg = X.P + (int64_t(j) * X.chunks + c) * C * C + half * (C * C / 2) + 4 * tid;
#pragma unroll
    for (int it = 0; it < NPP; ++it) v[it] = ld4(Pg + it * 4 * kGdnChunkThreads);
  }
  __device__ __forceinline__ void put_p(const PHalf& v, int half) const {
#pragma unroll
    for (int it = 0; it < NPP; ++it)
      st4(Ps + (half * H + tid / (C / 4) + it * PR) * PS + 4 * (tid % (C / 4)), v[it]);
  }
  __device__ __forceinline__ float load_g(int64_t t0, int n) const { return tid < n ? X.G[int64_t(j) * P.T + t0 + tid] : 0.0f; }
  __device__ __forceinline__ const float* W_at(int64_t t0) const { return X.W + (int64_t(j) * P.T + t0) * DK; }
  __device__ __forceinline__ const float* Q_at(int64_t t0) const { return P.q + (t0 * P.hk + kh) * DK; }
  __device__ __forceinline__ const float* K_at(int64_t t0) const { return P.k + (t0 * P.hk + kh) * DK; }
  __device__ __forceinline__ int rows_in(int64_t t0) const { return P.T - t0 < C ? int(P.T - t0) : C; }
  // Before the chunk loop: chunk 0's W first half into buf, its G into Gs, its P (the caller then syncs).
  __device__ __forceinline__ void first_chunk(Slab& v, float* buf, float* Gs) const {
    const int n = rows_in(0);
    PHalf p0, p1;
    load_e(v, W_at(0), DK, 0, n);
    load_p(p0, 0, 0);
    load_p(p1, 0, 1);
    const float g0 = load_g(0, n);
    put_e(buf, v, n, false);
    put_p(p0, 0);
    put_p(p1, 1);
    if (tid < C) Gs[tid] = g0;
  }
};

#if SPECD_HIP
// The state pass's 2 x 2 register tile: acc[a][b] += x[b] . y[a] over one float4, its four products
// in order (each element its own fmaf chain).
__device__ __forceinline__ void tile_fma(float (&acc)[2][2], const float4 (&x)[2], const float4 (&y)[2]) {
#pragma unroll
  for (int a = 0; a < 2; ++a)
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      acc[a][b] = fmaf(x[b].x, y[a].x, acc[a][b]), acc[a][b] = fmaf(x[b].y, y[a].y, acc[a][b]);
      acc[a][b] = fmaf(x[b].z, y[a].z, acc[a][b]), acc[a][b] = fmaf(x[b].w, y[a].w, acc[a][b]);
    }
}

// The HIP state kernel, in FP32 FMAs. Register tiles: D and O, 2 state rows x 2 chunk rows a thread (a warp 8 x 4: each shared-memory load one
// wavefront, 4 loads per 16 FMAs); S, dk / 64 (at least 1) state rows x 4 elements (a warp 8 or 16 rows x 4
// or 2 groups of 4: 6 wavefronts per 32 FMAs at dk 128). Every D, O and S element is one fmaf chain over e,
// j or i in ascending order (the slabs split the chains, never reorder them), so the tiling and the staging
// change no rounding.
template <int DK>
__global__ void __launch_bounds__(kGdnChunkThreads, 3) gdn_chunk_state_kernel(const Params P, const GdnChunkScratch X) {
  pdl_enter();
  // Rows of ES / BS / PS floats: odd multiples of 16 bytes, so 16-byte pieces of 8 consecutive rows (at one
  // column) are one conflict-free wavefront.
  constexpr int C = kGdnChunk, H = C / 2, R = kGdnChunkRows, SE = DK / 2, ES = SE + 4, BS = DK + 4, PS = C + 4;
  constexpr int SB = gdn_state_slab(DK);
  static_assert(C * ES <= SB && H * BS <= SB, "a slab holds W / Q's half and K's half");
  float* const sm = dyn_smem();
  float* const Bf0 = sm;          // slabs 0, 2, 4 of a chunk: W's first half, Q's first half, K's first rows
  float* const Bf1 = sm + SB;     // slabs 1, 3, 5
  float* const Ps = Bf1 + SB;     // [C][PS] P
  float* const Ss = Ps + C * PS;  // [R][BS] the block's state rows
  float* const Dt = Ss + R * BS;  // [R][PS] D^T: row r = D's column of the block's state row r
  float* const Gs = Dt + R * PS;  // [C] G
  float* const Es = Gs + C;       // [C] exp(G_n - G_i), K~'s row scales
  const int nb = P.dv / R, j = blockIdx.x / nb, r0 = (blockIdx.x % nb) * R, kh = j % P.hk, tid = threadIdx.x;
  static_assert(kGdnChunkThreads == 256 && R == 16 && C == 64, "the tiles below cover 16 x 64 with 256 threads");
  constexpr int E4 = SE / 4, K4 = DK / 4;
  for (int x = tid; x < R * K4; x += kGdnChunkThreads)
    st4(Ss + (x / K4) * BS + 4 * (x % K4), ld4(P.state + (int64_t(j) * P.dv + r0 + x / K4) * DK + 4 * (x % K4)));
  // D and O: thread (state rows r, r + 8; chunk rows ib, ib + 32). S: state rows rg + RG a (a < SA), elements
  // 4 eg .. 4 eg + 3 (dk 32: threads 128 on only).
  const int r = tid % 8, ib = tid / 8;
  constexpr int SA = DK >= 64 ? DK / 64 : 1, RG = R / SA;
  const int rg = tid % RG, eg = tid / RG;
  const bool s_on = tid < RG * K4;
  const StateStaging<DK, BS> st(P, X, j, kh, Ps, Es);
  using Slab = typename StateStaging<DK, BS>::Slab;
  using PHalf = typename StateStaging<DK, BS>::PHalf;
  const int qk_stride = st.qk_stride;
  // acc[a][b] += (slab rows ib + 32 b) . (state rows r + 8 a) over the slab's half of e, in order of e.
  constexpr int kDotsUnroll = DK == 128 ? 4 : 2;  // (4 at dk 64 spills; a name: clang warns of a parenthesised count)
  auto dots = [&](const float* buf, int half, float (&acc)[2][2]) {
#pragma unroll kDotsUnroll
    for (int e4 = 0; e4 < E4; ++e4) {
      float4 x[2], y[2];
#pragma unroll
      for (int a = 0; a < 2; ++a) y[a] = ld4(Ss + (r + 8 * a) * BS + half * SE + 4 * e4);
#pragma unroll
      for (int b = 0; b < 2; ++b) x[b] = ld4(buf + (ib + 32 * b) * ES + 4 * e4);
      tile_fma(acc, x, y);
    }
  };
  // sacc[a][v] += D_{i, rg + RG a} K~_{i, 4 eg + v} over the slab's rows i (rows past n: D and K~ zero), in order.
  float sacc[SA][4];
  auto s_rows = [&](const float* buf, int half) {
    if (!s_on) return;
#pragma unroll 2
    for (int i4 = 0; i4 < H / 4; ++i4) {
      float d[SA][4];
#pragma unroll
      for (int a = 0; a < SA; ++a) {
        const float4 d4 = ld4(Dt + (rg + RG * a) * PS + half * H + 4 * i4);
        d[a][0] = d4.x, d[a][1] = d4.y, d[a][2] = d4.z, d[a][3] = d4.w;
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const float4 k = ld4(buf + (4 * i4 + u) * BS + 4 * eg);
#pragma unroll
        for (int a = 0; a < SA; ++a) {
          sacc[a][0] = fmaf(d[a][u], k.x, sacc[a][0]), sacc[a][1] = fmaf(d[a][u], k.y, sacc[a][1]);
          sacc[a][2] = fmaf(d[a][u], k.z, sacc[a][2]), sacc[a][3] = fmaf(d[a][u], k.w, sacc[a][3]);
        }
      }
    }
  };
  Slab v;
  st.first_chunk(v, Bf0, Gs);
  __syncthreads();
  for (int c = 0; c < X.chunks; ++c) {
    const int64_t t0 = int64_t(opaque(c)) * C;
    const int n = st.rows_in(t0);
    const bool more = c + 1 < X.chunks;
    float acc[2][2], u[2][2];
    // 1. D = U - W S0^T over W's first half
    const float* Ug = X.U + (int64_t(j) * P.T + t0 + ib) * P.dv + r0 + r;
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        u[a][b] = ib + 32 * b < n ? Ug[32 * b * P.dv + 8 * a] : 0.0f;
        acc[a][b] = 0.0f;
      }
    st.load_e(v, st.W_at(t0), DK, 1, n);
    dots(Bf0, 0, acc);
    st.put_e(Bf1, v, n, false);
    __syncthreads();
    // 2. its second half
    st.load_e(v, st.Q_at(t0), qk_stride, 0, n);
    dots(Bf1, 1, acc);
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const int i = ib + 32 * b;
        Dt[(r + 8 * a) * PS + i] = i < n ? __fsub_rn(u[a][b], acc[a][b]) : 0.0f;
        acc[a][b] = 0.0f;
      }
    st.put_e(Bf0, v, n, true);
    __syncthreads();  // D complete
    // 3. O = diag(Gamma) Q S0^T + P D (P is zero past the diagonal, D past n): Q's first half
    st.load_e(v, st.Q_at(t0), qk_stride, 1, n);
    dots(Bf0, 0, acc);
    // K~'s row scales for steps 4 and 5, by the last two warps (where ptxas fits 80 registers without spills)
    if (const int i = tid - (kGdnChunkThreads - C); i >= 0) Es[i] = expf(Gs[n - 1] - Gs[i]);
    st.put_e(Bf1, v, n, true);
    __syncthreads();
    // 4. Q's second half, then Gamma and P D
    st.load_k(v, st.K_at(t0), 0, n);
    dots(Bf1, 1, acc);
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const float gamma = expf(Gs[ib + 32 * b]);
#pragma unroll
      for (int a = 0; a < 2; ++a) acc[a][b] *= gamma;
    }
#pragma unroll 4
    for (int j4 = 0; j4 < C / 4; ++j4) {  // j = 4 j4 .. 4 j4 + 3, in order
      float4 d[2], p[2];
#pragma unroll
      for (int a = 0; a < 2; ++a) d[a] = ld4(Dt + (r + 8 * a) * PS + 4 * j4);
#pragma unroll
      for (int b = 0; b < 2; ++b) p[b] = ld4(Ps + (ib + 32 * b) * PS + 4 * j4);
      tile_fma(acc, p, d);
    }
    float* const Og = P.out + ((t0 + ib) * P.hv + opaque(j)) * P.dv + r0 + r;
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int a = 0; a < 2; ++a)
        if (ib + 32 * b < n) Og[32 * b * P.hv * P.dv + 8 * a] = acc[a][b];
    const float gn = Gs[n - 1];
    st.put_k(Bf0, v, 0);
    __syncthreads();  // P consumed, K's first rows staged
    // 5. S = Gamma_n S0 + D^T K~ over rows i < 32 (thread-owned elements of Ss: read and written by it alone)
    {
      PHalf p;
      if (more) st.load_p(p, c + 1, 0);
      st.load_k(v, st.K_at(t0), 1, n);
      const float decay = expf(gn);
      if (s_on)
#pragma unroll
        for (int a = 0; a < SA; ++a)
#pragma unroll
          for (int e = 0; e < 4; ++e) sacc[a][e] = decay * Ss[(rg + RG * a) * BS + 4 * eg + e];
      s_rows(Bf0, 0);
      st.put_k(Bf1, v, 1);
      if (more) st.put_p(p, 0);
    }
    __syncthreads();  // Gs no longer read this chunk
    // 6. rows i >= 32; the state rows written
    const int64_t t1 = t0 + C;
    const int n1 = more ? st.rows_in(t1) : 0;
    float g = 0.0f;
    PHalf p;
    if (more) st.load_e(v, st.W_at(t1), DK, 0, n1), st.load_p(p, c + 1, 1), g = st.load_g(t1, n1);
    s_rows(Bf1, 1);
    if (s_on)
#pragma unroll
      for (int a = 0; a < SA; ++a)
        st4(Ss + (rg + RG * a) * BS + 4 * eg, make_float4(sacc[a][0], sacc[a][1], sacc[a][2], sacc[a][3]));
    if (more) {
      st.put_e(Bf0, v, n1, false);
      st.put_p(p, 1);
      if (tid < C) Gs[tid] = g;
    }
    __syncthreads();  // the state rows are complete before the next chunk's step 1 reads them
  }
  for (int x = tid; x < R * K4; x += kGdnChunkThreads)
    st4(P.state_out + (int64_t(j) * P.dv + r0 + x / K4) * DK + 4 * (x % K4), ld4(Ss + (x / K4) * BS + 4 * (x % K4)));
}

#else  // CUDA: the products on tensor cores

// The three products run on tensor cores, mma.sync m16n8k8 tf32 -> f32, near F32 accuracy by 3xTF32: an
// F32 operand x = hi + lo (split_tf32), a b ~ a_lo b_hi + a_hi b_lo + a_hi b_hi (the small terms first into
// the F32 accumulator; a_lo b_lo, below 2^-22 |a b|, dropped). Warp w of 8 (lane 4 g + t, as the fragments):
//   D and O, [64 chunk rows x 16 state rows]: the m16n8 tile of chunk rows 16 (w % 4) .. and state rows
//   8 (w / 4) .., over e (W, Q: A fragments from the slab, S0: B fragments from Ss) then j (P, D^T);
//   S, [16 state rows x dk]: n8 tiles w + 8 q of the elements (dk 32: warps 0..3), over i (D^T, K~).
// D^T is stored as (hi, lo) pairs by the threads that compute D (a D element feeds 12 warps' fragments: split
// once). Strides (floats): [row][k] operands (W, Q, P, S0) 4 mod 32, W / Q 20 at dk 32 (lanes' words 4 g + t or
// 20 g + t: conflict-free), the
// [k][n] operand K~ 8 mod 32 (8 t + g), D^T's pairs 8 mod 32 (LDS.64, a half warp's words 8 g + 2 t, + 1).
// Sums run in another order than the HIP path's fmaf chains (results differ in the last bits). Measured on
// the H200 (tools/device/gdn_chunk_bench.py --check, the 27B's shapes, 2048 tokens): max error 1.96e-6 /
// 1.47e-6 of the output's / state's largest value against the CPU backend, against 6.8e-7 / 4.9e-7 for the
// FP32 kernel (the host emulation, whose MMA adds exactly, matches the FP32 kernel's: the hardware's tf32
// MMA accumulates less precisely); 457 against 626 us per call.

// x = hi + lo exactly: hi = x rounded to tf32 (nearest, ties away from zero: cvt.rna.tf32.f32's value for
// finite x, in 2 integer ops where cvt takes 4), lo = x - hi (exact in F32; |lo| <= 2^-11 |x|), which the
// MMA reads truncated to tf32 (it ignores an operand's low 13 bits, as CUTLASS's round_half_ulp_truncate
// relies on): lo's error <= 2^-22 |x|. A NaN x gives a NaN lo (hi may be -0), so NaNs still propagate.
struct Tf32 {
  uint32_t hi, lo;
};
__device__ __forceinline__ Tf32 split_tf32(float x) {
  const uint32_t h = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
  return {h, __float_as_uint(__fsub_rn(x, __uint_as_float(h)))};
}
// d += a b, mma.sync m16n8k8 row.col tf32 x tf32 -> f32 (PTX ISA "Matrix fragments for mma.m16n8k8", .tf32,
// lane = 4 g + t): A a0 = (row g, k t), a1 = (g + 8, t), a2 = (g, t + 4), a3 = (g + 8, t + 4); B b0 = (k t,
// col g), b1 = (k t + 4, col g); C/D d0, d1 = (row g, cols 2t, 2t + 1), d2, d3 = (row g + 8, ...).
__device__ __forceinline__ void mma_tf32(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
#if defined(SPECD_HOST_EMU)
  const uint32_t a[4] = {a0, a1, a2, a3};
  specd_emu_mma_tf32(d, a, make_uint2(b0, b1));
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // no tf32 MMA below sm_80; the chunked path is taken on compute capability 8+ only (ssm.cu)
#else
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}
// d += a b in 3xTF32, the small terms first.
__device__ __forceinline__ void mma3(float (&d)[4], const Tf32 (&a)[4], const Tf32 (&b)[2]) {
  mma_tf32(d, a[0].lo, a[1].lo, a[2].lo, a[3].lo, b[0].hi, b[1].hi);
  mma_tf32(d, a[0].hi, a[1].hi, a[2].hi, a[3].hi, b[0].lo, b[1].lo);
  mma_tf32(d, a[0].hi, a[1].hi, a[2].hi, a[3].hi, b[0].hi, b[1].hi);
}
// Fragments, split: A (16 x 8) of a row-major [m][k] array with row stride ld, p = its (row g, k t); B (8 x 8)
// of a [n][k] array (B^T row-major), p = its (n g, k t); B of a [k][n] array, p = its (k t, n g).
__device__ __forceinline__ void frag_a(Tf32 (&a)[4], const float* p, int ld) {
  a[0] = split_tf32(p[0]), a[1] = split_tf32(p[8 * ld]), a[2] = split_tf32(p[4]), a[3] = split_tf32(p[8 * ld + 4]);
}
__device__ __forceinline__ void frag_b_nk(Tf32 (&b)[2], const float* p) { b[0] = split_tf32(p[0]), b[1] = split_tf32(p[4]); }
__device__ __forceinline__ void frag_b_kn(Tf32 (&b)[2], const float* p, int ld) {
  b[0] = split_tf32(p[0]), b[1] = split_tf32(p[4 * ld]);
}
// The same from arrays of (hi, lo) pairs (row stride ld pairs' floats), p = the pair of (row g, k t) / (n g, k t).
__device__ __forceinline__ Tf32 ld_pair(const float* p) {
  const float2 v = *reinterpret_cast<const float2*>(p);
  return {__float_as_uint(v.x), __float_as_uint(v.y)};
}
__device__ __forceinline__ void frag_a_pairs(Tf32 (&a)[4], const float* p, int ld) {
  a[0] = ld_pair(p), a[1] = ld_pair(p + 8 * ld), a[2] = ld_pair(p + 8), a[3] = ld_pair(p + 8 * ld + 8);
}
__device__ __forceinline__ void frag_b_pairs(Tf32 (&b)[2], const float* p) { b[0] = ld_pair(p), b[1] = ld_pair(p + 8); }

template <int DK>
__global__ void __launch_bounds__(kGdnChunkThreads, 3) gdn_chunk_state_kernel(const Params P, const GdnChunkScratch X) {
  pdl_enter();
  // Row strides (floats): W / Q slabs ES, K slabs KS, P PS, the state rows BS, D^T's pairs DS (header comment).
  constexpr int C = kGdnChunk, H = C / 2, R = kGdnChunkRows, SE = DK / 2, ES = SE + 4, KS = DK + 8, BS = DK + 4,
                PS = C + 4, DS = 2 * C + 8;
  static_assert(ES % 32 == 4 || ES % 32 == 20, "A fragments of W / Q: conflict-free");
  static_assert(KS % 32 == 8 && DS % 32 == 8 && BS % 32 == 4 && PS % 32 == 4, "conflict-free fragments");
  constexpr int SB = gdn_state_slab(DK);
  static_assert(C * ES <= SB && H * KS <= SB, "a slab holds W / Q's half and K's half");
  float* const sm = dyn_smem();
  float* const Bf0 = sm;          // slabs 0, 2, 4 of a chunk: W's first half, Q's first half, K's first rows
  float* const Bf1 = sm + SB;     // slabs 1, 3, 5
  float* const Ps = Bf1 + SB;     // [C][PS] P
  float* const Ss = Ps + C * PS;  // [R][BS] the block's state rows
  float* const Dt = Ss + R * BS;  // [R][DS] D^T as (hi, lo) pairs: row r = D's column of the block's state row r
  float* const Gs = Dt + R * DS;  // [C] G
  float* const Es = Gs + C;       // [C] exp(G_n - G_i), K~'s row scales
  const int nb = P.dv / R, j = blockIdx.x / nb, r0 = (blockIdx.x % nb) * R, kh = j % P.hk, tid = threadIdx.x;
  static_assert(kGdnChunkThreads == 256 && R == 16 && C == 64, "the tiles below cover 16 x 64 with 8 warps");
  constexpr int K4 = DK / 4;
  for (int x = tid; x < R * K4; x += kGdnChunkThreads)
    st4(Ss + (x / K4) * BS + 4 * (x % K4), ld4(P.state + (int64_t(j) * P.dv + r0 + x / K4) * DK + 4 * (x % K4)));
  // Warp w, lane 4 g + t. D and O: chunk rows mi + g (+ 8), state rows ni + 2 t (+ 1). S: n8 tiles w + 8 q
  // (q < SQ) of the elements, warps w < NT.
  const int w = tid / 32, g = (tid % 32) / 4, t = tid % 4, mi = 16 * (w % 4), ni = 8 * (w / 4);
  constexpr int NT = DK / 8, SQ = NT >= 8 ? NT / 8 : 1;
  const bool s_on = w < NT;
  const StateStaging<DK, KS> st(P, X, j, kh, Ps, Es);
  using Slab = typename StateStaging<DK, KS>::Slab;
  using PHalf = typename StateStaging<DK, KS>::PHalf;
  const int qk_stride = st.qk_stride;
  // acc += (slab rows mi..) (state rows ni..)^T over the slab's half of e.
  auto dots = [&](const float* buf, int half, float (&acc)[4]) {
    const float* a = buf + (mi + g) * ES + t;
    const float* b = Ss + (ni + g) * BS + half * SE + t;
#pragma unroll
    for (int k0 = 0; k0 < SE; k0 += 8) {
      Tf32 af[4], bf[2];
      frag_a(af, a + k0, ES);
      frag_b_nk(bf, b + k0);
      mma3(acc, af, bf);
    }
  };
  // sacc[q] += (D^T)[:, slab rows] K~[slab rows, tile w + 8 q] over the slab's rows (rows past n: zeros).
  float sacc[SQ][4];
  auto s_rows = [&](const float* buf, int half) {
    if (!s_on) return;
#pragma unroll
    for (int k0 = 0; k0 < H; k0 += 8) {
      Tf32 af[4];
      frag_a_pairs(af, Dt + g * DS + 2 * (half * H + k0 + t), DS);
#pragma unroll
      for (int q = 0; q < SQ; ++q) {
        Tf32 bf[2];
        frag_b_kn(bf, buf + (k0 + t) * KS + 8 * (w + 8 * q) + g, KS);
        mma3(sacc[q], af, bf);
      }
    }
  };
  Slab v;
  st.first_chunk(v, Bf0, Gs);
  __syncthreads();
  for (int c = 0; c < X.chunks; ++c) {
    const int64_t t0 = int64_t(opaque(c)) * C;
    const int n = st.rows_in(t0);
    const bool more = c + 1 < X.chunks;
    float acc[4];  // (chunk rows mi + g, + 8) x (state rows ni + 2 t, + 1)
    // 1. D = U - W S0^T over W's first half: acc = -U + W S0^T, D = -acc
    const float* Ug = X.U + (int64_t(j) * P.T + t0 + mi + g) * P.dv + r0 + ni + 2 * t;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float2 u = mi + g + 8 * h < n ? *reinterpret_cast<const float2*>(Ug + 8 * h * P.dv) : make_float2(0.0f, 0.0f);
      acc[2 * h] = -u.x, acc[2 * h + 1] = -u.y;
    }
    st.load_e(v, st.W_at(t0), DK, 1, n);
    dots(Bf0, 0, acc);
    st.put_e(Bf1, v, n, false);
    __syncthreads();
    // 2. its second half; D^T stored as pairs (rows past n: zeros)
    st.load_e(v, st.Q_at(t0), qk_stride, 0, n);
    dots(Bf1, 1, acc);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = mi + g + 8 * (e >> 1);
      const Tf32 d = split_tf32(i < n ? -acc[e] : 0.0f);
      *reinterpret_cast<float2*>(Dt + (ni + 2 * t + (e & 1)) * DS + 2 * i) =
          make_float2(__uint_as_float(d.hi), __uint_as_float(d.lo));
      acc[e] = 0.0f;
    }
    st.put_e(Bf0, v, n, true);
    __syncthreads();  // D complete
    // 3. O = diag(Gamma) Q S0^T + P D (P is zero past the diagonal, D past n): Q's first half
    st.load_e(v, st.Q_at(t0), qk_stride, 1, n);
    dots(Bf0, 0, acc);
    // K~'s row scales for steps 4 and 5, by the last two warps
    if (const int i = tid - (kGdnChunkThreads - C); i >= 0) Es[i] = expf(Gs[n - 1] - Gs[i]);
    st.put_e(Bf1, v, n, true);
    __syncthreads();
    // 4. Q's second half, then Gamma and P D
    st.load_k(v, st.K_at(t0), 0, n);
    dots(Bf1, 1, acc);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float gamma = expf(Gs[mi + g + 8 * h]);
      acc[2 * h] *= gamma, acc[2 * h + 1] *= gamma;
    }
#pragma unroll
    for (int k0 = 0; k0 < C; k0 += 8) {
      Tf32 af[4], bf[2];
      frag_a(af, Ps + (mi + g) * PS + k0 + t, PS);
      frag_b_pairs(bf, Dt + (ni + g) * DS + 2 * (k0 + t));
      mma3(acc, af, bf);
    }
    float* const Og = P.out + ((t0 + mi + g) * P.hv + opaque(j)) * P.dv + r0 + ni + 2 * t;
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (mi + g + 8 * h < n) Og[8 * h * P.hv * P.dv] = acc[2 * h], Og[8 * h * P.hv * P.dv + 1] = acc[2 * h + 1];
    const float gn = Gs[n - 1];
    st.put_k(Bf0, v, 0);
    __syncthreads();  // P and D^T's reads by P D done, K's first rows staged
    // 5. S = Gamma_n S0 + D^T K~ over rows i < 32 (thread-owned elements of Ss: read and written by it alone)
    {
      PHalf p;
      if (more) st.load_p(p, c + 1, 0);
      st.load_k(v, st.K_at(t0), 1, n);
      const float decay = expf(gn);
      if (s_on)
#pragma unroll
        for (int q = 0; q < SQ; ++q)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float2 s0 = *reinterpret_cast<const float2*>(Ss + (g + 8 * h) * BS + 8 * (w + 8 * q) + 2 * t);
            sacc[q][2 * h] = decay * s0.x, sacc[q][2 * h + 1] = decay * s0.y;
          }
      s_rows(Bf0, 0);
      st.put_k(Bf1, v, 1);
      if (more) st.put_p(p, 0);
    }
    __syncthreads();  // Gs no longer read this chunk; S0 no longer read (steps 1-4) by other warps
    // 6. rows i >= 32; the state rows written
    const int64_t t1 = t0 + C;
    const int n1 = more ? st.rows_in(t1) : 0;
    float g1 = 0.0f;
    PHalf p;
    if (more) st.load_e(v, st.W_at(t1), DK, 0, n1), st.load_p(p, c + 1, 1), g1 = st.load_g(t1, n1);
    s_rows(Bf1, 1);
    if (s_on)
#pragma unroll
      for (int q = 0; q < SQ; ++q)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          *reinterpret_cast<float2*>(Ss + (g + 8 * h) * BS + 8 * (w + 8 * q) + 2 * t) =
              make_float2(sacc[q][2 * h], sacc[q][2 * h + 1]);
    if (more) {
      st.put_e(Bf0, v, n1, false);
      st.put_p(p, 1);
      if (tid < C) Gs[tid] = g1;
    }
    __syncthreads();  // the state rows are complete before the next chunk's step 1 reads them
  }
  for (int x = tid; x < R * K4; x += kGdnChunkThreads)
    st4(P.state_out + (int64_t(j) * P.dv + r0 + x / K4) * DK + 4 * (x % K4), ld4(Ss + (x / K4) * BS + 4 * (x % K4)));
}

#endif

}  // namespace specd::gpu::detail::gdn
