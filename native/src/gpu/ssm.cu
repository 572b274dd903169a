// Gated DeltaNet pieces on the GPU, same contracts as cpu::conv1d_causal and cpu::gated_delta_net
// (cpu/ssm.h). GPU inputs must be contiguous; states are updated in place, or read from `state` and
// written to `state_out` (same arithmetic, bitwise equal).
//
// conv1d_causal: one thread per channel and chunk of kConvTokens tokens, tokens in order; y[t, c] = sum_j w[j, c] * X[t + j, c]
// with j ascending and explicit round-to-nearest mul/add (no FMA), as the CPU op, then silu in
// double. Tolerance vs CPU: bit-identical (silu: <= 1 F32 ulp when device and host double exp
// straddle an F32 rounding boundary, practically never); state bit-identical.
//
// gated_delta_net: sequential over tokens; the dv x dk state of a value head lives in registers
// (L = max(4, dk / 16) lanes per state row, dk / L elements each: the 27B's dk = 128 has 8 lanes of
// 16) for dk in {32, 64, 128}, in blocks of kGdnRows state rows when dv % kGdnRows == 0 (else one
// block per head, if dv * L <= 512): the state rows are independent, so the split only adds blocks
// (the 27B: 4 per head). Otherwise a fallback kernel keeps the state in global memory (one block per
// head, one thread per state row). Lane p of a row holds elements p, p + L, ...; the layout fixes
// the order of the partial sums (8 lanes instead of 4 for dk = 128 halves each thread's chain of
// dependent adds and doubles the warps per token, which the one-token-at-a-time chain is bound by). The
// tokens' inputs are staged in shared memory kGdnStage at a time (one load wait and barrier pair per
// stage; a 512-token prefill chunk waited on 512). Per token: S <- exp(g) S; m = S^T k; d = beta (v - m); S <- S + k d;
// o = S^T (scale q), F32, fixed-order partial sums (per lane, then a fixed L-lane butterfly). The
// arithmetic of a token never depends on T, so T tokens at once equal several calls with the
// carried state (bitwise), and checkpoints[t] equal the state after token t (bitwise).
// Tolerance vs CPU (different dot-product order, expf): outputs and state within ~1e-5 relative
// to their scale per token; tests use 1e-4 * max|ref| + rtol 1e-4 over up to 16 tokens.
#include <algorithm>
#include <cmath>

#include "../cpu/ssm.h"
#include "activations.cuh"
#include "op_util.cuh"
#include "ops.h"

