// Weight-format "policies" of the GPU matmul: how a chunk of a ggml weight row is loaded and decoded
// in registers. Shared by the FP32-FMA GEMV (gemv_fma.cuh), the tensor-core GEMV (matmul_mma.cuh) and the
// dequantize-to-BF16 kernels (matmul_blas.cu),
// so both paths see the same weight values.
//
// A row is cut into chunks of kElems weights (c = 0 .. nchunks-1); a chunk is loaded in one go
// (`load`, the raw bytes in registers) and decoded in kParts parts of kPE = kElems / kParts weights,
// each part a run of consecutive elements starting at element `offset(c, part)` of the row. Parts
// keep the decoded floats per thread small (8 registers per weight row) while the load stays wide.
// decode_part<part>(raw, w) writes the part's weights and returns a scale s: weight k is s * w[k]
// (kScaled, Q8_0 only: the GEMV multiplies once per part) or w[k] itself (s = 1).
//
// Exactness. Every decoder performs the float32 operations of the CPU decoder (cpu/quants.cpp) on
// the same operands, so the decoded values are bit-identical to cpu::dequantize: the K-quant
// products d*sc, dmin*m and d1*q are exact in float32 (few significant bits), so
// fmaf(d1, q, -m1) == d1*q - m1 rounded once, as the CPU computes it; Q6_K and IQ4_XS round one
// product (d*sc)*q, done with __fmul_rn (never contracted). Small integers are turned into floats
// with the exact magic-number trick (bits 0x4B0000uu = 2^23 + uu) to keep the slow int->float
// converter off the critical path.
#pragma once
#include <cstdint>
#include <type_traits>
#include <utility>

#include "portability.h"

