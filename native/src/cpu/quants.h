// Row codecs for the tensor formats specd reads, in ggml's exact block layouts
// (ggml/src/ggml-common.h, ggml-quants.c; the `gguf` Python package's quants.py is the test oracle).
#pragma once
#include <cstdint>

#include "specd/dtype.h"

namespace specd::cpu {

// IEEE half <-> float (round to nearest even), bfloat16 <-> float (round to nearest even, NaN kept).
float fp16_to_fp32(uint16_t h);
uint16_t fp32_to_fp16(float f);
inline float bf16_to_fp32(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
uint16_t fp32_to_bf16(float f);

// Decodes n elements (a multiple of the block size) of type t starting at src into dst.
void dequantize_row(DType t, const void* src, float* dst, int64_t n);
// Encodes n floats into type t; supported for F32, F16, BF16 and Q8_0 (the formats specd writes:
// KV cache and drafter quantization). Matches gguf.quants.quantize bit for bit.
void quantize_row(DType t, const float* src, void* dst, int64_t n);

}  // namespace specd::cpu
