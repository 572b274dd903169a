// Gated DeltaNet pieces on the GPU, same contracts as cpu::conv1d_causal and cpu::gated_delta_net
// (cpu/ssm.h). GPU inputs must be contiguous; states are updated in place, or read from `state` and
// written to `state_out` (same arithmetic, bitwise equal).
//
// conv1d_causal: one thread per channel and chunk of kConvTokens tokens (out of place and T <= kConvTokenChunksUpTo:
// one token), tokens in order; y[t, c] = sum_j w[j, c] * X[t + j, c]
// with j ascending and explicit round-to-nearest mul/add (no FMA), as the CPU op, then silu in
// double. Tolerance vs CPU: bit-identical (silu: <= 1 F32 ulp when device and host double exp
// straddle an F32 rounding boundary, practically never); state bit-identical.
//
// gated_delta_net (exact): sequential over tokens; the dv x dk state of a value head lives in registers
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
// exact = false (prefill) with T >= 64 and no checkpoints (gdn_chunked_ok: dk 32 / 64 / 128, dv % 16 == 0,
// 16-byte aligned inputs, the shared memory at hand) takes the chunked recurrence of gdn_chunked.cuh
// instead: not token by token, so its results depend on how the tokens are split over calls, within the
// same tolerance of the CPU op (tests up to 300 tokens).
//
// conv1d_causal_states / gated_delta_net_states: a spec step's commit of a chain prefix on every GDN layer at once,
// states only: one launch runs all layers' blocks (conv_states_kernel: the conv state is a copy of [state ; x]'s
// last K - 1 rows; gdn_layers_kernel: gdn_kernel's blocks of each layer, its code, so the states are gated_delta_net's
// bit for bit). Before, a commit ran each layer's conv and recurrence as launches of their own, one layer after
// another: 96 launches for the 27B's 48 layers (H200, a commit of 3 / 5 / 7 rows: 447-472 / 536-548 / 697-738 us ->
// 125 / 146-147 / 164-165 us of GPU time, BENCHMARKS.md, session of 2026-12-04 20:43 UTC).
//
// gdn_step: gdn_qkv, gdn_gates and the exact recurrence of a decode / verify step in one launch
// (gdn_step_kernel in gdn_kernel's blocks), bit-identical to those three ops (gdn_step_gated_matmul, matmul.cu,
// also norms and splits its output for the out projection in that launch).
#include <algorithm>
#include <cmath>

#include "../cpu/activations.h"
#include "../cpu/norm.h"
#include "../cpu/ssm.h"
#include "activations.cuh"
#include "conv.cuh"
#include "gdn_chunked.cuh"
#include "gdn_step.cuh"
#include "norm.cuh"
#include "op_util.cuh"
#include "ops.h"

