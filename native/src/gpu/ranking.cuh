// The ranking order shared by argmax and top-k on the GPU (numpy.argmax semantics): NaN ranks above
// every number (the first NaN wins), larger values first, ties broken by the lower index, -0.0 ==
// +0.0. Same order as cpu::argmax / cpu::topk (cpu/sampling.cpp). Also compiled for the host by the
// emulation harness of top-k (tests/gpu/host_emu/topk_main.cpp).
#pragma once
#include <cmath>
#include <cstdint>

#include "portability.h"

namespace specd::gpu::detail {

struct Cand {
  float v;
  int32_t i;
};

// True when (va, ia) ranks before (vb, ib).
__device__ __forceinline__ bool better(float va, int32_t ia, float vb, int32_t ib) {
  bool na = isnan(va), nb = isnan(vb);
  if (na || nb) return na && (!nb || ia < ib);
  return va > vb || (va == vb && ia < ib);
}

// The same order as one unsigned 64-bit key, larger = ranks first: the high word orders the values
// (NaN -> 0xffffffff above +inf's 0xff800000; -0.0 and +0.0 -> 0x80000000; otherwise the usual
// sign-flip map of IEEE bits, monotone in the value), the low word is ~i (lower index -> larger). So
// rank_key(va, ia) > rank_key(vb, ib) exactly when better(va, ia, vb, ib), for indices in
// [0, INT32_MAX]; keys are distinct for distinct indices, and never 0 (the smallest value word is
// -inf's 0x007fffff), so 0 can stand for "no entry".
__device__ __forceinline__ uint64_t rank_key(float v, int32_t i) {
  uint32_t u = __float_as_uint(v);
  u = isnan(v) ? 0xffffffffu : v == 0.0f ? 0x80000000u : (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (uint64_t(u) << 32) | uint64_t(~uint32_t(i));
}
// The index of a rank_key.
__device__ __forceinline__ int32_t key_index(uint64_t key) { return int32_t(~uint32_t(key)); }

}  // namespace specd::gpu::detail