namespace specd::gpu {

namespace {

// ------------------------------------------------------------------------------ conv1d_causal

constexpr int kConvThreads = 128;
constexpr int64_t kConvTokens = 16;  // tokens per block (grid y); a prefill chunk of 2048 tokens: 128 blocks per channel

// Block (bx, by): channels bx * kConvThreads + threadIdx.x, tokens [by * chunk, + chunk). Every output
// is computed alone, so splitting the tokens over blocks changes no bits. Only the first chunk
// (chunk >= K - 1) reads state rows, and its threads write their channel's new state after their
// outputs: no other block touches the state, so in place is safe.
// state_out may be state (in place): no __restrict__ on either.
__global__ void __launch_bounds__(kConvThreads) conv1d_kernel(const float* __restrict__ x, const float* __restrict__ w,
                                                              const float* state, float* state_out,
                                                              float* __restrict__ y, int64_t T, int64_t C, int64_t K,
                                                              int64_t chunk, bool silu_out) {
  detail::pdl_enter();
  const int64_t c = int64_t(blockIdx.x) * kConvThreads + threadIdx.x;
  if (c >= C) return;
  const int64_t km1 = K - 1, t0 = int64_t(blockIdx.y) * chunk, t1 = t0 + chunk < T ? t0 + chunk : T;
  for (int64_t t = t0; t < t1; ++t) {
    float acc = 0.0f;
    for (int64_t j = 0; j < K; ++j) {
      int64_t r = t + j;
      float src = r < km1 ? state[r * C + c] : x[(r - km1) * C + c];
      acc = __fadd_rn(acc, __fmul_rn(w[j * C + c], src));
    }
    y[t * C + c] = silu_out ? detail::apply<detail::Op::Silu>(acc, 0.0f) : acc;  // the silu op's code
  }
  if (blockIdx.y != 0) return;
  // New state = X rows T .. T+K-2; ascending r reads state row T + r before it is overwritten
  // (in place).
  for (int64_t r = 0; r < km1; ++r) {
    int64_t src = T + r;
    state_out[r * C + c] = src < km1 ? state[src * C + c] : x[(src - km1) * C + c];
  }
}

// ---------------------------------------------------------------------------- gated_delta_net

struct GdnParams {
  const float *q, *k, *v, *g, *beta;
  const float* state;
  float* state_out;  // == state when in place
  float* ckpt;
  float scale;
  int64_t T;
  int hk, hv, dk, dv;
  float* out;
};

constexpr int kMinLanes = 4;  // threads per state row: dk / 16 (dk 128: 8), at least 4 (kernel template L)
constexpr int kMaxGdnThreads = 512;
constexpr int kGdnRows = 32;  // state rows per block when dv % kGdnRows == 0 (kGdnRows * L threads)
constexpr int kGdnStage = 8;  // tokens staged in shared memory at once (dk 128: 9.3 KiB per block)

// Block b: value head j = b / nb, state rows [(b % nb) * rows, + rows) with rows = blockDim.x / L.
// The tokens' k, q (pre-scaled), v, g and beta are staged in shared memory kGdnStage tokens at a time,
// so a prefill's token chain waits on global loads and barriers once per stage, not per token; the
// arithmetic of a token is unchanged (same bits for any T and stage split).
template <int E, int L>  // state elements per thread, threads per state row; dk = E * L
__global__ void __launch_bounds__(kMaxGdnThreads) gdn_kernel(const GdnParams P) {
  detail::pdl_enter();
  constexpr int DK = E * L;
  __shared__ float ks[kGdnStage][DK], qs[kGdnStage][DK], vs[kGdnStage][kMaxGdnThreads / L];
  __shared__ float gs[kGdnStage], bs[kGdnStage];
  const int rows = blockDim.x / L, nb = P.dv / rows;
  const int j = blockIdx.x / nb, kh = j % P.hk, r0 = (blockIdx.x % nb) * rows;
  const int jv = r0 + threadIdx.x / L, p = threadIdx.x % L;
  const int64_t head = int64_t(P.dv) * DK;
  const float* S = P.state + j * head + int64_t(jv) * DK;
  float s[E];
#pragma unroll
  for (int e = 0; e < E; ++e) s[e] = S[e * L + p];
  for (int64_t t0 = 0; t0 < P.T; t0 += kGdnStage) {
    const int n = P.T - t0 < kGdnStage ? int(P.T - t0) : kGdnStage;
    for (int i = threadIdx.x; i < n * DK; i += blockDim.x) {
      const int64_t src = ((t0 + i / DK) * P.hk + kh) * DK + i % DK;
      ks[i / DK][i % DK] = P.k[src];
      qs[i / DK][i % DK] = __fmul_rn(P.q[src], P.scale);
    }
    for (int i = threadIdx.x; i < n * rows; i += blockDim.x)
      vs[i / rows][i % rows] = P.v[((t0 + i / rows) * P.hv + j) * P.dv + r0 + i % rows];
    if (threadIdx.x < n) {
      gs[threadIdx.x] = P.g[(t0 + threadIdx.x) * P.hv + j];
      bs[threadIdx.x] = P.beta[(t0 + threadIdx.x) * P.hv + j];
    }
    __syncthreads();
    for (int u = 0; u < n; ++u) {
      const int64_t t = t0 + u;
      const float decay = expf(gs[u]);
      float m = 0.0f;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        s[e] = __fmul_rn(s[e], decay);
        m = __fadd_rn(m, __fmul_rn(s[e], ks[u][e * L + p]));
      }
#pragma unroll
      for (int x = 1; x < L; x <<= 1) m = __fadd_rn(m, SPECD_SHFL_XOR(m, x));
      const float d = __fmul_rn(bs[u], __fsub_rn(vs[u][jv - r0], m));
      float o = 0.0f;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        s[e] = __fadd_rn(s[e], __fmul_rn(ks[u][e * L + p], d));
        o = __fadd_rn(o, __fmul_rn(s[e], qs[u][e * L + p]));
      }
#pragma unroll
      for (int x = 1; x < L; x <<= 1) o = __fadd_rn(o, SPECD_SHFL_XOR(o, x));
      if (p == 0) P.out[(t * P.hv + j) * P.dv + jv] = o;
      if (P.ckpt) {
        float* C = P.ckpt + (t * P.hv + j) * head + int64_t(jv) * DK;
#pragma unroll
        for (int e = 0; e < E; ++e) C[e * L + p] = s[e];
      }
    }
    __syncthreads();  // the stage is rewritten for the next tokens
  }
  float* SO = P.state_out + j * head + int64_t(jv) * DK;
#pragma unroll
  for (int e = 0; e < E; ++e) SO[e * L + p] = s[e];
}