namespace specd::gpu::detail {

// --- small integer helpers ------------------------------------------------------------------

constexpr uint32_t kMagicExp = 0x4B000000u;  // float bits of 2^23

// Four unsigned bytes of `word` (each < 256) -> floats minus `bias` (exact for |result| < 2^23).
__device__ __forceinline__ void u8x4_to_float(uint32_t word, float bias, float* w) {
  const float b = 8388608.0f + bias;
  w[0] = __int_as_float(__byte_perm(word, kMagicExp, 0x7540)) - b;
  w[1] = __int_as_float(__byte_perm(word, kMagicExp, 0x7541)) - b;
  w[2] = __int_as_float(__byte_perm(word, kMagicExp, 0x7542)) - b;
  w[3] = __int_as_float(__byte_perm(word, kMagicExp, 0x7543)) - b;
}

// Four signed bytes -> exact floats.
__device__ __forceinline__ void i8x4_to_float(uint32_t word, float* w) { u8x4_to_float(word ^ 0x80808080u, 128.0f, w); }

__device__ __forceinline__ uint32_t ld_u16(const uint8_t* p) { return *reinterpret_cast<const uint16_t*>(p); }
// Two 2-byte-aligned u16 loads as one little-endian word (for formats whose blocks are only
// 2-byte aligned).
__device__ __forceinline__ uint32_t ld_u16x2(const uint8_t* p) { return ld_u16(p) | (ld_u16(p + 2) << 16); }

// --- plain float formats --------------------------------------------------------------------

// F32: 4 floats per chunk (16-byte aligned rows, one float4 load) or 1 (any alignment).
template <int E>
struct F32W {
  static_assert(E == 1 || E == 4, "F32 chunks are 1 or 4 floats");
  static constexpr int kElems = E, kParts = 1, kPE = E;
  static constexpr bool kScaled = false;
  struct Raw {
    float v[E];
  };
  __device__ __forceinline__ static Raw load(const uint8_t* __restrict__ row, int64_t c) {
    Raw r;
    if constexpr (E == 4) {
      float4 f = reinterpret_cast<const float4*>(row)[c];
      r.v[0] = f.x, r.v[1] = f.y, r.v[2] = f.z, r.v[3] = f.w;
    } else {
      r.v[0] = reinterpret_cast<const float*>(row)[c];
    }
    return r;
  }
  template <int P>
  __device__ __forceinline__ static float decode_part(const Raw& r, float (&w)[kPE]) {
#pragma unroll
    for (int k = 0; k < E; ++k) w[k] = r.v[k];
    return 1.0f;
  }
  __device__ __forceinline__ static int64_t offset(int64_t c, int) { return c * E; }
};

// F16 / BF16: 8 values per chunk (one 16-byte load; rows 16-byte aligned, in % 8 == 0) or 1.
template <int E, bool kBF16>
struct Half16W {
  static_assert(E == 1 || E == 8, "16-bit chunks are 1 or 8 values");
  static constexpr int kElems = E, kParts = 1, kPE = E;
  static constexpr bool kScaled = false;
  struct Raw {
    uint32_t v[(E + 1) / 2];
  };
  __device__ __forceinline__ static Raw load(const uint8_t* __restrict__ row, int64_t c) {
    Raw r;
    if constexpr (E == 8) {
      uint4 q = reinterpret_cast<const uint4*>(row)[c];
      r.v[0] = q.x, r.v[1] = q.y, r.v[2] = q.z, r.v[3] = q.w;
    } else {
      r.v[0] = ld_u16(row + 2 * c);
    }
    return r;
  }
  __device__ __forceinline__ static float one(uint32_t bits16) {
    if constexpr (kBF16) return __uint_as_float(bits16 << 16);  // bf16 is the top half of an f32
    return specd_fp16_bits_to_float(uint16_t(bits16));
  }
  template <int P>
  __device__ __forceinline__ static float decode_part(const Raw& r, float (&w)[kPE]) {
#pragma unroll
    for (int k = 0; k < E; ++k) w[k] = one((r.v[k / 2] >> (16 * (k & 1))) & 0xffffu);
    return 1.0f;
  }
  __device__ __forceinline__ static int64_t offset(int64_t c, int) { return c * E; }
};

// --- Q8_0 (34-byte blocks of 32: fp16 d | int8 q[32]) ---------------------------------------

// A quarter block (8 weights) per chunk, read as 16-bit words (blocks are only 2-byte aligned).
struct Q8_0Quarter {
  static constexpr int kElems = 8, kParts = 1, kPE = 8;
  static constexpr bool kScaled = true;
  struct Raw {
    uint32_t lo, hi;  // 8 int8 quants
    uint16_t d;       // fp16 block scale
  };
  __device__ __forceinline__ static Raw load(const uint8_t* __restrict__ row, int64_t c) {
    const uint8_t* blk = row + (c >> 2) * 34;
    const uint8_t* q = blk + 2 + 8 * (c & 3);
    Raw r;
    r.d = uint16_t(ld_u16(blk));
    r.lo = ld_u16x2(q);
    r.hi = ld_u16x2(q + 4);
    return r;
  }
  template <int P>
  __device__ __forceinline__ static float decode_part(const Raw& r, float (&w)[kPE]) {
    i8x4_to_float(r.lo, w);
    i8x4_to_float(r.hi, w + 4);
    return specd_fp16_bits_to_float(r.d);
  }
  __device__ __forceinline__ static int64_t offset(int64_t c, int) { return c * 8; }
};

// --- K-quants (256 weights per block) --------------------------------------------------------

// Scale and min of sub-block j (0..7) from the 12 packed bytes s0|s1|s2 (ggml get_scale_min_k4;
// cpu::unpack_scale_min_k4).
__device__ __forceinline__ void scale_min_k4(int j, uint32_t s0, uint32_t s1, uint32_t s2, float& sc, float& mn) {
  const int k = 8 * (j & 3);
  uint32_t a = (s0 >> k) & 0xff, b = (s1 >> k) & 0xff, c = (s2 >> k) & 0xff;
  uint32_t isc = j < 4 ? (a & 63) : ((c & 0x0f) | ((a >> 2) & 0x30));
  uint32_t imn = j < 4 ? (b & 63) : ((c >> 4) | ((b >> 2) & 0x30));
  sc = float(isc), mn = float(imn);  // < 64: exact
}

// Q4_K (144-byte blocks, 16-byte aligned): a chunk is 16 bytes of nibbles, qs[32p + 16h ..] of
// sub-block pair p (h = 0, 1): low nibbles are elements 64p + 16h + 0..15 (sub-block 2p), high
// nibbles elements 64p + 32 + 16h + 0..15 (sub-block 2p+1). Parts: low/high x first/second 8 bytes.
// The block's 16-byte header (d, dmin, scales) is loaded by each of its 8 chunks (L1 hits).
template <bool kQ5>
struct QK45 {
  static constexpr int kElems = 32, kParts = 4, kPE = 8;
  static constexpr bool kScaled = false;
  static constexpr int kBlock = kQ5 ? 176 : 144, kQs = kQ5 ? 48 : 16;
  struct Raw {
    uint4 q, hdr;
    uint4 qh;  // Q5_K: fifth bits qh[16h .. 16h+15] (unused for Q4_K, optimised away)
    int sel;   // c & 7
  };
  __device__ __forceinline__ static Raw load(const uint8_t* __restrict__ row, int64_t c) {
    const uint8_t* blk = row + (c >> 3) * kBlock;
    Raw r;
    r.sel = int(c & 7);
    r.hdr = *reinterpret_cast<const uint4*>(blk);
    r.q = *reinterpret_cast<const uint4*>(blk + kQs + 16 * r.sel);  // 32p + 16h = 16 * sel
    if constexpr (kQ5) r.qh = *reinterpret_cast<const uint4*>(blk + 16 + 16 * (r.sel & 1));
    return r;
  }
  template <int P>
  __device__ __forceinline__ static float decode_part(const Raw& r, float (&w)[kPE]) {
    constexpr int kHigh = P >> 1, kWord = 2 * (P & 1);  // nibble half; first word of the 8 bytes
    const int j = 2 * (r.sel >> 1) + kHigh;              // sub-block
    float sc, mn;
    scale_min_k4(j, r.hdr.y, r.hdr.z, r.hdr.w, sc, mn);
    const float d1 = __fmul_rn(specd_fp16_bits_to_float(uint16_t(r.hdr.x)), sc);
    const float m1 = __fmul_rn(specd_fp16_bits_to_float(uint16_t(r.hdr.x >> 16)), mn);
    const uint32_t qw[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
    const uint32_t hw[4] = {r.qh.x, r.qh.y, r.qh.z, r.qh.w};
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      uint32_t v = (qw[kWord + t] >> (4 * kHigh)) & 0x0f0f0f0fu;
      if constexpr (kQ5) v |= ((hw[kWord + t] >> j) & 0x01010101u) << 4;
      float f[4];
      u8x4_to_float(v, 0.0f, f);
#pragma unroll
      for (int k = 0; k < 4; ++k) w[4 * t + k] = fmaf(d1, f[k], -m1);  // == d1*q - m1 (d1*q exact)
    }
    return 1.0f;
  }
  __device__ __forceinline__ static int64_t offset(int64_t c, int part) {
    const int sel = int(c & 7);
    return (c >> 3) * 256 + 64 * (sel >> 1) + 32 * (part >> 1) + 16 * (sel & 1) + 8 * (part & 1);
  }
};
using Q4KW = QK45<false>;
using Q5KW = QK45<true>;

// Q6_K (210-byte blocks, only 2-byte aligned): a chunk is 8 consecutive l (l0 = 8*(c%4)) of one
// half (128 weights) of a block: ql[l0..+7], ql[32+l0..+7], qh[l0..+7]; part g (0..3) is elements
// 32g + l0 + 0..7 of the half: nibble g/2 of ql[32*(g%2) + l], bits 2g..2g+1 of qh[l], scale
// sc[8*half + 2g + l0/16]. Value (d * sc) * (q - 32), rounded as the CPU rounds it.
struct Q6KW {
  static constexpr int kElems = 32, kParts = 4, kPE = 8;
  static constexpr bool kScaled = false;
  struct Raw {
    uint32_t ql[4], qh[2];
    uint32_t sc01, sc23;  // the four int8 scales of parts 0..3 (byte t of their u16 words)
    uint32_t d;
  };
  __device__ __forceinline__ static Raw load(const uint8_t* __restrict__ row, int64_t c) {
    const uint8_t* blk = row + (c >> 3) * 210;
    const int half = int(c >> 2) & 1, l0 = 8 * int(c & 3), t = l0 >> 4;
    const uint8_t* ql = blk + 64 * half + l0;
    const uint8_t* qh = blk + 128 + 32 * half + l0;
    const uint8_t* sc = blk + 192 + 8 * half + t;  // byte of part g at sc + 2g
    Raw r;
    r.ql[0] = ld_u16x2(ql), r.ql[1] = ld_u16x2(ql + 4);
    r.ql[2] = ld_u16x2(ql + 32), r.ql[3] = ld_u16x2(ql + 36);
    r.qh[0] = ld_u16x2(qh), r.qh[1] = ld_u16x2(qh + 4);
    r.sc01 = uint32_t(sc[0]) | (uint32_t(sc[2]) << 8);
    r.sc23 = uint32_t(sc[4]) | (uint32_t(sc[6]) << 8);
    r.d = ld_u16(blk + 208);
    return r;
  }
  template <int G>
  __device__ __forceinline__ static float decode_part(const Raw& r, float (&w)[kPE]) {
    const uint32_t scw = G < 2 ? r.sc01 : r.sc23;
    const int isc = int(int8_t(uint8_t(scw >> (8 * (G & 1)))));
    const float s = __fmul_rn(specd_fp16_bits_to_float(uint16_t(r.d)), float(isc));  // exact
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      uint32_t v = (r.ql[2 * (G & 1) + t] >> (4 * (G >> 1))) & 0x0f0f0f0fu;
      v |= ((r.qh[t] >> (2 * G)) & 0x03030303u) << 4;
      float f[4];
      u8x4_to_float(v, 32.0f, f);  // q - 32, exact
#pragma unroll
      for (int k = 0; k < 4; ++k) w[4 * t + k] = __fmul_rn(s, f[k]);
    }
    return 1.0f;
  }
  __device__ __forceinline__ static int64_t offset(int64_t c, int part) {
    return (c >> 3) * 256 + 128 * ((c >> 2) & 1) + 32 * part + 8 * (c & 3);
  }
};