namespace specd::gpu {

namespace {

// ------------------------------------------------------------------------------ conv1d_causal

using detail::conv::conv1d_kernel;
using detail::conv::conv1d_taps_kernel;
using detail::conv::conv_states_kernel;
using detail::conv::ConvStates;
using detail::conv::kMaxConvLayers;
using detail::conv::kConvThreads;
using detail::conv::kConvTokenChunksUpTo;
using detail::conv::kConvTokens;

// ---------------------------------------------------------------------------- gated_delta_net

using GdnParams = detail::gdn::Params;

using detail::gdn_step::gdn_block_rows;
using detail::gdn_step::gdn_kernel;
using detail::gdn_step::gdn_layers_kernel;
using detail::gdn_step::GdnLayers;
using detail::gdn_step::kMaxGdnLayers;
using detail::gdn_step::gdn_lanes;
using detail::gdn_step::gdn_register_kernel;
using detail::gdn_step::with_gdn_instance;
using detail::gdn_step::GdnStepParams;
using detail::gdn_step::gdn_step_kernel;
using detail::gdn_step::gdn_step_smem;
using detail::gdn_step::kGdnRows;
using detail::gdn_step::kMaxGdnThreads;

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

using detail::gdn::GdnChunkScratch;
using detail::gdn::gdn_chunk_prep_kernel;
using detail::gdn::gdn_chunk_state_kernel;
using detail::gdn::gdn_prep_smem;
using detail::gdn::gdn_state_smem;
using detail::gdn::kGdnChunk;
using detail::gdn::kGdnChunkRows;
using detail::gdn::kGdnChunkThreads;

// The chunked path for head dim DK (the caller checked gdn_chunked_ok): the two kernels, scratch from the pool.
template <int DK>
void launch_gdn_chunked(const GdnParams& P, cudaStream_t s, const char* op) {
  static const bool limits_set = [] {
    SPECD_GPU_CHECK(cudaFuncSetAttribute(gdn_chunk_prep_kernel<DK>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         detail::max_smem_optin()));
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
  X.P = X.W + int64_t(P.hv) * P.T * DK;  // every part 16-byte aligned: G (any length) last
  X.G = X.P + int64_t(P.hv) * chunks * kGdnChunk * kGdnChunk;
  X.chunks = chunks;
  detail::check_grid(int64_t(chunks) * P.hv, op);
  detail::launch_kernel<gdn_chunk_prep_kernel<DK>>("gdn_chunk_prep_kernel", unsigned(int64_t(chunks) * P.hv),
                                                   kGdnChunkThreads, gdn_prep_smem(DK, P.dv), s, P, X);
  const int64_t blocks = int64_t(P.hv) * (P.dv / kGdnChunkRows);
  detail::check_grid(blocks, op);
  detail::launch_kernel<gdn_chunk_state_kernel<DK>>("gdn_chunk_state_kernel", unsigned(blocks), kGdnChunkThreads,
                                                    gdn_state_smem(DK), s, P, X);
}

// Whether a call may take the chunked path: inexact, at least one chunk of tokens, no checkpoints (they
// need every token's state), dk 32 / 64 / 128, whole row blocks, 16-byte aligned q / k / v / states (the
// kernels stage them 16 bytes at a time), the shared memory the device has, and on CUDA compute capability
// 8+ (the state pass's tf32 MMA).
bool gdn_chunked_ok(bool exact, const GdnParams& P) {
  if (exact || P.ckpt || P.T < kGdnChunk || P.dv % kGdnChunkRows != 0 || P.dv > 4096) return false;
  if (!SPECD_HIP && detail::compute_major() < 8) return false;
  if (P.dk != 32 && P.dk != 64 && P.dk != 128) return false;
  for (const void* p : {static_cast<const void*>(P.q), static_cast<const void*>(P.k), static_cast<const void*>(P.v),
                        static_cast<const void*>(P.state), static_cast<const void*>(P.state_out)})
    if (!detail::aligned16(p)) return false;
  return int64_t(gdn_prep_smem(P.dk, P.dv)) <= detail::max_smem_optin() &&
         int64_t(gdn_state_smem(P.dk)) <= detail::max_smem_optin();
}

// gdn_kernel's blocks: rows state rows of L lanes each (gdn_block_rows), at most kMaxGdnThreads threads.
template <int E, int L>
void launch_gdn_step(const GdnStepParams& P) {
  static_assert(gdn_step_smem<E * L>(kMaxGdnThreads / L) <= 48 * 1024,
                "gdn_step_kernel: the default dynamic shared memory limit");
  const int rows = int(gdn_block_rows(P.dv));
  detail::launch_kernel<gdn_step_kernel<E, L>>("gdn_step_kernel", unsigned(int64_t(P.hv) * (P.dv / rows)),
                                              unsigned(rows * L), gdn_step_smem<E * L>(rows), detail::stream(), P);
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
  // In place: at least K - 1 tokens per chunk, so only the first chunk reads the state, which it overwrites after
  // (see the kernel). Out of place, a verify's few tokens (T <= kConvTokenChunksUpTo) take one token a chunk: a
  // thread computes its tokens one after the other, each with a double-precision silu, so in one chunk the 27B's
  // verify of 8 rows took 5.5 us a layer against 2.0 at 1 row (H200). At most 65535 chunks (grid y).
  const bool in_place = out_state.data == state.data;  // else no overlap (cpu::written_state)
  const int64_t chunk =
      !in_place && T <= kConvTokenChunksUpTo ? 1 : std::max({kConvTokens, K - 1, (T + 65534) / 65535});
  const int64_t chunks = std::max<int64_t>(1, (T + chunk - 1) / chunk);
  if (K == 4)  // the models' conv: the register-window kernel (bit-identical)
    detail::launch_kernel<conv1d_taps_kernel<4>>("conv1d_taps_kernel", dim3(unsigned(blocks), unsigned(chunks)),
                                                 kConvThreads, 0, detail::stream(), x.ptr<float>(), weight.ptr<float>(),
                                                 state.ptr<float>(), out_state.ptr<float>(), y.ptr<float>(), T, C, chunk,
                                                 apply_silu);
  else
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
  if (gdn_chunked_ok(exact, P)) {
    if (dk == 32) launch_gdn_chunked<32>(P, s, op);
    else if (dk == 64) launch_gdn_chunked<64>(P, s, op);
    else launch_gdn_chunked<128>(P, s, op);
    return out;
  }
  const int lanes = gdn_lanes(dk);
  const int64_t rows = gdn_block_rows(dv);  // state rows per block
  const int threads = int(rows) * lanes;
  const bool fast = gdn_register_kernel(dk, dv);
  const int64_t blocks = fast ? hv * (dv / rows) : hv;
  detail::check_grid(blocks, op);
  if (fast) {
    with_gdn_instance(dk, [&](auto e, auto l) {
      constexpr int E = decltype(e)::value, L = decltype(l)::value;
      detail::launch_kernel<gdn_kernel<E, L>>("gdn_kernel", unsigned(blocks), threads, 0, s, P);
    });
  } else {
    size_t shmem = size_t(2 * dk) * sizeof(float);
    SPECD_CHECK(shmem <= 48 * 1024, op, ": dk too large for the GPU op (", dk, ")");
    detail::launch_kernel<gdn_fallback_kernel>("gdn_fallback_kernel", unsigned(blocks), kFallbackThreads, shmem, s, P);
  }
  return out;
}

void conv1d_causal_states(const std::vector<Tensor>& xs, const std::vector<Tensor>& states) {
  const char* op = "conv1d_causal_states";
  const cpu::ConvDims d = cpu::check_conv1d_causal_states(xs, states, Device::GPU);
  if (d.T == 0 || d.C == 0 || d.km1 == 0) return;
  const int64_t per_layer = (d.C + kConvThreads - 1) / kConvThreads;
  detail::check_grid(per_layer * std::min<int64_t>(int64_t(states.size()), kMaxConvLayers), op);  // before any launch
  detail::EnqueueGuard guard;  // in place (nothing allocated): waits while another thread captures a graph
  for (size_t l0 = 0; l0 < states.size(); l0 += kMaxConvLayers) {
    const size_t n = std::min(states.size() - l0, size_t(kMaxConvLayers));
    ConvStates S{};
    for (size_t i = 0; i < n; ++i) S.x[i] = xs[l0 + i].ptr<float>(), S.state[i] = states[l0 + i].ptr<float>();
    S.T = d.T, S.C = d.C, S.km1 = d.km1, S.blocks_per_layer = per_layer;
    detail::launch_kernel<conv_states_kernel>("conv_states_kernel", unsigned(per_layer * int64_t(n)), kConvThreads, 0,
                                              detail::stream(), S);
  }
}

void gated_delta_net_states(const std::vector<Tensor>& q, const std::vector<Tensor>& k, const std::vector<Tensor>& v,
                            const std::vector<Tensor>& g, const std::vector<Tensor>& beta,
                            const std::vector<Tensor>& states, float scale) {
  const char* op = "gated_delta_net_states";
  const cpu::GdnDims d = cpu::check_gated_delta_net_states(q, k, v, g, beta, states, scale, Device::GPU);
  if (d.T == 0 || d.hv == 0 || d.dv == 0) return;
  if (!gdn_register_kernel(d.dk, d.dv)) {  // gated_delta_net's fallback kernel, a layer at a time
    detail::EnqueueGuard guard;  // all layers' work enqueued before another thread's capture may begin
    for (size_t i = 0; i < states.size(); ++i)
      gated_delta_net(q[i], k[i], v[i], g[i], beta[i], states[i], scale, std::nullopt, std::nullopt, true);
    return;
  }
  const int64_t rows = gdn_block_rows(d.dv), per_layer = d.hv * (d.dv / rows);
  const int threads = int(rows) * gdn_lanes(d.dk);
  detail::check_grid(per_layer * std::min<int64_t>(int64_t(states.size()), kMaxGdnLayers), op);  // before any launch
  detail::EnqueueGuard guard;  // in place (nothing allocated): waits while another thread captures a graph
  with_gdn_instance(d.dk, [&](auto e, auto l) {
    constexpr int E = decltype(e)::value, L = decltype(l)::value;
    for (size_t l0 = 0; l0 < states.size(); l0 += kMaxGdnLayers) {
      const size_t n = std::min(states.size() - l0, size_t(kMaxGdnLayers));
      GdnLayers Ls{};
      for (size_t i = 0; i < n; ++i) {
        const size_t j = l0 + i;
        Ls.q[i] = q[j].ptr<float>(), Ls.k[i] = k[j].ptr<float>(), Ls.v[i] = v[j].ptr<float>();
        Ls.g[i] = g[j].ptr<float>(), Ls.beta[i] = beta[j].ptr<float>(), Ls.state[i] = states[j].ptr<float>();
      }
      Ls.scale = scale, Ls.T = d.T, Ls.hk = int(d.hk), Ls.hv = int(d.hv), Ls.dk = int(d.dk), Ls.dv = int(d.dv);
      Ls.blocks_per_layer = per_layer;
      detail::launch_kernel<gdn_layers_kernel<E, L>>("gdn_layers_kernel", unsigned(per_layer * int64_t(n)), threads,
                                                    0, detail::stream(), Ls);
    }
  });
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> gdn_step(
    const Tensor& cv, const Tensor& a, const Tensor& b, const Tensor& dt, const Tensor& ssm_a, const Tensor& state,
    int64_t n_k_heads, int64_t head_k_dim, int64_t n_v_heads, int64_t head_v_dim, float eps, float scale,
    const std::optional<Tensor>& state_out) {
  const int64_t hk = n_k_heads, dk = head_k_dim, hv = n_v_heads, dv = head_v_dim;
  const Tensor& out_state = cpu::check_gdn_step_args(cv, a, b, dt, ssm_a, state, state_out, hk, dk, hv, dv, eps, scale,
                                                     Device::GPU);  // before anything runs
  const int64_t T = cv.dim(0);
  if (!gdn_register_kernel(dk, dv)) {  // the composition (any shape the ops take)
    auto [q, k, v] = gdn_qkv(cv, hk, dk, hv, dv, eps);
    auto [g, beta] = gdn_gates(a, b, dt, ssm_a);
    Tensor o = gated_delta_net(q, k, v, g, beta, state, scale, std::nullopt, state_out, true);
    return {o, q, k, v, g, beta};
  }
  const auto empty = [](std::vector<int64_t> shape) { return Tensor::empty(shape, DType::F32, Device::GPU); };
  Tensor q = empty({T, hk, dk}), k = empty({T, hk, dk}), v = empty({T, hv, dv}), o = empty({T, hv, dv});
  Tensor g = empty({T, hv}), beta = empty({T, hv});
  if (T == 0 && out_state.data == state.data) return {o, q, k, v, g, beta};
  // before anything runs: the launch's grid and int fields
  SPECD_CHECK(hv * (dv / gdn_block_rows(dv)) <= 0x7fffffff && dv <= 0x7fffffff,
              "gdn_step: at most 2^31 - 1 blocks and dv on the GPU");
  GdnStepParams P{cv.ptr<float>(), a.ptr<float>(), b.ptr<float>(), dt.ptr<float>(), ssm_a.ptr<float>(),
                  state.ptr<float>(), out_state.ptr<float>(), o.ptr<float>(), q.ptr<float>(), k.ptr<float>(),
                  v.ptr<float>(), g.ptr<float>(), beta.ptr<float>(), T, int(hk), int(hv), int(dv), eps, scale};
  with_gdn_instance(dk, [&](auto e, auto l) { launch_gdn_step<decltype(e)::value, decltype(l)::value>(P); });
  return {o, q, k, v, g, beta};
}

}  // namespace specd::gpu