// Any dk / dv: the state stays in global memory, one thread per state row.
constexpr int kFallbackThreads = 128;
__global__ void __launch_bounds__(kFallbackThreads) gdn_fallback_kernel(const GdnParams P) {
  detail::pdl_enter();
  extern __shared__ float sh[];
  float* ks = sh;
  float* qs = sh + P.dk;
  const int j = blockIdx.x, kh = j % P.hk;
  const int64_t head = int64_t(P.dv) * P.dk;
  if (P.state_out != P.state) {  // out of place: the recurrence runs on state_out (same rows per thread)
    for (int jv = threadIdx.x; jv < P.dv; jv += blockDim.x) {
      const int64_t row = j * head + int64_t(jv) * P.dk;
      for (int i = 0; i < P.dk; ++i) P.state_out[row + i] = P.state[row + i];
    }
  }
  for (int64_t t = 0; t < P.T; ++t) {
    for (int i = threadIdx.x; i < P.dk; i += blockDim.x) {
      ks[i] = P.k[(t * P.hk + kh) * P.dk + i];
      qs[i] = __fmul_rn(P.q[(t * P.hk + kh) * P.dk + i], P.scale);
    }
    __syncthreads();
    const float decay = expf(P.g[t * P.hv + j]);
    const float bt = P.beta[t * P.hv + j];
    for (int jv = threadIdx.x; jv < P.dv; jv += blockDim.x) {
      float* s = P.state_out + j * head + int64_t(jv) * P.dk;
      float m = 0.0f;
      for (int i = 0; i < P.dk; ++i) {
        s[i] = __fmul_rn(s[i], decay);
        m = __fadd_rn(m, __fmul_rn(s[i], ks[i]));
      }
      const float d = __fmul_rn(bt, __fsub_rn(P.v[(t * P.hv + j) * P.dv + jv], m));
      float o = 0.0f;
      for (int i = 0; i < P.dk; ++i) {
        s[i] = __fadd_rn(s[i], __fmul_rn(ks[i], d));
        o = __fadd_rn(o, __fmul_rn(s[i], qs[i]));
      }
      P.out[(t * P.hv + j) * P.dv + jv] = o;
      if (P.ckpt)
        for (int i = 0; i < P.dk; ++i) P.ckpt[(t * P.hv + j) * head + int64_t(jv) * P.dk + i] = s[i];
    }
    __syncthreads();
  }
}

