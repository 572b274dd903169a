// Reductions over the 32 lanes of a logical warp: a fixed xor butterfly, so every lane gets the result and
// all lanes hold bit-identical values. Included by common.cuh, and by the kernel headers the emulation
// harnesses compile for the host (tests/gpu/host_emu), which do not include common.cuh.
#pragma once

#include "portability.h"  // SPECD_WARP, SPECD_SHFL_XOR (host_emu's stand-in in the emulation harnesses)

namespace specd::gpu::detail {

template <class T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int m = SPECD_WARP / 2; m > 0; m >>= 1) v += SPECD_SHFL_XOR(v, m);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int m = SPECD_WARP / 2; m > 0; m >>= 1) v = fmaxf(v, SPECD_SHFL_XOR(v, m));
  return v;
}
__device__ __forceinline__ int warp_max(int v) {
#pragma unroll
  for (int m = SPECD_WARP / 2; m > 0; m >>= 1) v = max(v, SPECD_SHFL_XOR(v, m));
  return v;
}
__device__ __forceinline__ int warp_min(int v) {
#pragma unroll
  for (int m = SPECD_WARP / 2; m > 0; m >>= 1) v = min(v, SPECD_SHFL_XOR(v, m));
  return v;
}

}  // namespace specd::gpu::detail
