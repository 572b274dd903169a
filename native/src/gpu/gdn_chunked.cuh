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
//   state row r only meets column r of D and of O, so row blocks are independent.

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
constexpr size_t gdn_state_smem(int dk) {
  return size_t(kGdnChunk * (dk + 4) + kGdnChunk * (kGdnChunk + 4) + kGdnChunkRows * (dk + 4) +
                kGdnChunkRows * (kGdnChunk + 4) + kGdnChunk) * 4;
}

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

template <int DK>
__global__ void __launch_bounds__(kGdnChunkThreads, 3) gdn_chunk_state_kernel(const Params P, const GdnChunkScratch X) {
  pdl_enter();
  // Rows of BS / PS floats: 16-byte aligned (every offset below is a multiple of 4 floats), so the products
  // read 4 operands per shared-memory load.
  constexpr int C = kGdnChunk, R = kGdnChunkRows, BS = DK + 4, PS = C + 4, M = C / 16;
  float* const sm = dyn_smem();
  float* Bf = sm;           // [C][BS] W, then scale * Q, then exp(G_n - G_i) K (one at a time)
  float* Ps = Bf + C * BS;  // [C][PS] P
  float* Ss = Ps + C * PS;  // [R][BS] the block's state rows
  float* Dt = Ss + R * BS;  // [R][PS] D^T: row r = D's column of the block's state row r
  float* Gs = Dt + R * PS;  // [C]
  const int nb = P.dv / R, j = blockIdx.x / nb, r0 = (blockIdx.x % nb) * R, kh = j % P.hk, tid = threadIdx.x;
  constexpr int Q4 = DK / 4, NB = C * Q4 / kGdnChunkThreads;  // 16-byte pieces per row, per thread
  auto to_bf = [&](int x, float4 f) { st4(Bf + (x / Q4) * BS + 4 * (x % Q4), f); };
  for (int x = tid; x < R * Q4; x += kGdnChunkThreads)
    st4(Ss + (x / Q4) * BS + 4 * (x % Q4), ld4(P.state + (int64_t(j) * P.dv + r0 + x / Q4) * DK + 4 * (x % Q4)));
  // Phases 1 and 2: thread (r = tid % R, rows i0 + 16 m, m < M); phase 3: (rs = tid / 16, elements of row rs:
  // 4 el .. 4 el + 3 of every 64 for dk >= 64, el and el + 16 for dk 32).
  static_assert(kGdnChunkThreads / R == 16 && kGdnChunkThreads / 16 == R, "16 x 16 threads");
  const int r = tid % R, i0 = tid / R, rs = tid / 16, el = tid % 16;
  auto dots = [&](float (&acc)[M]) {  // acc[m] = Bf[i0 + 16 m] . Ss[r] over DK, the M rows interleaved
    const float4* b = reinterpret_cast<const float4*>(Ss + r * BS);
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = 0.0f;
#pragma unroll 4
    for (int e = 0; e < DK / 4; ++e) {
      const float4 y = b[e];
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const float4 x = reinterpret_cast<const float4*>(Bf + (i0 + 16 * m) * BS)[e];
        acc[m] = fmaf(x.x, y.x, acc[m]), acc[m] = fmaf(x.y, y.y, acc[m]);
        acc[m] = fmaf(x.z, y.z, acc[m]), acc[m] = fmaf(x.w, y.w, acc[m]);
      }
    }
  };
  for (int c = 0; c < X.chunks; ++c) {
    const int64_t t0 = int64_t(c) * C;
    const int n = P.T - t0 < C ? int(P.T - t0) : C;
    const float* Wg = X.W + (int64_t(j) * P.T + t0) * DK;
    staged<NB>([&](int x) { return x / Q4 < n ? ld4(Wg + 4 * x) : kZero4; }, to_bf);
    if (tid < C) Gs[tid] = tid < n ? X.G[int64_t(j) * P.T + t0 + tid] : 0.0f;
    __syncthreads();  // W, G staged (and the last chunk's state rows written)
    float acc[M];
    dots(acc);  // D = U - W S0^T
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const int i = i0 + 16 * m;
      Dt[r * PS + i] = i < n ? __fsub_rn(X.U[(int64_t(j) * P.T + t0 + i) * P.dv + r0 + r], acc[m]) : 0.0f;
    }
    __syncthreads();  // W consumed, D complete
    auto qk_src = [&](int x) { return ((t0 + x / Q4) * P.hk + kh) * DK + 4 * (x % Q4); };
    staged<NB>([&](int x) { return x / Q4 < n ? scaled(ld4(P.q + qk_src(x)), P.scale) : kZero4; }, to_bf);
    const float* Pg = X.P + (int64_t(j) * X.chunks + c) * C * C;
    staged<C * C / 4 / kGdnChunkThreads>([&](int x) { return ld4(Pg + 4 * x); },
                                         [&](int x, float4 f) { st4(Ps + (x / (C / 4)) * PS + 4 * (x % (C / 4)), f); });
    __syncthreads();
    dots(acc);  // O = diag(Gamma) Q S0^T + P D (P is zero past the diagonal, D past n)
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] *= expf(Gs[i0 + 16 * m]);
#pragma unroll 4
    for (int j4 = 0; j4 < C / 4; ++j4) {  // j = 4 j4 .. 4 j4 + 3, in order
      const float4 d = ld4(Dt + r * PS + 4 * j4);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const float4 p = ld4(Ps + (i0 + 16 * m) * PS + 4 * j4);
        acc[m] = fmaf(p.x, d.x, acc[m]), acc[m] = fmaf(p.y, d.y, acc[m]);
        acc[m] = fmaf(p.z, d.z, acc[m]), acc[m] = fmaf(p.w, d.w, acc[m]);
      }
    }