// ------------------------------------------------------------- gated_delta_net, chunked (prefill)
//
// The inexact prefill path (exact = false, T >= kGdnChunk tokens, no checkpoints): the chunkwise form
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
// tests/gpu/test_gpu_gdn_chunked.py's reference), in F32 with other rounding: tolerance vs the CPU
// op 1e-4 * max|ref| + 1e-4 relative, as the token kernel's. Two kernels:
//   gdn_chunk_prep_kernel, one block per (chunk, value head), all chunks at once (they do not depend on
//   the state): G, P, U and W into scratch;
//   gdn_chunk_state_kernel, one block per (value head, kGdnChunkRows state rows), the chunks in order:
//   state row r only meets column r of D and of O, so row blocks are independent.

constexpr int kGdnChunk = 64;        // tokens per chunk (part of the path's arithmetic)
constexpr int kGdnChunkThreads = 256;
constexpr int kGdnChunkRows = 16;    // state rows per block of the state pass

struct GdnChunkScratch {
  float* U;  // [hv, T, dv]
  float* W;  // [hv, T, dk]
  float* P;  // [hv, chunks, 64, 64]
  float* G;  // [hv, T]
  int chunks;
};

// Dynamic shared memory of the two kernels for head dim DK.
constexpr size_t gdn_prep_smem(int dk) { return size_t(2 * kGdnChunk * (dk + 1) + kGdnChunk * (kGdnChunk + 1) + 2 * kGdnChunk) * 4; }
constexpr size_t gdn_state_smem(int dk) {
  return size_t(kGdnChunk * (dk + 4) + kGdnChunk * (kGdnChunk + 1) + kGdnChunkRows * (dk + 4) +
                kGdnChunk * (kGdnChunkRows + 1) + kGdnChunk) * 4;
}

template <int DK>
__global__ void __launch_bounds__(kGdnChunkThreads) gdn_chunk_prep_kernel(const GdnParams P, const GdnChunkScratch X) {
  detail::pdl_enter();
  constexpr int C = kGdnChunk, KS = DK + 1;
  extern __shared__ float sm[];
  float* Ks = sm;              // [C][KS] k rows (zeros past n)
  float* Qs = Ks + C * KS;     // [C][KS] scale * q rows
  float* As = Qs + C * KS;     // [C][C + 1] A
  float* Gs = As + C * (C + 1);  // [C] G
  float* Bs = Gs + C;          // [C] beta
  const int c = blockIdx.x, j = blockIdx.y, kh = j % P.hk, tid = threadIdx.x;
  const int64_t t0 = int64_t(c) * C;
  const int n = P.T - t0 < C ? int(P.T - t0) : C;
  for (int x = tid; x < C * DK; x += kGdnChunkThreads) {
    const int i = x / DK, e = x % DK;
    const int64_t src = ((t0 + i) * P.hk + kh) * DK + e;
    Ks[i * KS + e] = i < n ? P.k[src] : 0.0f;
    Qs[i * KS + e] = i < n ? __fmul_rn(P.q[src], P.scale) : 0.0f;
  }
  if (tid < C) {
    Gs[tid] = tid < n ? P.g[(t0 + tid) * P.hv + j] : 0.0f;
    Bs[tid] = tid < n ? P.beta[(t0 + tid) * P.hv + j] : 0.0f;
  }
  __syncthreads();
  if (tid == 0)  // the prefix sum, in token order
    for (int i = 1; i < n; ++i) Gs[i] = __fadd_rn(Gs[i - 1], Gs[i]);
  // k_i . k_j and q_i . k_j for a 4 x 4 tile (i = 4 ti + a, j = 4 tj + b) per thread
  const int ti = tid / 16, tj = tid % 16;
  float kk[4][4] = {}, qk[4][4] = {};
  for (int e = 0; e < DK; ++e) {
    float ki[4], qi[4], kj[4];
#pragma unroll
    for (int a = 0; a < 4; ++a) ki[a] = Ks[(4 * ti + a) * KS + e], qi[a] = Qs[(4 * ti + a) * KS + e], kj[a] = Ks[(4 * tj + a) * KS + e];
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int b = 0; b < 4; ++b) kk[a][b] = fmaf(ki[a], kj[b], kk[a][b]), qk[a][b] = fmaf(qi[a], kj[b], qk[a][b]);
  }
  __syncthreads();  // Gs complete
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
  __syncthreads();
  // Forward substitution, one column per thread: x_i = rhs_i - sum_{j<i} A_ij x_j (rows past n: zeros)
  for (int col = tid; col < P.dv + DK; col += kGdnChunkThreads) {
    const bool isu = col < P.dv;
    const int e = isu ? col : col - P.dv;
    float x[C];
#pragma unroll
    for (int i = 0; i < C; ++i) {
      float s = 0.0f;
      if (i < n) s = isu ? Bs[i] * P.v[((t0 + i) * P.hv + j) * P.dv + e] : Bs[i] * expf(Gs[i]) * Ks[i * KS + e];
#pragma unroll
      for (int jj = 0; jj < i; ++jj) s = fmaf(-As[i * (C + 1) + jj], x[jj], s);
      x[i] = s;
    }
    float* dst = isu ? X.U + (int64_t(j) * P.T + t0) * P.dv + e : X.W + (int64_t(j) * P.T + t0) * DK + e;
    const int stride = isu ? P.dv : DK;
#pragma unroll
    for (int i = 0; i < C; ++i)
      if (i < n) dst[int64_t(i) * stride] = x[i];
  }
}