// IQ4_XS (136-byte blocks, 8-byte aligned): a chunk is sub-block j = c % 8: 16 bytes qs[16j ..]
// (two 8-byte loads), low nibbles elements 32j + 0..15, high nibbles 32j + 16..31, plus the
// block's 8-byte header (d | scales_h | scales_l). Value (d * (s - 32)) * kvalues[idx].
struct IQ4XSW {
  static constexpr int kElems = 32, kParts = 4, kPE = 8;
  static constexpr bool kScaled = false;
  struct Raw {
    uint2 a, b, hdr;
    int j;
  };
  __device__ __forceinline__ static Raw load(const uint8_t* __restrict__ row, int64_t c) {
    const uint8_t* blk = row + (c >> 3) * 136;
    Raw r;
    r.j = int(c & 7);
    r.hdr = *reinterpret_cast<const uint2*>(blk);
    r.a = *reinterpret_cast<const uint2*>(blk + 8 + 16 * r.j);
    r.b = *reinterpret_cast<const uint2*>(blk + 16 + 16 * r.j);
    return r;
  }
  // Four 4-bit indices (one per byte) -> the four int8 table values, with byte permutes: the
  // 16-entry table lives in four words, entries 0-7 and 8-15 each selected by a 3-bit selector.
  __device__ __forceinline__ static uint32_t lookup4(uint32_t idx) {
    constexpr uint32_t t0 = 0xBFAD9881u, t1 = 0xF6EADDCFu, t2 = 0x26190D01u, t3 = 0x71594535u;
    uint32_t s = idx | (idx >> 4);                       // byte0 = i0 | i1 << 4, byte2 = i2 | i3 << 4
    uint32_t sel = __byte_perm(s, 0, 0x4420) & 0x7777u;  // 3-bit selectors (bit 3 would sign-fill)
    uint32_t lo = __byte_perm(t0, t1, sel), hi = __byte_perm(t2, t3, sel);
    uint32_t m = ((idx >> 3) & 0x01010101u) * 0xffu;  // 0xff in the bytes whose index is >= 8
    return (lo & ~m) | (hi & m);
  }
  template <int P>
  __device__ __forceinline__ static float decode_part(const Raw& r, float (&w)[kPE]) {
    const uint32_t sh = r.hdr.x >> 16, sl = r.hdr.y;
    const int s = int(((sl >> (4 * r.j)) & 0x0f) | (((sh >> (2 * r.j)) & 3) << 4));
    const float dl = __fmul_rn(specd_fp16_bits_to_float(uint16_t(r.hdr.x)), float(s - 32));  // exact
    const uint32_t qw[4] = {r.a.x, r.a.y, r.b.x, r.b.y};
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      uint32_t idx = (qw[2 * (P & 1) + t] >> (4 * (P >> 1))) & 0x0f0f0f0fu;
      float f[4];
      i8x4_to_float(lookup4(idx), f);
#pragma unroll
      for (int k = 0; k < 4; ++k) w[4 * t + k] = __fmul_rn(dl, f[k]);
    }
    return 1.0f;
  }
  __device__ __forceinline__ static int64_t offset(int64_t c, int part) {
    return (c >> 3) * 256 + 32 * (c & 7) + 16 * (part >> 1) + 8 * (part & 1);
  }
};

