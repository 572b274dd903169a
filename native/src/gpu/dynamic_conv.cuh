// DFlash 2's grouped dynamic causal convolution on the GPU (grouped_dynamic_conv's kernel): included by
// dynamic_conv.cu and compiled for the host by the emulation harness tests/gpu/host_emu/dynamic_conv_main.cpp.
#pragma once

#ifndef SPECD_HOST_EMU
#include "common.cuh"
#endif

#include <cstdint>

#include "pdl.cuh"

namespace specd::gpu::detail::dynamic_conv {
namespace {  // internal linkage: only dynamic_conv.cu launches it

constexpr int kThreads = 256;

// One thread per output element i = t * H + c (the grid flattened over [L, H]: L is not bounded by the
// 65535 blocks of grid.y). The operations and their order are cpu::grouped_dynamic_conv's, the numpy
// reference's: coef = base + D, out = coef_0 * y_t, then out = out + coef_o * y_{t-o} for o = 1 .. min(taps - 1, t),
// with explicit round-to-nearest adds and multiplies so nvcc cannot fuse a product into the sum (an FMA
// would round once and differ from numpy). Indices fit in 32 bits: the op bounds every tensor to
// 2^31 - 1 elements. D's row t starts at dyn + t * pitch (the whole [L, S, taps, G] projection output is
// passed, offset to its side).
__global__ void __launch_bounds__(kThreads) grouped_dynamic_conv_kernel(const float* __restrict__ y,
                                                                       const float* __restrict__ dyn,
                                                                       const float* __restrict__ base,
                                                                       float* __restrict__ out, int L, int H,
                                                                       int taps, int G, int gs, int pitch) {
  pdl_enter();
  const int64_t i64 = int64_t(blockIdx.x) * kThreads + threadIdx.x;  // the last block's tail may pass 2^31
  if (i64 >= int64_t(L) * H) return;
  const int i = int(i64);
  const int t = i / H, c = i - t * H;
  const float* d = dyn + t * pitch + c / gs;
  float acc = __fmul_rn(__fadd_rn(base[c], d[0]), y[i]);
  const int last = taps - 1 < t ? taps - 1 : t;  // y[t - o] is zero padding for o > t: no term
  for (int o = 1; o <= last; ++o)
    acc = __fadd_rn(acc, __fmul_rn(__fadd_rn(base[o * H + c], d[o * G]), y[i - o * H]));
  out[i] = acc;
}

}  // namespace
}  // namespace specd::gpu::detail::dynamic_conv