template <int DK>
__global__ void __launch_bounds__(kGdnChunkThreads) gdn_chunk_state_kernel(const GdnParams P, const GdnChunkScratch X) {
  detail::pdl_enter();
  constexpr int C = kGdnChunk, R = kGdnChunkRows, BS = DK + 4, DS = R + 1;
  extern __shared__ __align__(16) float sm[];
  float* Bf = sm;              // [C][BS] W, then scale * Q, then exp(G_n - G_i) K (one at a time)
  float* Ps = Bf + C * BS;     // [C][C + 1] P
  float* Ss = Ps + C * (C + 1);  // [R][BS] the block's state rows (16-byte aligned rows: BS % 4 == 0, offsets too)
  float* Ds = Ss + R * BS;     // [C][DS] D's columns of the block's rows
  float* Gs = Ds + C * DS;     // [C]
  const int nb = P.dv / R, j = blockIdx.x / nb, r0 = (blockIdx.x % nb) * R, kh = j % P.hk, tid = threadIdx.x;
  for (int x = tid; x < R * DK; x += kGdnChunkThreads)
    Ss[(x / DK) * BS + x % DK] = P.state[(int64_t(j) * P.dv + r0 + x / DK) * DK + x % DK];
  // Phases 1 and 2: thread (r = tid % R, rows i = i0 + 16 m); phase 3: (r = tid / 16, elements e = el + 16 m).
  const int r = tid % R, i0 = tid / R;
  static_assert(kGdnChunkThreads / R == 16 && C == 64, "phase 1 / 2 cover 16 x 4 = 64 rows");
  auto dot_row = [&](int i) {  // Bf[i] . Ss[r] over DK, 4 at a time
    const float4* a = reinterpret_cast<const float4*>(Bf + i * BS);
    const float4* b = reinterpret_cast<const float4*>(Ss + r * BS);
    float acc = 0.0f;
#pragma unroll 8
    for (int e = 0; e < DK / 4; ++e) {
      const float4 x = a[e], y = b[e];
      acc = fmaf(x.x, y.x, acc), acc = fmaf(x.y, y.y, acc), acc = fmaf(x.z, y.z, acc), acc = fmaf(x.w, y.w, acc);
    }
    return acc;
  };
  for (int c = 0; c < X.chunks; ++c) {
    const int64_t t0 = int64_t(c) * C;
    const int n = P.T - t0 < C ? int(P.T - t0) : C;
    const float* Wg = X.W + (int64_t(j) * P.T + t0) * DK;
    for (int x = tid; x < C * DK; x += kGdnChunkThreads) Bf[(x / DK) * BS + x % DK] = x / DK < n ? Wg[x] : 0.0f;
    if (tid < C) Gs[tid] = tid < n ? X.G[int64_t(j) * P.T + t0 + tid] : 0.0f;
    __syncthreads();  // W, G staged (and the last chunk's state rows written)
#pragma unroll
    for (int m = 0; m < 4; ++m) {  // D = U - W S0^T
      const int i = i0 + 16 * m;
      const float w = dot_row(i);
      Ds[i * DS + r] = i < n ? __fsub_rn(X.U[(int64_t(j) * P.T + t0 + i) * P.dv + r0 + r], w) : 0.0f;
    }
    __syncthreads();  // W consumed, D complete
    for (int x = tid; x < C * DK; x += kGdnChunkThreads) {
      const int i = x / DK;
      Bf[i * BS + x % DK] = i < n ? __fmul_rn(P.q[((t0 + i) * P.hk + kh) * DK + x % DK], P.scale) : 0.0f;
    }
    const float* Pg = X.P + (int64_t(j) * X.chunks + c) * C * C;
    for (int x = tid; x < C * C; x += kGdnChunkThreads) Ps[(x / C) * (C + 1) + x % C] = Pg[x];
    __syncthreads();
#pragma unroll
    for (int m = 0; m < 4; ++m) {  // O = diag(Gamma) Q S0^T + P D
      const int i = i0 + 16 * m;
      float o = expf(Gs[i]) * dot_row(i);
      for (int jj = 0; jj <= i; ++jj) o = fmaf(Ps[i * (C + 1) + jj], Ds[jj * DS + r], o);
      if (i < n) P.out[((t0 + i) * P.hv + j) * P.dv + r0 + r] = o;
    }
    __syncthreads();  // Q and P consumed; Ss still S0 for all
    const float gn = Gs[n - 1];
    for (int x = tid; x < C * DK; x += kGdnChunkThreads) {
      const int i = x / DK;
      Bf[i * BS + x % DK] = i < n ? expf(gn - Gs[i]) * P.k[((t0 + i) * P.hk + kh) * DK + x % DK] : 0.0f;
    }
    __syncthreads();
    const float decay = expf(gn);
    const int rs = tid / 16, el = tid % 16;
#pragma unroll
    for (int m = 0; m < DK / 16; ++m) {  // S = Gamma_n S0 + D^T K~ (each element read and written by one thread)
      const int e = el + 16 * m;
      float s = decay * Ss[rs * BS + e];
      for (int i = 0; i < n; ++i) s = fmaf(Ds[i * DS + rs], Bf[i * BS + e], s);
      Ss[rs * BS + e] = s;
    }
    __syncthreads();  // the state rows are complete before the next chunk's phase 1 reads them
  }
  for (int x = tid; x < R * DK; x += kGdnChunkThreads)
    P.state_out[(int64_t(j) * P.dv + r0 + x / DK) * DK + x % DK] = Ss[(x / DK) * BS + x % DK];
}