// --- stores of decoded parts ------------------------------------------------------------------
//
// store.part(o, v): the N = kPE values of one part at element o of the row (o a multiple of N),
// written with 16-byte (N = 8 BF16, N = 4 or 8 F32) or 8-byte (N = 4 BF16) stores: a thread owns a
// whole chunk, threads' chunks are 64+ bytes apart, and scalar 2- or 4-byte stores made every warp
// store instruction touch 32 sectors for 64-128 useful bytes. The caller's contract: dst (the row
// start) is aligned to the store width, i.e. the output buffer is and its row stride (elements x
// element size) is a multiple of it. Met by both callers: device buffers are 256-byte aligned, the
// embedding gathers 256-block formats only (rows of a multiple of 256 floats), and the dequantized
// panel's rows hold `in` BF16 values with in % 8 == 0 for the 8-wide policies (Q8_0Quarter: in % 32;
// Half16W<8>: chosen only for in % 8 == 0) and in % 4 == 0 for F32W<4> (8-byte BF16 stores).
#if defined(SPECD_HOST_EMU)
#define SPECD_STORE_ALIGNED(p, a) \
  do {                              \
    if (reinterpret_cast<uintptr_t>(p) % (a)) std::abort(); \
  } while (0)
#else
#define SPECD_STORE_ALIGNED(p, a) ((void)0)
#endif

