// Row codecs (see quants.h for the block layouts).
//
// Bit-exactness: gguf.quants (numpy, float32) rounds after every multiply and subtract, and the
// decoders below perform the same operations in the same order. For the formats here every
// product that feeds a subtraction is exact in float32 (Q4_K/Q5_K: an 11-bit fp16 significand
// times a 6-bit scale times a 5-bit code), so a fused multiply-add would give the same bits; the
// library-wide -ffp-contract=off (native/CMakeLists.txt) keeps that true by construction.

#include "quants.h"

#include <cmath>
#include <cstring>

#include "specd/error.h"
#include "specd/parallel.h"

namespace specd::cpu {

const int8_t kIQ4NLValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

namespace {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// Exact half -> float for every bit pattern (NaN payloads kept, as numpy does), written with
// masks instead of branches so that row loops vectorise.
inline float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t(h) & 0x8000u) << 16;
  uint32_t em = uint32_t(h) & 0x7fffu;                        // exponent and mantissa
  uint32_t special = 0u - uint32_t(em >= 0x7c00u);            // inf / nan: exponent 31 -> 255
  uint32_t normal = ((em << 13) + (112u << 23) + (special & (112u << 23)));
  uint32_t sub = float_bits(float(int32_t(em)) * 0x1p-24f);   // subnormal or zero: em * 2^-24, exact
  uint32_t is_normal = 0u - uint32_t(em >= 0x0400u);
  return bits_float(sign | (normal & is_normal) | (sub & ~is_normal));
}

inline float load_half(const uint8_t* p) { return half_to_float(load_u16(p)); }

// ---- Q8_0 (ggml block_q8_0): fp16 d, 32 x int8 q; value = d * q. ----

void dequantize_q8_0(const uint8_t* src, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, src += 34, y += 32) {
    float d = load_half(src);
    const int8_t* q = reinterpret_cast<const int8_t*>(src + 2);
    for (int l = 0; l < 32; ++l) y[l] = float(q[l]) * d;
  }
}

// As gguf.quants.Q8_0.quantize_blocks (= ggml quantize_row_q8_0_ref): d = amax / 127 (rounded to
// fp16 for storage only), q = round-half-away(x * (1/d)) with the unrounded reciprocal.
void quantize_q8_0(const float* src, uint8_t* dst, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, dst += 34, src += 32) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(src[i]));
    float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    uint16_t dh = fp32_to_fp16(d);
    std::memcpy(dst, &dh, 2);
    int8_t* q = reinterpret_cast<int8_t*>(dst + 2);
    for (int i = 0; i < 32; ++i) q[i] = static_cast<int8_t>(std::round(src[i] * id));
  }
}

// ---- K-quants (256 elements per block) ----

// The 12 packed bytes of Q4_K/Q5_K hold eight 6-bit scales and eight 6-bit mins (ggml
// get_scale_min_k4): sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins);
// sub-blocks 4-7 take their low 4 bits from the nibbles of bytes 8-11 and their top 2 bits from
// the top bits of bytes 0-3 (scales) and 4-7 (mins).
void unpack_scale_min_k4(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = uint8_t((s[j + 8] & 0x0f) | ((s[j] >> 2) & 0x30));
    mn[j + 4] = uint8_t((s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30));
  }
}

// Q4_K: sub-block pair (2c, 2c+1) uses the low / high nibbles of qs[32c .. 32c+31].
void dequantize_q4_k(const uint8_t* src, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, src += 144) {
    float d = load_half(src), dmin = load_half(src + 2);
    uint8_t sc[8], mn[8];
    unpack_scale_min_k4(src + 4, sc, mn);
    const uint8_t* qs = src + 16;
    for (int c = 0; c < 4; ++c, qs += 32, y += 64) {
      float d1 = d * float(sc[2 * c]), m1 = dmin * float(mn[2 * c]);
      float d2 = d * float(sc[2 * c + 1]), m2 = dmin * float(mn[2 * c + 1]);
      for (int l = 0; l < 32; ++l) y[l] = d1 * float(qs[l] & 0x0f) - m1;
      for (int l = 0; l < 32; ++l) y[32 + l] = d2 * float(qs[l] >> 4) - m2;
    }
  }
}

