// The token-by-token Gated DeltaNet kernels: one token of one state row (gdn_row_token, the arithmetic of
// all), gdn_kernel (gated_delta_net's register kernel, its blocks gdn_rows), gdn_layers_kernel
// (gated_delta_net_states': gdn_rows of several layers in one launch) and gdn_step_kernel (gdn_step's), and their
// launch shape.
// Included by ssm.cu and gdn_step_split.cuh (matmul.cu), and compiled for the host by the emulation harnesses
// tests/gpu/host_emu/gdn_step_main.cpp and gdn_split_main.cpp.
#pragma once

#ifndef SPECD_HOST_EMU
#include "common.cuh"
#endif

#include <cstdint>
#include <type_traits>

#include "activations.cuh"
#include "dyn_smem.cuh"
#include "gdn_chunked.cuh"  // gdn::Params
#include "norm.cuh"
#include "pdl.cuh"

namespace specd::gpu::detail::gdn_step {

constexpr int kMaxGdnThreads = 512;
constexpr int kGdnRows = 32;  // state rows per block when dv % kGdnRows == 0 (kGdnRows * L threads)
constexpr int kMinLanes = 4;  // threads per state row: dk / 16 (dk 128: 8), at least 4 (kernel template L)

// The register kernels' launch shape (gdn_kernel, gdn_step_kernel; ssm.cu): dk / 16 lanes per state row (at least
// kMinLanes), so a token's two dot products are chains of at most 16 adds; blocks of kGdnRows state rows when dv %
// kGdnRows == 0, else of a whole head; they serve dk 32 / 64 / 128 with whole warps of at most kMaxGdnThreads
// (anything else takes ssm.cu's fallback recurrence, one block per head, and gdn_step its composition).
inline int gdn_lanes(int64_t dk) { return dk / 16 > kMinLanes ? int(dk / 16) : kMinLanes; }
inline int64_t gdn_block_rows(int64_t dv) { return dv % kGdnRows == 0 ? kGdnRows : dv; }
inline bool gdn_register_kernel(int64_t dk, int64_t dv) {
  const int64_t threads = gdn_block_rows(dv) * gdn_lanes(dk);
  return (dk == 32 || dk == 64 || dk == 128) && threads <= kMaxGdnThreads && threads % SPECD_WARP == 0;
}

// f(E, L) (std::integral_constant) for the register kernels' instance of dk (gdn_register_kernel(dk, dv)).
template <class F>
decltype(auto) with_gdn_instance(int64_t dk, const F& f) {
  using std::integral_constant;
  if (dk == 32) return f(integral_constant<int, 8>(), integral_constant<int, 4>());
  if (dk == 64) return f(integral_constant<int, 16>(), integral_constant<int, 4>());
  return f(integral_constant<int, 16>(), integral_constant<int, 8>());
}

constexpr int kGdnStage = 8;  // tokens staged in shared memory at once (dk 128: gdn_kernel 9.3 KiB, gdn_step 17.1 KiB)

// One token of one state row, lane p of L holding elements p, p + L, ... of the row in s: S <- exp(g) S;
// m = S . k; d = beta (v - m); S <- S + k d; returns o = S . q (every lane; q pre-scaled). k, q: the
// token's dk values (shared memory). The one definition of the token step of gdn_kernel and
// gdn_step_kernel, so both give the same bits.
template <int E, int L>
__device__ __forceinline__ float gdn_row_token(float (&s)[E], const float* ks, const float* qs, float v, float g,
                                               float beta, int p) {
  const float decay = expf(g);
  float m = 0.0f;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    s[e] = __fmul_rn(s[e], decay);
    m = __fadd_rn(m, __fmul_rn(s[e], ks[e * L + p]));
  }
#pragma unroll
  for (int x = 1; x < L; x <<= 1) m = __fadd_rn(m, SPECD_SHFL_XOR(m, x));
  const float d = __fmul_rn(beta, __fsub_rn(v, m));
  float o = 0.0f;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    s[e] = __fadd_rn(s[e], __fmul_rn(ks[e * L + p], d));
    o = __fadd_rn(o, __fmul_rn(s[e], qs[e * L + p]));
  }
#pragma unroll
  for (int x = 1; x < L; x <<= 1) o = __fadd_rn(o, SPECD_SHFL_XOR(o, x));
  return o;
}