// float -> bfloat16 bits, round to nearest even, NaN kept quiet (as cpu::fp32_to_bf16).
__device__ __forceinline__ uint16_t to_bf16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// Row of float32 (the embedding gather).
struct StoreF32 {
  float* dst;
  template <int N>
  __device__ __forceinline__ void part(int64_t o, const float (&v)[N]) const {
    if constexpr (N % 4 == 0) {
#pragma unroll
      for (int k = 0; k < N; k += 4) {
        SPECD_STORE_ALIGNED(dst + o + k, 16);
        *reinterpret_cast<float4*>(dst + o + k) = float4{v[k], v[k + 1], v[k + 2], v[k + 3]};
      }
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) dst[o + k] = v[k];
    }
  }
};

// Row of bfloat16 bits (the dequantize-to-BF16 path of the wide matmul).
struct StoreBF16 {
  uint16_t* dst;
  __device__ __forceinline__ static uint32_t pair(float lo, float hi) {
    return uint32_t(to_bf16(lo)) | (uint32_t(to_bf16(hi)) << 16);
  }
  template <int N>
  __device__ __forceinline__ void part(int64_t o, const float (&v)[N]) const {
    if constexpr (N % 8 == 0) {
#pragma unroll
      for (int k = 0; k < N; k += 8) {
        SPECD_STORE_ALIGNED(dst + o + k, 16);
        *reinterpret_cast<uint4*>(dst + o + k) =
            uint4{pair(v[k], v[k + 1]), pair(v[k + 2], v[k + 3]), pair(v[k + 4], v[k + 5]), pair(v[k + 6], v[k + 7])};
      }
    } else if constexpr (N % 4 == 0) {
#pragma unroll
      for (int k = 0; k < N; k += 4) {
        SPECD_STORE_ALIGNED(dst + o + k, 8);
        *reinterpret_cast<uint2*>(dst + o + k) = uint2{pair(v[k], v[k + 1]), pair(v[k + 2], v[k + 3])};
      }
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) dst[o + k] = to_bf16(v[k]);
    }
  }
};