// Q5_K: as Q4_K; the fifth bit of element l of sub-block j is bit j of qh[l].
void dequantize_q5_k(const uint8_t* src, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, src += 176) {
    float d = load_half(src), dmin = load_half(src + 2);
    uint8_t sc[8], mn[8];
    unpack_scale_min_k4(src + 4, sc, mn);
    const uint8_t* qh = src + 16;
    const uint8_t* qs = src + 48;
    for (int c = 0; c < 4; ++c, qs += 32, y += 64) {
      int lo = 2 * c, hi = 2 * c + 1;
      float d1 = d * float(sc[lo]), m1 = dmin * float(mn[lo]);
      float d2 = d * float(sc[hi]), m2 = dmin * float(mn[hi]);
      for (int l = 0; l < 32; ++l) y[l] = d1 * float((qs[l] & 0x0f) | (((qh[l] >> lo) & 1) << 4)) - m1;
      for (int l = 0; l < 32; ++l) y[32 + l] = d2 * float((qs[l] >> 4) | (((qh[l] >> hi) & 1) << 4)) - m2;
    }
  }
}

// Q6_K: each half (128 elements) uses 64 bytes of ql and 32 of qh. Element 32*g + l of the half
// (g = 0..3) takes nibble g/2 of ql[32*(g%2) + l] and bits 2g..2g+1 of qh[l]; value
// (d * sc[e/16]) * (q - 32) for element e of the block.
void dequantize_q6_k(const uint8_t* src, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, src += 210) {
    const uint8_t* ql = src;
    const uint8_t* qh = src + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(src + 192);
    float d = load_half(src + 208);
    for (int half = 0; half < 2; ++half, ql += 64, qh += 32, sc += 8) {
      for (int g = 0; g < 4; ++g, y += 32) {
        const uint8_t* q = ql + 32 * (g % 2);
        int nib = 4 * (g / 2), hs = 2 * g;
        float s0 = d * float(sc[2 * g]), s1 = d * float(sc[2 * g + 1]);
        for (int l = 0; l < 32; ++l) {
          int v = ((q[l] >> nib) & 0x0f) | (((qh[l] >> hs) & 3) << 4);
          y[l] = (l < 16 ? s0 : s1) * float(v - 32);
        }
      }
    }
  }
}

// y[0..15] = dl * table[low nibbles of qs[0..15]], y[16..31] = dl * table[high nibbles]: the
// product dl * value that gguf forms per element, computed once per table entry.
#if defined(__GNUC__) && !defined(__clang__)
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint8_t v16b __attribute__((vector_size(16)));

inline void iq4_lookup(float dl, const uint8_t* qs, float* y) {
  v16f table;
  for (int k = 0; k < 16; ++k) table[k] = float(kIQ4NLValues[k]);
  table = dl * table;
  v16b q;
  std::memcpy(&q, qs, 16);
  v16f lo = __builtin_shuffle(table, __builtin_convertvector(q & 0x0f, v16i));
  v16f hi = __builtin_shuffle(table, __builtin_convertvector(q >> 4, v16i));
  std::memcpy(y, &lo, 64);
  std::memcpy(y + 16, &hi, 64);
}
#else
inline void iq4_lookup(float dl, const uint8_t* qs, float* y) {
  float table[16];
  for (int k = 0; k < 16; ++k) table[k] = dl * float(kIQ4NLValues[k]);
  for (int l = 0; l < 16; ++l) y[l] = table[qs[l] & 0x0f];
  for (int l = 0; l < 16; ++l) y[16 + l] = table[qs[l] >> 4];
}
#endif

// IQ4_XS: sub-block j (32 elements) has the 6-bit scale s = low nibble j of bytes 4..7 (byte j/2,
// nibble j%2) | bits 2j..2j+1 of the uint16 at byte 2 << 4; its first 16 elements are the low
// nibbles of qs[16j .. 16j+15], the next 16 the high nibbles; value (d * (s - 32)) * table[idx].
void dequantize_iq4_xs(const uint8_t* src, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, src += 136) {
    float d = load_half(src);
    uint32_t sh = load_u16(src + 2);
    const uint8_t* sl = src + 4;
    const uint8_t* qs = src + 8;
    for (int j = 0; j < 8; ++j, qs += 16, y += 32) {
      int s = ((sl[j / 2] >> (4 * (j % 2))) & 0x0f) | (((sh >> (2 * j)) & 3) << 4);
      float dl = d * float(s - 32);
      iq4_lookup(dl, qs, y);
    }
  }
}

void dequantize_f16(const uint8_t* src, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = half_to_float(load_u16(src + 2 * i));
}

void dequantize_bf16(const uint8_t* src, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = bf16_to_fp32(load_u16(src + 2 * i));
}

}  // namespace

float fp16_to_fp32(uint16_t h) { return half_to_float(h); }

