// Host stand-ins for the device intrinsics native/src/gpu/weight_formats.cuh uses, so its weight
// decoders can be compiled and checked on a CPU-only machine (test_gpu_decoders_host.py). Same
// semantics as CUDA's: __byte_perm in its default mode (selector bit 3 replicates the sign).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__
struct uint4 { uint32_t x, y, z, w; };
struct uint2 { uint32_t x, y; };
struct float4 { float x, y, z, w; };
inline float __int_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __uint_as_float(uint32_t u) { return __int_as_float(u); }
inline uint32_t __float_as_uint(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  uint64_t v = uint64_t(x) | (uint64_t(y) << 32);
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) {
    uint32_t sel = (s >> (4 * i)) & 0xf;
    uint32_t b = (v >> (8 * (sel & 7))) & 0xff;
    if (sel & 8) b = (b & 0x80) ? 0xff : 0;
    r |= b << (8 * i);
  }
  return r;
}
inline float specd_fp16_bits_to_float(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 31, m = h & 1023;
  float f;
  if (e == 0) f = std::ldexp(float(m), -24);
  else if (e == 31) f = m ? NAN : INFINITY;
  else f = std::ldexp(float(m | 1024), int(e) - 25);
  uint32_t u; std::memcpy(&u, &f, 4); u |= sign; std::memcpy(&f, &u, 4); return f;
}
