// The Gated DeltaNet's depthwise causal conv on the GPU (conv1d_causal's kernels, and conv1d_causal_states': the
// state update alone, every layer of a commit at once): included by ssm.cu and compiled for the host by the
// emulation harness tests/gpu/host_emu/conv_main.cpp.
#pragma once

#ifndef SPECD_HOST_EMU
#include "common.cuh"
#endif

#include <cstdint>

#include "activations.cuh"
#include "pdl.cuh"

namespace specd::gpu::detail::conv {
namespace {  // internal linkage: conv1d_kernel is not a template, and only ssm.cu launches these

constexpr int kConvThreads = 128;
// tokens per block (grid y); a prefill chunk of 2048 tokens: 128 blocks per channel
constexpr int64_t kConvTokens = 16;
// out of place, up to this many tokens (a verify's widths) run a token a chunk (ssm.cu, conv1d_causal)
constexpr int64_t kConvTokenChunksUpTo = 16;

// Channel c's new state, rows 0 .. K - 2 of state_out: rows T .. T + K - 2 of X = [state ; x] (a copy). Ascending
// rows read state row T + r before it is overwritten, so state_out may be state (in place).
__device__ __forceinline__ void shift_state(const float* x, const float* state, float* state_out, int64_t T,
                                            int64_t C, int64_t km1, int64_t c) {
  for (int64_t r = 0; r < km1; ++r) {
    const int64_t src = T + r;
    state_out[r * C + c] = src < km1 ? state[src * C + c] : x[(src - km1) * C + c];
  }
}

// Block (bx, by): channels bx * kConvThreads + threadIdx.x, tokens [by * chunk, + chunk). Every output
// is computed alone, so splitting the tokens over blocks changes no bits. The first chunk's threads write their
// channel's new state after their outputs. In place (state_out == state) the host asks chunk >= K - 1, so only the
// first chunk reads state rows and no other block touches the state; out of place any chunk may read them.
// state_out may be state (in place): no __restrict__ on either.
__global__ void __launch_bounds__(kConvThreads) conv1d_kernel(const float* __restrict__ x, const float* __restrict__ w,
                                                              const float* state, float* state_out,
                                                              float* __restrict__ y, int64_t T, int64_t C, int64_t K,
                                                              int64_t chunk, bool silu_out) {
  pdl_enter();
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
    y[t * C + c] = silu_out ? apply<Op::Silu>(acc, 0.0f) : acc;  // the silu op's code
  }
  if (blockIdx.y == 0) shift_state(x, state, state_out, T, C, km1, c);
}

// The same for a compile-time K (the models' 4 taps): the channel's K weights stay in registers and the
// K inputs of a token slide through a register window, so each input is loaded once instead of K times
// and each weight once per block instead of once per token. Same products and sums in the same order
// (j ascending, explicit mul / add): bit-identical to conv1d_kernel.
template <int K>
__global__ void __launch_bounds__(kConvThreads) conv1d_taps_kernel(const float* __restrict__ x,
                                                                   const float* __restrict__ w, const float* state,
                                                                   float* state_out, float* __restrict__ y, int64_t T,
                                                                   int64_t C, int64_t chunk, bool silu_out) {
  pdl_enter();
  const int64_t c = int64_t(blockIdx.x) * kConvThreads + threadIdx.x;
  if (c >= C) return;
  constexpr int64_t km1 = K - 1;
  const int64_t t0 = int64_t(blockIdx.y) * chunk, t1 = t0 + chunk < T ? t0 + chunk : T;
  const auto X = [&](int64_t r) { return r < km1 ? state[r * C + c] : x[(r - km1) * C + c]; };  // rows of [state ; x]
  float wk[K], win[K];
#pragma unroll
  for (int j = 0; j < K; ++j) wk[j] = w[j * C + c];
#pragma unroll
  for (int j = 0; j + 1 < K; ++j) win[j] = t0 < t1 ? X(t0 + j) : 0.0f;
#pragma unroll 4
  for (int64_t t = t0; t < t1; ++t) {
    win[K - 1] = x[t * C + c];  // X(t + K - 1): always an input row
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < K; ++j) acc = __fadd_rn(acc, __fmul_rn(wk[j], win[j]));
    y[t * C + c] = silu_out ? apply<Op::Silu>(acc, 0.0f) : acc;  // the silu op's code
#pragma unroll
    for (int j = 0; j + 1 < K; ++j) win[j] = win[j + 1];
  }
  if (blockIdx.y == 0) shift_state(x, state, state_out, T, C, km1, c);
}

// conv1d_causal_states' launch (ssm.cu): the new conv states of up to kMaxConvLayers layers of the same shape, each
// the last K - 1 rows of [state ; x] (conv1d_causal's state update, shift_state, without its outputs): a spec step's
// commit of a chain prefix, one launch for all GDN layers. Block b: layer b / blocks_per_layer, channels
// (b % blocks_per_layer) * kConvThreads + threadIdx.x, in place. The pointers in the kernel parameters.
constexpr int kMaxConvLayers = 64;
struct ConvStates {
  const float* x[kMaxConvLayers];  // [T, C]
  float* state[kMaxConvLayers];    // [K - 1, C]
  int64_t T, C, km1, blocks_per_layer;
};
static_assert(sizeof(ConvStates) <= 4096, "ConvStates: kernel parameters within 4 KiB (HIP's limit)");

__global__ void __launch_bounds__(kConvThreads) conv_states_kernel(const ConvStates S) {
  pdl_enter();
  const int64_t layer = int64_t(blockIdx.x) / S.blocks_per_layer;
  const int64_t c = (int64_t(blockIdx.x) % S.blocks_per_layer) * kConvThreads + threadIdx.x;
  if (c >= S.C) return;
  shift_state(S.x[layer], S.state[layer], S.state[layer], S.T, S.C, S.km1, c);
}

}  // namespace
}  // namespace specd::gpu::detail::conv