uint16_t fp32_to_fp16(float f) {
  uint32_t u = float_bits(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000);
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) {  // nan: keep the top payload bits, as numpy does, but stay a nan
    uint16_t h = uint16_t(0x7c00u + ((abs & 0x7fffffu) >> 13));
    return sign | (h == 0x7c00u ? uint16_t(0x7c01u) : h);
  }
  if (abs >= 0x477ff000u) return sign | 0x7c00;  // inf, or rounds to >= 65520: overflow to inf
  if (abs < 0x38800000u) {                        // below the smallest normal half (2^-14)
    // Subnormal: value = abs * 2^24 in units of the smallest subnormal, rounded to nearest even.
    float scaled = bits_float(abs) * 16777216.0f;  // exact (power of two)
    return sign | uint16_t(std::nearbyint(scaled));
  }
  uint32_t mant = abs & 0x7fffff, exp = (abs >> 23) - 112;
  uint32_t h = (exp << 10) | (mant >> 13), rest = mant & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;  // round to nearest even (may carry into exp)
  return sign | uint16_t(h);
}

uint16_t fp32_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet nan
  u += 0x7fff + ((u >> 16) & 1);
  return uint16_t(u >> 16);
}

void dequantize_row(DType t, const void* src, float* dst, int64_t n) {
  const auto* s = static_cast<const uint8_t*>(src);
  const DTypeInfo& info = dtype_info(t);
  row_size(t, n);  // validates the block multiple
  int64_t nb = n / info.block_size;
  switch (t) {
    case DType::F32: std::memcpy(dst, s, size_t(n) * 4); return;
    case DType::F16: dequantize_f16(s, dst, n); return;
    case DType::BF16: dequantize_bf16(s, dst, n); return;
    case DType::Q8_0: dequantize_q8_0(s, dst, nb); return;
    case DType::Q4_K: dequantize_q4_k(s, dst, nb); return;
    case DType::Q5_K: dequantize_q5_k(s, dst, nb); return;
    case DType::Q6_K: dequantize_q6_k(s, dst, nb); return;
    case DType::IQ4_XS: dequantize_iq4_xs(s, dst, nb); return;
    case DType::IQ4_XS_TILED:
    case DType::Q4_K_TILED:
    case DType::Q5_K_TILED:
    case DType::Q6_K_TILED: fail("dequantize: ", info.name, " is the GPU GEMV's tiled layout; only the GPU matmul reads it");
    default: fail("dequantize: ", info.name, " is not a weight format");
  }
}

void quantize_row(DType t, const float* src, void* dst, int64_t n) {
  auto* d = static_cast<uint8_t*>(dst);
  const DTypeInfo& info = dtype_info(t);
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
      quantize_q8_0(src, d, n / info.block_size);
      return;
    default:
      fail("quantize: specd writes F32, F16, BF16 and Q8_0, not ", info.name);
  }
}

void check_weight_dtype(const Tensor& t, const char* op, const char* arg) {
  SPECD_CHECK(t.dtype != DType::I32 && !is_gemv_tiled(t.dtype), op, ": ", arg,
              " must be a weight format (F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS), got ", dtype_info(t.dtype).name,
              is_gemv_tiled(t.dtype) ? " (the GPU GEMV's tiled layout: only the GPU matmul reads it)" : "");
}

Tensor dequantize(const Tensor& w) {
  const char* op = "dequantize";
  check_cpu(w, op, "w");
  check_weight_dtype(w, op, "w");
  SPECD_CHECK(w.ndim() >= 1, op, ": w must have at least 1 dimension");
  check_contiguous(w, op, "w");
  Tensor y = Tensor::empty(w.shape, DType::F32);
  int64_t n = w.cols();
  parallel_for(w.rows(), std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) dequantize_row(w.dtype, w.row_ptr(r), y.ptr<float>() + r * n, n);
  });
  return y;
}

Tensor quantize(const Tensor& x, DType dtype) {
  const char* op = "quantize";
  check_cpu(x, op, "x");
  check_dtype(x, DType::F32, op, "x");
  SPECD_CHECK(x.ndim() >= 1, op, ": x must have at least 1 dimension");
  check_contiguous(x, op, "x");
  const DTypeInfo& info = dtype_info(dtype);
  SPECD_CHECK(dtype == DType::F32 || dtype == DType::F16 || dtype == DType::BF16 || dtype == DType::Q8_0, op,
              ": dtype must be F32, F16, BF16 or Q8_0, got ", info.name);
  int64_t n = x.cols();
  SPECD_CHECK(n % info.block_size == 0, op, ": rows of x have ", n, " elements, not a multiple of the ", info.name,
              " block size ", info.block_size);
  Tensor y = Tensor::empty(x.shape, dtype);
  parallel_for(x.rows(), std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) quantize_row(dtype, x.ptr<float>() + r * n, y.row_ptr(r), n);
  });
  return y;
}

}  // namespace specd::cpu