// IQ4_XS_TILED's recoding of the 4-bit indices: bits 2 and 3 of every nibble of w swapped (0-3 and
// 12-15 stay, 4-7 <-> 8-11; its own inverse). The tiled layout stores recoded indices because the
// GEMV's lookup of the recoded table is shorter (matmul_mma.cuh, IQ4TableRecoded); values unchanged.
__host__ __device__ constexpr uint32_t iq4_tile_recode(uint32_t w) {
  const uint32_t x = ((w >> 2) ^ (w >> 3)) & 0x11111111u;  // bit 2 != bit 3, per nibble
  return w ^ (x << 2) ^ (x << 3);
}

// IQ4_XS_TILED (the tensor-core GEMV's layout, matmul_mma.cuh IQ4T): rows in tiles of 16; per tile
// and 256-input unit kIq4TileUnitBytes bytes: the 16 rows' quants in the MMA's lane order (run i of
// 512 bytes holds at 16 l the words 4 i .. 4 i + 3 of lane l = 4 g + t, word k = 8 h + j being
// qs[16 j + 4 t ..] of row g + 8 h, its indices recoded by iq4_tile_recode), then the 16 rows' 8-byte
// headers. load_tiled gathers IQ4XSW's chunk (row r, sub-block c) from it and undoes the recoding:
// the row-major bytes, so the same values.
constexpr int64_t kIq4TileUnitBytes = 16 * 136;
struct IQ4XSTiledW : IQ4XSW {
  __device__ __forceinline__ static Raw load_tiled(const uint8_t* __restrict__ w, int64_t nunits, int64_t r, int64_t c) {
    const int rt = int(r & 15), j = int(c & 7), k = 8 * (rt >> 3) + j;
    const uint8_t* unit = w + ((r >> 4) * nunits + (c >> 3)) * kIq4TileUnitBytes;
    const uint8_t* q = unit + 512 * (k >> 2) + 64 * (rt & 7) + 4 * (k & 3);  // lane 4 g + t at q + 16 t
    const auto word = [&](int t) { return iq4_tile_recode(*reinterpret_cast<const uint32_t*>(q + 16 * t)); };
    Raw raw;
    raw.j = j;
    raw.hdr = *reinterpret_cast<const uint2*>(unit + 2048 + 8 * rt);
    raw.a = uint2{word(0), word(1)};
    raw.b = uint2{word(2), word(3)};
    return raw;
  }
};

// Q4_K_TILED / Q5_K_TILED (the tensor-core GEMV's layouts, matmul_mma.cuh Q4T / Q5T): IQ4_XS_TILED's arrangement of
// the quants (qs[16 k + 4 t ..] as word k of lane 4 g + t of row g + 8 h, run 2 h + k / 4); Q5_K's then a 512-byte run
// of the fifth bits (lane 4 g + t at 16 (4 g + t): qh[4 t ..], qh[16 + 4 t ..] of row g, then of row g + 8); then the
// 16 rows' 16-byte headers. load_tiled gathers QK45's chunk (row r, chunk c: qs[16 sel ..], Q5_K's qh[16 (sel & 1) ..]).
constexpr int64_t kQ4TileUnitBytes = 16 * 144, kQ5TileUnitBytes = 16 * 176;
template <bool kQ5>
struct QK45TiledW : QK45<kQ5> {
  using Raw = typename QK45<kQ5>::Raw;
  __device__ __forceinline__ static Raw load_tiled(const uint8_t* __restrict__ w, int64_t nunits, int64_t r, int64_t c) {
    constexpr int64_t kUnit = kQ5 ? kQ5TileUnitBytes : kQ4TileUnitBytes, kHdr = kQ5 ? 2560 : 2048;
    const int rt = int(r & 15), k = int(c & 7);
    const uint8_t* unit = w + ((r >> 4) * nunits + (c >> 3)) * kUnit;
    const uint8_t* q = unit + 512 * (2 * (rt >> 3) + (k >> 2)) + 64 * (rt & 7) + 4 * (k & 3);  // lane 4 g + t at q + 16 t
    const auto words = [](const uint8_t* p) {
      const auto word = [p](int t) { return *reinterpret_cast<const uint32_t*>(p + 16 * t); };
      return uint4{word(0), word(1), word(2), word(3)};
    };
    Raw raw;
    raw.sel = k;
    raw.hdr = *reinterpret_cast<const uint4*>(unit + kHdr + 16 * rt);
    raw.q = words(q);
    raw.qh = kQ5 ? words(unit + 2048 + 64 * (rt & 7) + 4 * (2 * (rt >> 3) + (k & 1))) : uint4{0u, 0u, 0u, 0u};
    return raw;
  }
};
using Q4KTiledW = QK45TiledW<false>;
using Q5KTiledW = QK45TiledW<true>;

