// Row codecs for the tensor formats specd reads, in ggml's exact block layouts
// (ggml/src/ggml-common.h, ggml-quants.c; the `gguf` Python package's quants.py is the test oracle).
//
// Block layouts (qwen35-target.md §10.1; every fp16 field little-endian, every block covers 256
// consecutive elements of a row unless stated):
//   Q8_0   (32 elements, 34 bytes):  fp16 d | int8 q[32]                       x = d*q
//   Q4_K   (144 bytes): fp16 d | fp16 dmin | 12 bytes packed 6-bit (scale, min) for 8 sub-blocks
//          of 32 | 128 bytes of nibbles                                         x = (d*sc)*q - dmin*m
//   Q5_K   (176 bytes): as Q4_K, with 32 bytes of fifth bits between the scales and the nibbles
//   Q6_K   (210 bytes): 128 bytes low nibbles | 64 bytes high 2-bit pairs | int8 sc[16] (one per 16
//          elements) | fp16 d (last two bytes)                                  x = (d*sc)*(q-32)
//   IQ4_XS (136 bytes): fp16 d | uint16 high scale bits | 4 bytes low scale nibbles | 128 bytes of
//          4-bit indices into the fixed table kIQ4NLValues                       x = (d*(s-32))*table[i]
// Decoding performs the same float32 operations in the same order as gguf.quants (and ggml's
// reference dequantize_row_*), with floating-point contraction disabled in quants.cpp, so the
// result is bit-identical to gguf.quants.dequantize.
#pragma once
#include <cstdint>

#include "specd/dtype.h"
#include "specd/tensor.h"

namespace specd::cpu {

// IEEE half <-> float (round to nearest even), bfloat16 <-> float (round to nearest even, NaN kept).
// fp32_to_fp16 matches numpy's float32 -> float16 cast bit for bit, NaN payloads included.
float fp16_to_fp32(uint16_t h);
uint16_t fp32_to_fp16(float f);
inline float bf16_to_fp32(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
uint16_t fp32_to_bf16(float f);

// The 16 non-linear IQ4_NL / IQ4_XS code values (ggml-common.h kvalues_iq4nl).
extern const int8_t kIQ4NLValues[16];

// Decodes n elements (a multiple of the block size) of type t starting at src into dst.
// Supported: F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS; throws std::invalid_argument otherwise.
void dequantize_row(DType t, const void* src, float* dst, int64_t n);
// Encodes n floats into type t; supported for F32, F16, BF16 and Q8_0 (the formats specd writes:
// KV cache and drafter quantization). Matches gguf.quants.quantize bit for bit (F16/BF16 for every input, NaN
// included; Q8_0 for finite input).
void quantize_row(DType t, const float* src, void* dst, int64_t n);

// Throws std::invalid_argument unless t is a format weights are stored in (not I32).
void check_weight_dtype(const Tensor& t, const char* op, const char* arg);

// dequantize(w): F32 tensor of w's shape (w any weight dtype, contiguous rows).
Tensor dequantize(const Tensor& w);
// quantize(x, dtype): x F32 [..., n] (contiguous) encoded as F32, F16, BF16 or Q8_0 (n a multiple
// of the block size), same logical shape.
Tensor quantize(const Tensor& x, DType dtype);

}  // namespace specd::cpu
