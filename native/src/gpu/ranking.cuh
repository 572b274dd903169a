// The ranking order shared by argmax and top-k on the GPU (numpy.argmax semantics): NaN ranks above
// every number (the first NaN wins), larger values first, ties broken by the lower index, -0.0 ==
// +0.0. Same order as cpu::argmax / cpu::topk (cpu/sampling.cpp).
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

}  // namespace specd::gpu::detail