#pragma unroll
    for (int m = 0; m < M; ++m)
      if (i0 + 16 * m < n) P.out[((t0 + i0 + 16 * m) * P.hv + j) * P.dv + r0 + r] = acc[m];
    __syncthreads();  // Q and P consumed; Ss still S0 for all
    const float gn = Gs[n - 1];
    staged<NB>([&](int x) { return x / Q4 < n ? ld4(P.k + qk_src(x)) : kZero4; },
               [&](int x, float4 f) { to_bf(x, scaled(f, expf(gn - Gs[x / Q4]))); });
    __syncthreads();
    // S = Gamma_n S0 + D^T K~: thread (rs, el) owns its elements of row rs (read and written by it alone);
    // the sum over i in order.
    const float decay = expf(gn);
    constexpr int V = DK >= 64 ? 4 : 1, NE = DK / 16 / V;  // elements per load, loads per i
    auto elem = [&](int m) { return V == 4 ? 64 * m + 4 * el : el + 16 * m; };
    float sacc[NE][V];
#pragma unroll
    for (int m = 0; m < NE; ++m)
#pragma unroll
      for (int v = 0; v < V; ++v) sacc[m][v] = decay * Ss[rs * BS + elem(m) + v];
#pragma unroll 2
    for (int i4 = 0; i4 < C / 4; ++i4) {  // rows past n: D and K~ are zero
      const float4 d4 = ld4(Dt + rs * PS + 4 * i4);
      const float dd[4] = {d4.x, d4.y, d4.z, d4.w};
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const float* kr = Bf + (4 * i4 + u) * BS;
#pragma unroll
        for (int m = 0; m < NE; ++m) {
          if constexpr (V == 4) {
            const float4 k = ld4(kr + elem(m));
            sacc[m][0] = fmaf(dd[u], k.x, sacc[m][0]), sacc[m][1] = fmaf(dd[u], k.y, sacc[m][1]);
            sacc[m][2] = fmaf(dd[u], k.z, sacc[m][2]), sacc[m][3] = fmaf(dd[u], k.w, sacc[m][3]);
          } else {
            sacc[m][0] = fmaf(dd[u], kr[elem(m)], sacc[m][0]);
          }
        }
      }
    }
#pragma unroll
    for (int m = 0; m < NE; ++m)
#pragma unroll
      for (int v = 0; v < V; ++v) Ss[rs * BS + elem(m) + v] = sacc[m][v];
    __syncthreads();  // the state rows are complete before the next chunk's phase 1 reads them
  }
  for (int x = tid; x < R * Q4; x += kGdnChunkThreads)
    st4(P.state_out + (int64_t(j) * P.dv + r0 + x / Q4) * DK + 4 * (x % Q4), ld4(Ss + (x / Q4) * BS + 4 * (x % Q4)));
}

}  // namespace specd::gpu::detail::gdn
