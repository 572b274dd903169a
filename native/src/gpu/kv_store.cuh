// A head row stored in a KV cache's format on the GPU: the conversion of kv_write (attention.cu), shared
// with qk_norm_rope's fused cache write (rope.cu), so both store the same bytes. F32 copies, F16 rounds
// to nearest even, Q8_0 is ggml's quantize_row_q8_0_ref (d = amax / 127, q = round-half-away(x / d) with
// the unrounded reciprocal, one warp per 32-element block): bit-identical to cpu::quantize_row for finite
// inputs (NaN payloads may differ).
#pragma once
#include <cstdint>

#include "common.cuh"

namespace specd::gpu::detail {

// x (d floats) into the cache head row dst (dtype T) by `threads` threads of the block: all of
// threadIdx.x < threads call it (Q8_0: threads a multiple of SPECD_WARP, d a multiple of 32).
template <DType T>
__device__ __forceinline__ void store_kv_row(uint8_t* dst, const float* x, int d, int threads) {
  if constexpr (T == DType::F32) {
    for (int c = threadIdx.x; c < d; c += threads) reinterpret_cast<float*>(dst)[c] = x[c];
  } else if constexpr (T == DType::F16) {
    for (int c = threadIdx.x; c < d; c += threads)
      reinterpret_cast<uint16_t*>(dst)[c] = __half_as_ushort(__float2half_rn(x[c]));
  } else {
    static_assert(T == DType::Q8_0, "KV caches are F32, F16 or Q8_0");
    const int lane = threadIdx.x % SPECD_WARP, warp = threadIdx.x / SPECD_WARP;
    for (int b = warp; b < d / 32; b += threads / SPECD_WARP) {  // uniform per warp
      float v = x[b * 32 + lane];
      float amax = warp_max(fabsf(v));
      float dd = __fdiv_rn(amax, 127.0f);
      float id = dd != 0.0f ? __fdiv_rn(1.0f, dd) : 0.0f;
      uint8_t* blk = dst + b * 34;
      if (lane == 0) {
        *reinterpret_cast<uint16_t*>(blk) = __half_as_ushort(__float2half_rn(dd));
      }
      reinterpret_cast<int8_t*>(blk + 2)[lane] = int8_t(roundf(__fmul_rn(v, id)));
    }
  }
}

// The same for a cache dtype known at run time (the same for every thread of the block).
__device__ __forceinline__ void store_kv_row(DType t, uint8_t* dst, const float* x, int d, int threads) {
  switch (t) {
    case DType::F32: store_kv_row<DType::F32>(dst, x, d, threads); break;
    case DType::F16: store_kv_row<DType::F16>(dst, x, d, threads); break;
    default: store_kv_row<DType::Q8_0>(dst, x, d, threads); break;
  }
}

}  // namespace specd::gpu::detail