// The chunked path for head dim DK (the caller checked gdn_chunked_ok): the two kernels, scratch from the pool.
template <int DK>
void launch_gdn_chunked(const GdnParams& P, cudaStream_t s, const char* op) {
  static const bool limits_set = [] {
    SPECD_GPU_CHECK(cudaFuncSetAttribute(gdn_chunk_prep_kernel<DK>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(gdn_prep_smem(DK))));
    SPECD_GPU_CHECK(cudaFuncSetAttribute(gdn_chunk_state_kernel<DK>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(gdn_state_smem(DK))));
    return true;
  }();
  (void)limits_set;
  const int chunks = int((P.T + kGdnChunk - 1) / kGdnChunk);
  Tensor scratch = Tensor::empty({int64_t(P.hv) * (P.T * (P.dv + DK + 1) + int64_t(chunks) * kGdnChunk * kGdnChunk)},
                                 DType::F32, Device::GPU);
  GdnChunkScratch X{};
  X.U = scratch.ptr<float>();
  X.W = X.U + int64_t(P.hv) * P.T * P.dv;
  X.G = X.W + int64_t(P.hv) * P.T * DK;
  X.P = X.G + int64_t(P.hv) * P.T;
  X.chunks = chunks;
  detail::check_grid(chunks, op);
  detail::launch_kernel<gdn_chunk_prep_kernel<DK>>("gdn_chunk_prep_kernel", dim3(unsigned(chunks), unsigned(P.hv)),
                                                   kGdnChunkThreads, gdn_prep_smem(DK), s, P, X);
  const int64_t blocks = int64_t(P.hv) * (P.dv / kGdnChunkRows);
  detail::check_grid(blocks, op);
  detail::launch_kernel<gdn_chunk_state_kernel<DK>>("gdn_chunk_state_kernel", unsigned(blocks), kGdnChunkThreads,
                                                    gdn_state_smem(DK), s, P, X);
}

