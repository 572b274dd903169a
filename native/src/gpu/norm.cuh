// The RMSNorm / L2-norm row arithmetic on the GPU, shared by the norm kernels (norm.cu) and the
// norm fused with the GEMV's x split (norm_split.cuh): one definition, so the fused op computes every
// value with the same operations in the same order as the standalone norm (bit-identical).
//
// One thread block per row (norm_row); the block size depends only on the row length d (threads_for), so a
// row's result does not depend on how many rows share the call (batch invariance). warp_norm_row
// replays that block's sums with one warp (gdn_step_kernel in gdn_step.cuh and gated_norm_split_kernel in
// norm_split.cuh normalise rows in a block of their own). The sum of
// squares is accumulated in double (per thread, then a fixed-order warp-shuffle and cross-warp
// reduction), and the scale is computed exactly as the CPU op does (cpu/norm.cpp).
#pragma once
#include <cmath>
#include <type_traits>

#include "activations.cuh"
#ifndef SPECD_HOST_EMU
#include "common.cuh"
#else
#include "warp_reduce.cuh"  // the emulation harnesses (tests/gpu/host_emu) have no runtime header
#endif

namespace specd::gpu::detail::norm {

constexpr int kMaxThreads = 1024;

// Sum of `v` over the block (blockDim.x a multiple of SPECD_WARP, <= 1024); every thread gets the
// total. Fixed reduction order. Ends with a block barrier, so global stores made by any thread of
// the block before the call are visible to all of them after it.
__device__ __forceinline__ double block_sum(double v) {
  __shared__ double partial[kMaxThreads / SPECD_WARP];
  __shared__ double total;
  int lane = threadIdx.x % SPECD_WARP, warp = threadIdx.x / SPECD_WARP;
  int nwarps = blockDim.x / SPECD_WARP;
  v = warp_sum(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    double s = lane < nwarps ? partial[lane] : 0.0;
    s = warp_sum(s);
    if (lane == 0) total = s;
  }
  __syncthreads();
  return total;
}

// Element access either as float4 (VEC) or float; index i counts vectors (VEC) or floats.
template <bool VEC>
struct Row {
  using T = typename std::conditional<VEC, float4, float>::type;
  static constexpr int kWidth = VEC ? 4 : 1;
};

__device__ __forceinline__ float4 add(float4 a, float4 b) { return {a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w}; }
__device__ __forceinline__ float add(float a, float b) { return a + b; }
__device__ __forceinline__ double sq(float4 a) {
  return double(a.x) * double(a.x) + double(a.y) * double(a.y) + double(a.z) * double(a.z) +
         double(a.w) * double(a.w);
}
__device__ __forceinline__ double sq(float a) { return double(a) * double(a); }
__device__ __forceinline__ float4 scale_mul(float4 a, float s, float4 w) {
  return {a.x * s * w.x, a.y * s * w.y, a.z * s * w.z, a.w * s * w.w};
}
__device__ __forceinline__ float scale_mul(float a, float s, float w) { return a * s * w; }
__device__ __forceinline__ float4 scale_only(float4 a, float s) { return {a.x * s, a.y * s, a.z * s, a.w * s}; }
__device__ __forceinline__ float scale_only(float a, float s) { return a * s; }
// y * silu(z), one F32 rounding per factor as the silu and mul ops.
__device__ __forceinline__ float gate(float y, float z) { return apply<Op::Mul>(y, apply<Op::Silu>(z, 0.0f)); }
__device__ __forceinline__ float4 gate(float4 y, float4 z) {
  return {gate(y.x, z.x), gate(y.y, z.y), gate(y.z, z.z), gate(y.w, z.w)};
}

// Item i of the first pass from its loaded x and residual r: x + r stored to h when RESID; the item is also
// stored to `copy` when given.
template <bool RESID, class T>
__device__ __forceinline__ T row_item(T x, T r, T* hr, T* copy, int64_t i) {
  if constexpr (RESID) {
    x = add(x, r);
    hr[i] = x;
  }
  if (copy) copy[i] = x;
  return x;
}

// First pass over a row of n items (vectors or floats): this thread's part of the sum of squares of
// x (+ residual, stored to h when RESID); the items summed are also stored to `copy` when given
// (norm_split_kernel's shared-memory row). Items i, i + blockDim.x, ... summed in that order, two at a
// time with both items' loads issued first: written one at a time, the h stores kept the compiler from
// hoisting the next item's loads, so a row of two items per thread (the 27B's 5120: 640 threads) waited
// for two L2 round trips in turn (sm_90 SASS).
template <bool RESID, class T>
__device__ __forceinline__ double row_squares(const T* xr, const T* rr, T* hr, int64_t n, T* copy = nullptr) {
  const auto res = [rr](int64_t i) {
    if constexpr (RESID) return rr[i];
    else return T{};
  };
  double ss = 0.0;
  const int64_t step = blockDim.x;
  int64_t i = threadIdx.x;
  for (; i + step < n; i += 2 * step) {
    const T x0 = xr[i], x1 = xr[i + step], r0 = res(i), r1 = res(i + step);
    ss += sq(row_item<RESID>(x0, r0, hr, copy, i));
    ss += sq(row_item<RESID>(x1, r1, hr, copy, i + step));
  }
  if (i < n) ss += sq(row_item<RESID>(xr[i], res(i), hr, copy, i));
  return ss;
}

// The multiplier of a row from its sum of squares (as cpu/norm.cpp: in double, rounded once).
__device__ __forceinline__ float rms_scale(double ss, int64_t d, float eps) {
  return float(1.0 / sqrt(ss / double(d) + double(eps)));
}
__device__ __forceinline__ float l2_scale(double ss, float eps) { return float(1.0 / sqrt(ss + double(eps))); }

// An output value of the second pass: v * scale (* w), then (GATE) * silu(z).
template <bool GATE, class T>
__device__ __forceinline__ T normed(T v, float scale, const T* w, T z) {
  T out = w ? scale_mul(v, scale, *w) : scale_only(v, scale);
  if constexpr (GATE) out = gate(out, z);
  return out;
}

// Mode: RMS (mean of squares, optional weight, optional residual) or L2 (sum of squares).
enum class Mode { RMS, L2 };

// One row of d elements, normalised by the whole block (blockDim.x = threads_for(VEC ? d / 4 : d):
// the order of the sums depends on it). x, residual, h, z, y: the row's elements (16-byte aligned
// when VEC); w: [d] or null. h is written only with a residual, z read only when GATE (then y =
// norm * silu(z)). The second pass re-reads the row this thread wrote or read in the first pass
// (same thread, so the h stores are visible; the row is usually still in L1/L2).
template <Mode M, bool VEC, bool RESID, bool GATE>
__device__ __forceinline__ void norm_row(const float* __restrict__ x, const float* __restrict__ residual,
                                         const float* __restrict__ w, float* h, const float* __restrict__ z,
                                         float* __restrict__ y, int64_t d, float eps) {
  using T = typename Row<VEC>::T;
  const int64_t n = d / Row<VEC>::kWidth;  // vectors (or floats) per row
  const T* xr = reinterpret_cast<const T*>(x);
  T* hr = reinterpret_cast<T*>(h);
  const T* zr = reinterpret_cast<const T*>(z);
  T* yr = reinterpret_cast<T*>(y);
  const double ss = block_sum(row_squares<RESID>(xr, reinterpret_cast<const T*>(residual), hr, n));
  const float scale = M == Mode::RMS ? rms_scale(ss, d, eps) : l2_scale(ss, eps);
  const T* src = RESID ? const_cast<const T*>(hr) : xr;
  const T* wr = reinterpret_cast<const T*>(w);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    yr[i] = normed<GATE>(src[i], scale, wr ? wr + i : nullptr, GATE ? zr[i] : T{});
}

// The arithmetic of norm_row over a row of n <= 1024 items (float4 when VEC, else floats) by
// one warp instead of a block of threads_for(n) threads: such a block gives thread i item i alone, its
// warp w sums items 32 w .. 32 w + 31 (warp_sum) and warp 0 then sums the warps' sums (block_sum);
// here lane l plays thread 32 w + l of each warp w in turn, then warp 0. Same sums in the same order,
// so the same scale and outputs: bit-identical to norm_kernel / gdn_qkv_kernel without RESID.
// x, w, z, y as norm_row (16-byte aligned when VEC; y may be shared memory).
template <Mode M, bool VEC, bool GATE>
__device__ __forceinline__ void warp_norm_row(const float* x, const float* __restrict__ w, const float* __restrict__ z,
                                              float* y, int64_t d, float eps, int lane) {
  using T = typename Row<VEC>::T;
  const int n = int(d / Row<VEC>::kWidth), warps = (n + SPECD_WARP - 1) / SPECD_WARP;
  const T* xr = reinterpret_cast<const T*>(x);
  double mine = 0.0;  // block_sum's partial[lane]: the sum of the block's warp `lane`
  for (int wi = 0; wi < warps; ++wi) {
    const int i = wi * SPECD_WARP + lane;
    double v = 0.0;
    if (i < n) v += sq(xr[i]);  // row_squares of a thread with one item
    v = warp_sum(v);
    if (lane == wi) mine = v;
  }
  const double ss = warp_sum(lane < warps ? mine : 0.0);
  const float scale = M == Mode::RMS ? rms_scale(ss, d, eps) : l2_scale(ss, eps);
  const T* wr = reinterpret_cast<const T*>(w);
  const T* zr = reinterpret_cast<const T*>(z);
  T* yr = reinterpret_cast<T*>(y);
  for (int i = lane; i < n; i += SPECD_WARP) yr[i] = normed<GATE>(xr[i], scale, wr ? wr + i : nullptr, GATE ? zr[i] : T{});
}

// Threads per row: enough that each thread handles about ceil(items / 1024) items, rounded up to
// a whole logical warp. A function of d only (batch invariance).
inline int threads_for(int64_t items) {
  int64_t per = (items + kMaxThreads - 1) / kMaxThreads;
  if (per < 1) per = 1;
  int64_t t = (items + per - 1) / per;
  t = (t + SPECD_WARP - 1) / SPECD_WARP * SPECD_WARP;
  return int(t < SPECD_WARP ? SPECD_WARP : t);
}

}  // namespace specd::gpu::detail::norm
