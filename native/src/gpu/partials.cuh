// Split-K partials: p [S][count] F32 with y = p[0] + p[1] + ... + p[S - 1], added in that order, each add
// rounded once in F32. The order the GEMV's sum kernel (matmul_mma.cuh: sum_splits_kernel), the ops that
// read partials instead of y (norm_split.cuh, matmul.cu: SwigluValue) and the CPU's sum_partials
// (cpu/activations.cpp, its own loop in this order) share, so each of them computes y bit for bit. A header
// the emulation harnesses also compile.
#pragma once

#include <cstdint>

#include "portability.h"

namespace specd::gpu::detail {

// Parts loaded together before their adds: a loop that loads a part and adds it waits for each load in turn
// (in-order issue), S round trips to L2; loading kFoldBatch parts first waits once per batch.
constexpr int kFoldBatch = 8;

// One add of the fold (float4: lane by lane).
__host__ __device__ __forceinline__ void add_to(float& v, float a) { v += a; }
__host__ __device__ __forceinline__ void add_to(float4& v, float4 a) { v.x += a.x, v.y += a.y, v.z += a.z, v.w += a.w; }

// y[j] of partials p with `splits` parts of `count` floats each (T: float, or float4 lane by lane).
template <class T>
__host__ __device__ __forceinline__ T fold_parts(const T* __restrict__ p, int splits, int64_t count, int64_t j) {
  T v = p[j];
  for (int k = 1; k < splits; k += kFoldBatch) {
    T a[kFoldBatch];
#pragma unroll
    for (int i = 0; i < kFoldBatch; ++i)
      if (k + i < splits) a[i] = p[int64_t(k + i) * count + j];
#pragma unroll
    for (int i = 0; i < kFoldBatch; ++i)
      if (k + i < splits) add_to(v, a[i]);  // plain adds in part order: nothing to contract
  }
  return v;
}

// y[j] of partials p with `splits` parts of `count` floats each.
__host__ __device__ __forceinline__ float fold_partials(const float* __restrict__ p, int splits, int64_t count,
                                                        int64_t j) {
  return fold_parts(p, splits, count, j);
}

// The same for 4 consecutive floats (j4: a float4 index; count a multiple of 4, p 16-byte aligned), each
// lane of the float4 folded on its own: fold_partials' adds, 4 at a time.
__host__ __device__ __forceinline__ float4 fold_partials4(const float* __restrict__ p, int splits, int64_t count,
                                                          int64_t j4) {
  return fold_parts(reinterpret_cast<const float4*>(p), splits, count / 4, j4);
}

}  // namespace specd::gpu::detail