// Whether a call may take the chunked path: inexact, at least one chunk of tokens, no checkpoints (they
// need every token's state), dk 32 / 64 / 128 and whole row blocks, and the shared memory the device has.
bool gdn_chunked_ok(bool exact, bool checkpoints, int64_t T, int64_t dk, int64_t dv) {
  if (exact || checkpoints || T < kGdnChunk || dv % kGdnChunkRows != 0) return false;
  if (dk != 32 && dk != 64 && dk != 128) return false;
  return int64_t(gdn_prep_smem(int(dk))) <= detail::max_smem_optin() &&
         int64_t(gdn_state_smem(int(dk))) <= detail::max_smem_optin();
}

}  // namespace

Tensor conv1d_causal(const Tensor& x, const Tensor& weight, const Tensor& state, bool apply_silu,
                     const std::optional<Tensor>& state_out) {
  const char* op = "conv1d_causal";
  detail::check_gpu_tensor(x, DType::F32, 2, op, "x");
  detail::check_gpu_tensor(weight, DType::F32, 2, op, "weight");
  int64_t T = x.dim(0), C = x.dim(1), K = weight.dim(0);
  SPECD_CHECK(K >= 1 && weight.dim(1) == C, op, ": weight must be [K >= 1, C=", C, "], got [", K, ", ",
              weight.dim(1), "]");
  const Tensor& out_state = cpu::written_state(state, state_out, {K - 1, C}, {&x, &weight}, Device::GPU, op);
  Tensor y = Tensor::empty({T, C}, DType::F32, Device::GPU);
  if (C == 0) return y;
  int64_t blocks = (C + kConvThreads - 1) / kConvThreads;
  detail::check_grid(blocks, op);
  // at least K - 1 tokens per chunk, so only the first chunk reads the state (see the kernel); at
  // most 65535 chunks (grid y)
  const int64_t chunk = std::max({kConvTokens, K - 1, (T + 65534) / 65535});
  const int64_t chunks = std::max<int64_t>(1, (T + chunk - 1) / chunk);
  detail::launch_kernel<conv1d_kernel>("conv1d_kernel", dim3(unsigned(blocks), unsigned(chunks)), kConvThreads, 0,
                                       detail::stream(), x.ptr<float>(), weight.ptr<float>(), state.ptr<float>(),
                                       out_state.ptr<float>(), y.ptr<float>(), T, C, K, chunk, apply_silu);
  return y;
}