// Block `block` of a gated_delta_net launch: value head j = block / nb, state rows [(block % nb) * rows, + rows) with
// rows = blockDim.x / L. The tokens' k, q (pre-scaled), v, g and beta are staged in shared memory kGdnStage tokens
// at a time, so a prefill's token chain waits on global loads and barriers once per stage, not per token; the
// arithmetic of a token is unchanged (same bits for any T and stage split). kOut: o is written (P.out); without
// it only the state (and checkpoints) are, which is all a commit's recompute needs (gdn_layers_kernel).
template <int E, int L, bool kOut>  // state elements per thread, threads per state row; dk = E * L
__device__ __forceinline__ void gdn_rows(const gdn::Params& P, int64_t block) {
  constexpr int DK = E * L;
  __shared__ float ks[kGdnStage][DK], qs[kGdnStage][DK], vs[kGdnStage][kMaxGdnThreads / L];
  __shared__ float gs[kGdnStage], bs[kGdnStage];
  const int rows = blockDim.x / L, nb = P.dv / rows;
  const int j = int(block / nb), kh = j % P.hk, r0 = int(block % nb) * rows;
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
      const float o = gdn_row_token<E, L>(s, ks[u], qs[u], vs[u][jv - r0], gs[u], bs[u], p);
      if constexpr (kOut)
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

template <int E, int L>
__global__ void __launch_bounds__(kMaxGdnThreads) gdn_kernel(const gdn::Params P) {
  pdl_enter();
  gdn_rows<E, L, true>(P, blockIdx.x);
}

// gated_delta_net_states' launch (ssm.cu): the recurrence of up to kMaxGdnLayers layers of the same shape over their
// own tokens, in place on each layer's state, without outputs: a spec step's commit of a chain prefix (the target's
// GDN layers do not depend on each other there, so one launch runs them side by side instead of one small launch a
// layer after another). Kernel parameters, not a device table: a captured graph keeps them, and nothing is uploaded.
constexpr int kMaxGdnLayers = 64;  // 6 pointers a layer: 3 KiB of parameters (HIP's limit: 4 KiB)
struct GdnLayers {
  const float *q[kMaxGdnLayers], *k[kMaxGdnLayers], *v[kMaxGdnLayers], *g[kMaxGdnLayers], *beta[kMaxGdnLayers];
  float* state[kMaxGdnLayers];
  float scale;
  int64_t T;
  int hk, hv, dk, dv;
  int64_t blocks_per_layer;  // gdn_kernel's grid for one layer
};
static_assert(sizeof(GdnLayers) <= 4096, "GdnLayers: kernel parameters within 4 KiB (HIP's limit)");

// Block b: block b % blocks_per_layer of layer b / blocks_per_layer's gdn_kernel grid (a 1-D grid, so the host
// emulation's launches run it), with gdn_kernel's code and thus its bits.
template <int E, int L>
__global__ void __launch_bounds__(kMaxGdnThreads) gdn_layers_kernel(const GdnLayers Ls) {
  pdl_enter();
  const int64_t layer = int64_t(blockIdx.x) / Ls.blocks_per_layer;
  const gdn::Params P{Ls.q[layer], Ls.k[layer], Ls.v[layer], Ls.g[layer], Ls.beta[layer], Ls.state[layer],
                      Ls.state[layer], nullptr, Ls.scale, Ls.T, Ls.hk, Ls.hv, Ls.dk, Ls.dv, nullptr};
  gdn_rows<E, L, false>(P, int64_t(blockIdx.x) % Ls.blocks_per_layer);
}

// gdn_step in one launch: gdn_step_kernel runs gdn_qkv (L2-normed q / k heads, v), gdn_gates and the
// token-by-token recurrence in gdn_kernel's blocks (a value head's state rows split over blocks of
// `rows` rows x L lanes), writing o (its gated norm runs in the out projection's x split:
// rms_norm_gated_matmul). Tokens in stages of kGdnStage. Every value is computed with the composition's
// code: the L2 norms by warp_norm_row (norm_row's sums in its order), the gates by gdn_g / gdn_beta, the
// recurrence by gdn_row_token, so outputs, pending q / k / v / g / beta and state are bit-identical to the
// composition on the GPU.
struct GdnStepParams {
  const float* cv;  // [T, 2 hk dk + hv dv] conv outputs
  const float *a, *b, *dt, *ssm_a;
  const float* state;
  float* state_out;
  float *o, *q, *k, *v, *g, *beta;
  int64_t T;
  int hk, hv, dv;
  float eps, scale;
};

template <int DK>
// bytes: cq, ck, qs, ks [S][DK]; vs [S][rows]; gs, bs [S]
__host__ __device__ constexpr size_t gdn_step_smem(int rows) {
  return sizeof(float) * kGdnStage * (4 * size_t(DK) + size_t(rows) + 2);
}

// The state rows of block b: value head b / nb, rows [(b % nb) * rows, + rows) of DK floats, contiguous
// (nb = dv / rows).
template <int DK>
__device__ __forceinline__ const float* gdn_block_state(const GdnStepParams& P, int rows) {
  const int nb = P.dv / rows;
  return P.state + (int64_t(blockIdx.x / nb) * P.dv + int64_t(blockIdx.x % nb) * rows) * DK;
}

// The bytes of the block's state rows (gdn_block_state's), which the kernels ask L2 for before their wait (16 KiB at
// the 27B's shapes, 3 MiB a layer, never in L2 a step later).
template <int E, int L>
__device__ __forceinline__ size_t gdn_block_state_bytes() {
  return sizeof(float) * (blockDim.x / L) * E * L;
}

// gdn_step_kernel's work after its wait. Block b: value head j = b / nb, state rows [(b % nb) * rows, + rows) with
// rows = blockDim.x / L (gdn_kernel's).
template <int E, int L>
__device__ __forceinline__ void gdn_step_block(const GdnStepParams& P) {
  using norm::Mode;
  using norm::warp_norm_row;
  constexpr int DK = E * L, S = kGdnStage;
  static_assert(DK % 4 == 0, "gdn_qkv's vector path (dk % 4 == 0), which every register-kernel dk takes");
  const int rows = blockDim.x / L, nb = P.dv / rows;
  float* cq = dyn_smem();  // conv q / k rows of the stage's tokens
  float* ck = cq + S * DK;
  float* qs = ck + S * DK;  // L2-normed q (then scaled) and k
  float* ks = qs + S * DK;
  float* vs = ks + S * DK;  // the block's v columns
  float* gs = vs + S * rows;
  float* bs = gs + S;
  const int j = blockIdx.x / nb, rb = blockIdx.x % nb, r0 = rb * rows, kh = j % P.hk;
  const int tid = threadIdx.x, lane = tid % SPECD_WARP, warp = tid / SPECD_WARP, warps = blockDim.x / SPECD_WARP;
  const int jv = r0 + tid / L, p = tid % L;
  const bool qk_writer = j < P.hk && rb == 0;  // one block per key head writes its q and k
  const int64_t cols = 2 * int64_t(P.hk) * DK + int64_t(P.hv) * P.dv, head = int64_t(P.dv) * DK;
  float s[E];
  const float* S0 = gdn_block_state<DK>(P, rows) + int64_t(tid / L) * DK;  // row jv, as prefetched
#pragma unroll
  for (int e = 0; e < E; ++e) s[e] = S0[e * L + p];
  for (int64_t t0 = 0; t0 < P.T; t0 += S) {
    const int n = P.T - t0 < S ? int(P.T - t0) : S;
    for (int i = tid; i < n * DK; i += blockDim.x) {
      const float* row = P.cv + (t0 + i / DK) * cols;
      cq[i] = row[int64_t(kh) * DK + i % DK];
      ck[i] = row[(int64_t(P.hk) + kh) * DK + i % DK];
    }
    for (int i = tid; i < n * rows; i += blockDim.x) {
      const int64_t t = t0 + i / rows, c = int64_t(j) * P.dv + r0 + i % rows;
      vs[i] = P.cv[t * cols + 2 * int64_t(P.hk) * DK + c];
      P.v[t * P.hv * P.dv + c] = vs[i];
    }
    if (tid < n) {
      const int64_t e = (t0 + tid) * P.hv + j;
      gs[tid] = gdn_g(P.a[e], P.dt[j], P.ssm_a[j]);
      bs[tid] = gdn_beta(P.b[e]);
      if (rb == 0) P.g[e] = gs[tid], P.beta[e] = bs[tid];
    }
    __syncthreads();
    for (int task = warp; task < 2 * n; task += warps) {  // (token, q or k): one warp each
      const int u = task / 2;
      const float* src = (task & 1 ? ck : cq) + u * DK;
      warp_norm_row<Mode::L2, true, false>(src, nullptr, nullptr, (task & 1 ? ks : qs) + u * DK, DK, P.eps, lane);
    }
    __syncthreads();
    for (int i = tid; i < n * DK; i += blockDim.x) {
      if (qk_writer) {
        const int64_t e = ((t0 + i / DK) * P.hk + kh) * DK + i % DK;
        P.q[e] = qs[i];
        P.k[e] = ks[i];
      }
      qs[i] = __fmul_rn(qs[i], P.scale);  // as gdn_kernel stages q
    }
    __syncthreads();
    for (int u = 0; u < n; ++u) {
      const int64_t t = t0 + u;
      const float o = gdn_row_token<E, L>(s, ks + u * DK, qs + u * DK, vs[u * rows + jv - r0], gs[u], bs[u], p);
      if (p == 0) P.o[(t * P.hv + j) * P.dv + jv] = o;
    }
    __syncthreads();  // the stage's buffers are refilled
  }
  float* SO = P.state_out + j * head + int64_t(jv) * DK;
#pragma unroll
  for (int e = 0; e < E; ++e) SO[e * L + p] = s[e];
}

template <int E, int L>
__global__ void __launch_bounds__(kMaxGdnThreads) gdn_step_kernel(const GdnStepParams P) {
  pdl_enter_prefetch(gdn_block_state<E * L>(P, blockDim.x / L), gdn_block_state_bytes<E, L>());
  gdn_step_block<E, L>(P);
}

}  // namespace specd::gpu::detail::gdn_step