// Q6_K_TILED (the tensor-core GEMV's layout, matmul_mma.cuh Q6T): rows in tiles of 16; per tile and
// 256-input unit kQ6TileUnitBytes bytes: 6 runs of 512 bytes of quants (run 3 h + c holds at 16 l the
// words 4 c .. 4 c + 3 of lane l = 4 g + t of row g + 8 h, whose words k = 0..11 are ql[16 k + 4 t ..]
// for k < 8 and qh[16 (k - 8) + 4 t ..]), then the 16 rows' 16 scale bytes, then their fp16 d.
// load_tiled gathers Q6KW's chunk (row r, chunk c) from it: the same bytes, so the same values.
constexpr int64_t kQ6TileUnitBytes = 16 * 210, kQ6TileScales = 3072, kQ6TileD = 3072 + 256;
struct Q6KTiledW : Q6KW {
  __device__ __forceinline__ static Raw load_tiled(const uint8_t* __restrict__ w, int64_t nunits, int64_t r, int64_t c) {
    const int rt = int(r & 15);
    const uint8_t* unit = w + ((r >> 4) * nunits + (c >> 3)) * kQ6TileUnitBytes;
    // the word of the row's quant byte b (4-aligned): ql when b < 128, else qh[b - 128]
    const auto word = [&](int b) {
      const int k = b >> 4, t = (b >> 2) & 3;
      return *reinterpret_cast<const uint32_t*>(unit + 512 * (3 * (rt >> 3) + (k >> 2)) + 16 * (4 * (rt & 7) + t) +
                                                4 * (k & 3));
    };
    const int half = int(c >> 2) & 1, l0 = 8 * int(c & 3);
    const uint8_t* sc = unit + kQ6TileScales + 16 * rt + 8 * half + (l0 >> 4);  // byte of part g at sc + 2g
    Raw raw;
    const int ql = 64 * half + l0, qh = 128 + 32 * half + l0;
    raw.ql[0] = word(ql), raw.ql[1] = word(ql + 4), raw.ql[2] = word(ql + 32), raw.ql[3] = word(ql + 36);
    raw.qh[0] = word(qh), raw.qh[1] = word(qh + 4);
    raw.sc01 = uint32_t(sc[0]) | (uint32_t(sc[2]) << 8);
    raw.sc23 = uint32_t(sc[4]) | (uint32_t(sc[6]) << 8);
    raw.d = *reinterpret_cast<const uint16_t*>(unit + kQ6TileD + 2 * rt);
    return raw;
  }
};

// --- whole-chunk decode ---------------------------------------------------------------------

// Decodes chunk c of a weight row: store.part(o, v) for each of its kParts parts, v the part's
// exact float32 weights (Q8_0: q * d, as cpu::dequantize) at row elements o .. o + kPE - 1. Shared
// by the BF16 dequantization of the GEMM path and the embedding gather.
template <class W, class Store, int... P>
__device__ __forceinline__ void decode_raw(const typename W::Raw& raw, int64_t c, const Store& store,
                                           std::integer_sequence<int, P...>) {
  auto part = [&](auto pc) {
    constexpr int kP = decltype(pc)::value;
    float v[W::kPE];
    const float s = W::template decode_part<kP>(raw, v);
    if constexpr (W::kScaled) {
#pragma unroll
      for (int k = 0; k < W::kPE; ++k) v[k] = v[k] * s;
    }
    store.part(W::offset(c, kP), v);
  };
  (part(std::integral_constant<int, P>()), ...);
}

// The same from the chunk's raw bytes already loaded (e.g. IQ4XSTiledW::load_tiled).
template <class W, class Store>
__device__ __forceinline__ void decode_raw(const typename W::Raw& raw, int64_t c, const Store& store) {
  decode_raw<W>(raw, c, store, std::make_integer_sequence<int, W::kParts>());
}

