#include "quants.h"

#include <cmath>
#include <cstring>

#include "specd/error.h"

namespace specd::cpu {

float fp16_to_fp32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (mant << 13);  // inf / nan
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    u = sign;
  } else {  // subnormal half: renormalise
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400) == 0);
    u = sign | (uint32_t(112 - e) << 23) | ((mant & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t fp32_to_fp16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint16_t sign = uint16_t((u >> 16) & 0x8000);
  uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u) return sign | (abs > 0x7f800000u ? 0x7e00 : 0x7c00);  // nan / inf
  if (abs >= 0x477ff000u) return sign | 0x7c00;  // rounds to >= 65520: overflow to inf
  if (abs < 0x38800000u) {                        // below the smallest normal half (2^-14)
    // Subnormal: value = abs * 2^24 in units of the smallest subnormal, rounded to nearest even.
    float a;
    std::memcpy(&a, &abs, 4);
    float scaled = a * 16777216.0f;  // exact (power of two)
    uint32_t q = static_cast<uint32_t>(std::nearbyint(scaled));
    return sign | uint16_t(q);
  }
  uint32_t mant = abs & 0x7fffff, exp = (abs >> 23) - 112;
  uint32_t h = (exp << 10) | (mant >> 13), rest = mant & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;  // round to nearest even (may carry into exp)
  return sign | uint16_t(h);
}

uint16_t fp32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet nan
  u += 0x7fff + ((u >> 16) & 1);
  return uint16_t(u >> 16);
}

namespace {

// Q8_0 (ggml block_q8_0): fp16 d, 32 x int8 q; value = d * q.
void dequantize_q8_0(const uint8_t* src, float* dst, int64_t n) {
  for (int64_t b = 0; b < n / 32; ++b, src += 34) {
    uint16_t dh;
    std::memcpy(&dh, src, 2);
    float d = fp16_to_fp32(dh);
    const int8_t* q = reinterpret_cast<const int8_t*>(src + 2);
    for (int i = 0; i < 32; ++i) dst[b * 32 + i] = d * float(q[i]);
  }
}

// As gguf.quants.Q8_0.quantize_blocks: d = amax / 127 (rounded to fp16 for storage only),
// q = round-half-away(x / d) computed with the unrounded reciprocal.
void quantize_q8_0(const float* src, uint8_t* dst, int64_t n) {
  for (int64_t b = 0; b < n / 32; ++b, dst += 34) {
    const float* x = src + b * 32;
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(x[i]));
    float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    uint16_t dh = fp32_to_fp16(d);
    std::memcpy(dst, &dh, 2);
    int8_t* q = reinterpret_cast<int8_t*>(dst + 2);
    for (int i = 0; i < 32; ++i) q[i] = static_cast<int8_t>(std::round(x[i] * id));
  }
}

}  // namespace

void dequantize_row(DType t, const void* src, float* dst, int64_t n) {
  const auto* s = static_cast<const uint8_t*>(src);
  row_size(t, n);  // validates the block multiple
  switch (t) {
    case DType::F32:
      std::memcpy(dst, s, size_t(n) * 4);
      return;
    case DType::F16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, s + 2 * i, 2);
        dst[i] = fp16_to_fp32(h);
      }
      return;
    case DType::BF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, s + 2 * i, 2);
        dst[i] = bf16_to_fp32(h);
      }
      return;
    case DType::Q8_0:
      dequantize_q8_0(s, dst, n);
      return;
    default:
      fail("dequantize: ", dtype_info(t).name, " is not a weight format");
  }
}

void quantize_row(DType t, const float* src, void* dst, int64_t n) {
  auto* d = static_cast<uint8_t*>(dst);
  row_size(t, n);
  switch (t) {
    case DType::F32:
      std::memcpy(d, src, size_t(n) * 4);
      return;
    case DType::F16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h = fp32_to_fp16(src[i]);
        std::memcpy(d + 2 * i, &h, 2);
      }
      return;
    case DType::BF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h = fp32_to_bf16(src[i]);
        std::memcpy(d + 2 * i, &h, 2);
      }
      return;
    case DType::Q8_0:
      quantize_q8_0(src, d, n);
      return;
    default:
      fail("quantize: specd writes F32, F16, BF16 and Q8_0, not ", dtype_info(t).name);
  }
}

}  // namespace specd::cpu