Tensor gated_delta_net(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                       const Tensor& state, float scale, const std::optional<Tensor>& checkpoints,
                       const std::optional<Tensor>& state_out, bool exact) {
  const char* op = "gated_delta_net";
  detail::check_gpu_tensor(q, DType::F32, 3, op, "q");
  detail::check_gpu_tensor(k, DType::F32, 3, op, "k");
  detail::check_gpu_tensor(v, DType::F32, 3, op, "v");
  detail::check_gpu_tensor(g, DType::F32, 2, op, "g");
  detail::check_gpu_tensor(beta, DType::F32, 2, op, "beta");
  const cpu::GdnDims d = cpu::check_gated_delta_net_shapes(q, k, v, g, beta, scale, op);
  const int64_t T = d.T, hk = d.hk, dk = d.dk, hv = d.hv, dv = d.dv;
  if (checkpoints) {
    cpu::check_state(*checkpoints, {T, hv, dv, dk}, Device::GPU, op, "checkpoints");
    SPECD_CHECK(!cpu::overlap(*checkpoints, state), op, ": checkpoints must not overlap state");  // blocks race
  }
  const Tensor& out_state = cpu::written_state(state, state_out, {hv, dv, dk},
                                               {&q, &k, &v, &g, &beta, checkpoints ? &*checkpoints : nullptr},
                                               Device::GPU, op);
  SPECD_CHECK(hv <= 0x7fffffff && dk <= 0x7fffffff / 2 && dv <= 0x7fffffff, op, ": dimensions too large");
  Tensor out = Tensor::empty({T, hv, dv}, DType::F32, Device::GPU);
  const bool in_place = out_state.data == state.data;
  if ((T == 0 && in_place) || hv == 0 || dv == 0) return out;  // out of place, T = 0: the kernel copies
  GdnParams P{q.ptr<float>(),  k.ptr<float>(), v.ptr<float>(), g.ptr<float>(), beta.ptr<float>(),
              state.ptr<float>(), out_state.ptr<float>(), checkpoints ? checkpoints->ptr<float>() : nullptr, scale,
              T, int(hk), int(hv), int(dk), int(dv), out.ptr<float>()};
  cudaStream_t s = detail::stream();
  if (gdn_chunked_ok(exact, checkpoints.has_value(), T, dk, dv)) {
    if (dk == 32) launch_gdn_chunked<32>(P, s, op);
    else if (dk == 64) launch_gdn_chunked<64>(P, s, op);
    else launch_gdn_chunked<128>(P, s, op);
    return out;
  }
  // The register kernel (dk 32 / 64 / 128, whole warps per block): dk / 16 lanes per state row (at
  // least 4), so a token's two dot products are chains of at most 16 adds; anything else takes the
  // fallback, one block per head.
  const int lanes = std::max<int>(kMinLanes, int(dk / 16));
  const int64_t rows = dv % kGdnRows == 0 ? kGdnRows : dv;  // state rows per block
  const int threads = int(rows) * lanes;
  const bool fast = (dk == 32 || dk == 64 || dk == 128) && rows * lanes <= kMaxGdnThreads && threads % SPECD_WARP == 0;
  const int64_t blocks = fast ? hv * (dv / rows) : hv;
  detail::check_grid(blocks, op);
  if (fast && dk == 32) {
    detail::launch_kernel<gdn_kernel<8, 4>>("gdn_kernel", unsigned(blocks), threads, 0, s, P);
  } else if (fast && dk == 64) {
    detail::launch_kernel<gdn_kernel<16, 4>>("gdn_kernel", unsigned(blocks), threads, 0, s, P);
  } else if (fast) {  // dk == 128
    detail::launch_kernel<gdn_kernel<16, 8>>("gdn_kernel", unsigned(blocks), threads, 0, s, P);
  } else {
    size_t shmem = size_t(2 * dk) * sizeof(float);
    SPECD_CHECK(shmem <= 48 * 1024, op, ": dk too large for the GPU op (", dk, ")");
    detail::launch_kernel<gdn_fallback_kernel>("gdn_fallback_kernel", unsigned(blocks), kFallbackThreads, shmem, s, P);
  }
  return out;
}

}  // namespace specd::gpu