template <class W, class Store>
__device__ __forceinline__ void decode_chunk(const uint8_t* row, int64_t c, const Store& store) {
  decode_raw<W>(W::load(row, c), c, store);
}

// --- whole tile units to BF16 (the prefill's dequantization of the tiled layouts) ----------------
//
// A warp dequantizes one tile unit (16 rows x 256 inputs of IQ4_XS_TILED / Q4_K_TILED / Q5_K_TILED / Q6_K_TILED)
// in two phases, so that its global stores are whole 512-byte row segments:
//   1. unit_decode_lane: lane l decodes chunks 8 u + (l & 7) of rows 4 s + (l >> 3), s = 0..3, into the
//      warp's shared-memory tile (16 rows x 32 pieces of 8 BF16 = 8 KiB) at unit_piece_slot;
//   2. after __syncwarp, unit_store_lane: lane l copies piece l of each of the 16 rows to the output.
// (A thread per chunk storing its 64 contiguous bytes with four 16-byte stores makes every warp store
// touch 32 half-used sectors.) The values are decode_raw's, so the BF16 bits are the same as
// StoreBF16's.
constexpr int kUnitRows = 16, kUnitPieces = 32;  // a unit row: 256 BF16 = 32 pieces of 16 bytes

// Slot of piece p (8 BF16 at inputs 8 p .. 8 p + 7 of the unit) of unit row `row` in the tile. The XOR
// swizzle keeps both phases free of shared-memory bank conflicts for IQ4_XS (an 8-lane phase of
// 16-byte accesses must hit 8 distinct 16-byte bank groups): phase 1 writes pieces 4 j + P of one row
// (j = 0..7), phase 2 reads pieces 8 m .. 8 m + 7 of one row. (Q4_K's and Q6_K's part offsets give
// 2-way conflicts in phase 1.)
__device__ __forceinline__ int unit_piece_slot(int row, int p) { return row * kUnitPieces + (p ^ ((p >> 3) & 3)); }

// decode_raw's store into the tile: part at row element o (o - col0 in [0, 256), a multiple of 8).
struct StoreBF16Unit {
  uint4* tile;
  int row;
  int64_t col0;
  template <int N>
  __device__ __forceinline__ void part(int64_t o, const float (&v)[N]) const {
    static_assert(N == 8, "the tiled formats decode parts of 8 values");
    tile[unit_piece_slot(row, int((o - col0) >> 3))] =
        uint4{StoreBF16::pair(v[0], v[1]), StoreBF16::pair(v[2], v[3]), StoreBF16::pair(v[4], v[5]),
              StoreBF16::pair(v[6], v[7])};
  }
};

// Phase 1 for lane `lane` of the warp on unit u (inputs 256 u ..) of the tile whose first row is row0.
// The four chunks' bytes are loaded before any is decoded, so they are in flight together.
template <class T>
__device__ __forceinline__ void unit_decode_lane(const uint8_t* __restrict__ w, int64_t nunits, int64_t row0,
                                                 int64_t u, int lane, uint4* tile) {
  const int64_t c = 8 * u + (lane & 7);
  typename T::Raw raw[4];
#pragma unroll
  for (int s = 0; s < 4; ++s) raw[s] = T::load_tiled(w, nunits, row0 + 4 * s + (lane >> 3), c);
#pragma unroll
  for (int s = 0; s < 4; ++s) decode_raw<T>(raw[s], c, StoreBF16Unit{tile, 4 * s + (lane >> 3), 256 * u});
}

// Phase 2: piece `lane` of each unit row to dst (the tile's first output row; rows of `in` BF16,
// 16-byte aligned: in % 8 == 0), 512 contiguous bytes per warp store.
__device__ __forceinline__ void unit_store_lane(const uint4* tile, uint16_t* __restrict__ dst, int64_t in, int64_t u,
                                                int lane) {
#pragma unroll 4
  for (int r = 0; r < kUnitRows; ++r) {
    uint16_t* p = dst + int64_t(r) * in + 256 * u + 8 * lane;
    SPECD_STORE_ALIGNED(p, 16);
    *reinterpret_cast<uint4*>(p) = tile[unit_piece_slot(r, lane)];
  }
}

}  // namespace specd::gpu::detail
