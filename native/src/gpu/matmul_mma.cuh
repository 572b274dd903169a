// Tensor-core GEMV of the quantized weight formats (Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS) for n <= 16
// rows of x: y[n, out] = x[n, in] @ w[out, in]^T. Included by matmul.cu (see its header for the
// design, exactness and batch-invariance arguments). NVIDIA only (mma.sync inline PTX, sm_80+):
// SPECD_MMA_GEMV is 0 on HIP, where matmul.cu keeps the FP32-FMA GEMV for every format.
//
// Layout conventions (mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32, PTX ISA "Matrix
// fragments for mma.m16n8k16 with floating point type"; lane = 4 * g + t, g = groupID, t =
// threadID_in_group):
//   A (16 x 16, weights: M = output rows, K = inputs): reg0 = (row g, k 2t, 2t+1), reg1 = (row
//     g+8, k 2t, 2t+1), reg2 = (row g, k 2t+8, 2t+9), reg3 = (row g+8, k 2t+8, 2t+9); the lower
//     16 bits hold the lower k.
//   B (16 x 8, x^T: K = inputs, N = rows of x): reg0 = (k 2t, 2t+1, col g), reg1 = (k 2t+8,
//     2t+9, col g).
//   C/D (16 x 8): c0, c1 = (row g, col 2t, 2t+1), c2, c3 = (row g+8, col 2t, 2t+1).
// k permutation: in every k16 step (16 consecutive inputs e0 .. e0+15 of a row) lane t holds the
// physical inputs e0 + 4t + {0, 1} in the MMA's k = 2t, 2t+1 and e0 + 4t + {2, 3} in k = 2t+8,
// 2t+9, for A and B alike, so the MMA still sums all 16 products of the step while each lane
// reads 4 consecutive weights (one 32-bit word of 8-bit quants, or of nibbles) per row.
#pragma once

#if !SPECD_HIP
#define SPECD_MMA_GEMV 1
#else
#define SPECD_MMA_GEMV 0
#endif

#if SPECD_MMA_GEMV
#include <algorithm>
#include <cstdint>
#include <vector>

#ifndef SPECD_HOST_EMU
#include "common.cuh"
#endif
#include "weight_formats.cuh"

namespace specd::gpu::detail::mma {

constexpr int kWarps = 4;   // warps per block; each owns its own 16 * kMT output rows
constexpr int kMT = 2;      // m16 tiles (16 output rows each) per warp
constexpr int kRowsPerBlock = kWarps * kMT * 16;
constexpr int kXCols = 16;  // columns of the x-scale/sum scratch (rows of x, padded)
// Resident blocks per multiprocessor the kernel is compiled for (<= 128 registers per thread) and
// the split-K count is sized for: the grid then runs in whole waves (see units_per_split).
constexpr int kBlocksPerSM = 4;

// --- small helpers ----------------------------------------------------------------------------

// D += A * B (m16n8k16, f16 inputs, f32 accumulation). FP16 rather than BF16: 11 significant bits
// per x term, so two terms carry x to ~22 bits (BF16 needed three), i.e. 2 MMAs per k16 step and
// tile instead of 3, and one B fragment load less; the quants are small integers, exact in both.
__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint2 b) {
#if defined(SPECD_HOST_EMU)
  specd_emu_mma(d, a, b);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y));
#else
  __trap();  // never launched below sm_80 (the build targets sm_90)
#endif
}

// Two floats -> one f16x2 word (lo in the lower 16 bits), round to nearest even.
__device__ __forceinline__ uint32_t pack_f16(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Four unsigned bytes -> two f16x2 words of (byte - kBias): f16 bits 0x6400 | b are exactly 1024 + b
// (b < 256; the f16 spacing at 1024 is 1), and (1024 + b) - (1024 + kBias) is an exact small
// integer. 2 PRMT + 2 HSUB2 per 4 weights.
template <int kBias>
__device__ __forceinline__ void u8x4_to_f16(uint32_t v, uint32_t& lo, uint32_t& hi) {
  static_assert(kBias >= 0 && kBias <= 1023, "bias within the f16 integer range at 1024");
  constexpr uint32_t kB = 0x6400u + uint32_t(kBias);
  const uint32_t x0 = __byte_perm(v, 0x64u, 0x4140), x1 = __byte_perm(v, 0x64u, 0x4342);
  const uint32_t b2 = kB | (kB << 16);
  __half2 r0 = __hsub2(*reinterpret_cast<const __half2*>(&x0), *reinterpret_cast<const __half2*>(&b2));
  __half2 r1 = __hsub2(*reinterpret_cast<const __half2*>(&x1), *reinterpret_cast<const __half2*>(&b2));
  lo = *reinterpret_cast<uint32_t*>(&r0);
  hi = *reinterpret_cast<uint32_t*>(&r1);
}

// Four signed bytes -> two f16x2 words (exact): q + 128 = (q ^ 0x80) as an unsigned byte.
__device__ __forceinline__ void i8x4_to_f16(uint32_t v, uint32_t& lo, uint32_t& hi) {
  u8x4_to_f16<128>(v ^ 0x80808080u, lo, hi);
}

// A fragment of one m16 tile from the 4-weight words of its two rows (row g: w0, row g+8: w1),
// already converted: (w*lo = inputs 4t, 4t+1; w*hi = 4t+2, 4t+3).
__device__ __forceinline__ void make_a(uint32_t (&a)[4], uint32_t r0lo, uint32_t r0hi, uint32_t r1lo, uint32_t r1hi) {
  a[0] = r0lo, a[1] = r1lo, a[2] = r0hi, a[3] = r1hi;
}

// One k16 step (inputs 16 * kstep ..) of all m16 tiles against the two f16 terms of every n8 tile
// of x, accumulated into p in the order hi, lo per n8 tile.
// xf: [kstep][NT][2][32] uint2 (the B fragments, lane-major). Lanes of padding columns (>= ncols)
// skip the load and feed the zeros that xf holds there anyway (identical MMA inputs), so at n = 1
// a warp reads 32 bytes of x per term and step instead of 256.
template <int NT>
__device__ __forceinline__ void mma_step(const uint32_t (&a)[kMT][4], const uint2* __restrict__ xf, int64_t kstep,
                                         int lane, int ncols, float (&p)[kMT][NT][4]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const uint2* b = xf + ((kstep * NT + nt) * 2) * 32 + lane;
    const bool live = 8 * nt + (lane >> 2) < ncols;
    const uint2 bh = live ? __ldg(b) : make_uint2(0u, 0u), bl = live ? __ldg(b + 32) : make_uint2(0u, 0u);
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      mma_f16(p[mt][nt], a[mt], bh);
      mma_f16(p[mt][nt], a[mt], bl);
    }
  }
}

// The two k16 steps of one 32-input sub-block (k steps kstep0, kstep0 + 1): decode(mt, h, s, lo, hi)
// turns the 4 weights lane t holds of row 16 mt + g + 8 h at step s into two f16x2 words (inputs
// 4t, 4t+1 and 4t+2, 4t+3); the MMAs accumulate into p.
template <int NT, class Decode>
__device__ __forceinline__ void mma_subblock(const Decode& decode, const uint2* __restrict__ xf, int64_t kstep0,
                                             int lane, int ncols, float (&p)[kMT][NT][4]) {
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    uint32_t a[kMT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      uint32_t lo[2], hw[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) decode(mt, h, s, lo[h], hw[h]);
      make_a(a[mt], lo[0], hw[0], lo[1], hw[1]);
    }
    mma_step<NT>(a, xf, kstep0 + s, lane, ncols, p);
  }
}

template <int NT>
__device__ __forceinline__ void zero(float (&p)[kMT][NT][4]) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) p[mt][nt][c] = 0.0f;
}

// acc = fma(scale_row, p, acc); sc[mt][h] is the scale of row 16 mt + g + 8 h.
template <int NT>
__device__ __forceinline__ void apply_scale(float (&acc)[kMT][NT][4], const float (&p)[kMT][NT][4],
                                            const float (&sc)[kMT][2]) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[mt][nt][c] = __fmaf_rn(sc[mt][c >> 1], p[mt][nt][c], acc[mt][nt][c]);
}

// p *= the x split's power-of-two scale of its column for the 32-input block `blk` (exact: see
// split_x_kernel), so p becomes the partial dot product of the unscaled x. xs: [in / 32][kXCols]
// pairs {scale, sum of x over the block}; sum[nt] = the sums of the lane's columns 8 nt + 2t, +1.
template <int NT>
__device__ __forceinline__ void scale_cols(float (&p)[kMT][NT][4], const float* __restrict__ xs, int64_t blk, int t,
                                           float2 (&sum)[NT]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(xs + 2 * (blk * kXCols + 8 * nt + 2 * t)));
    sum[nt].x = v.y, sum[nt].y = v.w;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int c = 0; c < 4; ++c) p[mt][nt][c] = __fmul_rn(p[mt][nt][c], (c & 1) ? v.z : v.x);
  }
}

// --- formats: a "unit" is 32 (Q8_0) or 64 (others) consecutive inputs of a row --------------

// Q8_0: unit = one block (fp16 d | int8 q[32]), 2-byte aligned. Lane t reads q[4t..] and
// q[16 + 4t..] of its rows.
struct Q8U {
  static constexpr int kUnitElems = 32, kU = 5;  // kU: units whose loads a warp issues before using the first
  static constexpr bool kMins = false;
  struct Raw {
    uint32_t q0, q1, d;
  };
  __device__ __forceinline__ static Raw load(const uint8_t* __restrict__ row, int64_t u, int t) {
    const uint8_t* blk = row + u * 34;
    return Raw{ld_u16x2(blk + 2 + 4 * t), ld_u16x2(blk + 18 + 4 * t), ld_u16(blk)};
  }
  template <int NT>
  __device__ __forceinline__ static void compute(const Raw (&r)[kMT][2], int64_t u, const uint2* __restrict__ xf,
                                                 const float* __restrict__ xs, int lane, int ncols,
                                                 float (&acc)[kMT][NT][4]) {
    float p[kMT][NT][4], sc[kMT][2];
    float2 unused[NT];
    zero(p);
    mma_subblock<NT>([&](int mt, int h, int s, uint32_t& lo, uint32_t& hi) {
      i8x4_to_f16(s ? r[mt][h].q1 : r[mt][h].q0, lo, hi);
    }, xf, 2 * u, lane, ncols, p);
    scale_cols(p, xs, u, lane & 3, unused);
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) sc[mt][h] = specd_fp16_bits_to_float(uint16_t(r[mt][h].d));
    apply_scale(acc, p, sc);
  }
};

// Q4_K / Q5_K: unit = sub-block pair p of a 256-block (inputs 64p .. 64p + 63 of the block):
// sub-block 2p = low nibbles of qs[32p + l], 2p + 1 = high nibbles, l = 0 .. 31 (Q5_K: fifth bit
// = bit j of qh[l] for sub-block j). Step s of a sub-block = l in 16s .. 16s + 15: lane t reads
// the words qs[32p + 16s + 4t ..] (and qh[16s + 4t ..]). Value d1 * q - m1 with d1 = d * sc_j,
// m1 = dmin * m_j (exact products): sum = d1 * (q . x) - m1 * sum(x over the sub-block).
// The 16-byte block header (d, dmin | scales) is loaded one word per lane (lane t: word t) and
// gathered with shuffles when the unit is computed: held whole by every lane it took 4 registers
// per row and unit in flight (of 6), which capped the loads in flight at 2 units (2 KB per warp);
// now Q4_K keeps 3 units in flight within the 128 registers (Q5_K, with its qh words, still 2).
template <bool kQ5>
struct QK45U {
  static constexpr int kUnitElems = 64, kU = kQ5 ? 2 : 3;
  static constexpr bool kMins = true;
  static constexpr int kBlock = kQ5 ? 176 : 144, kQs = kQ5 ? 48 : 16;
  struct Raw {
    uint32_t hw;  // header word t of the lane's group (all 4 lanes of a group share the row)
    uint32_t q0, q1, h0, h1;
  };
  __device__ __forceinline__ static Raw load(const uint8_t* __restrict__ row, int64_t u, int t) {
    const uint8_t* blk = row + (u >> 2) * kBlock;
    const int p = int(u & 3);
    Raw r;
    r.hw = *reinterpret_cast<const uint32_t*>(blk + 4 * t);
    r.q0 = *reinterpret_cast<const uint32_t*>(blk + kQs + 32 * p + 4 * t);
    r.q1 = *reinterpret_cast<const uint32_t*>(blk + kQs + 32 * p + 16 + 4 * t);
    if constexpr (kQ5) {
      r.h0 = *reinterpret_cast<const uint32_t*>(blk + 16 + 4 * t);
      r.h1 = *reinterpret_cast<const uint32_t*>(blk + 32 + 4 * t);
    } else {
      r.h0 = r.h1 = 0;
    }
    return r;
  }
  template <int NT>
  __device__ __forceinline__ static void compute(const Raw (&r)[kMT][2], int64_t u, const uint2* __restrict__ xf,
                                                 const float* __restrict__ xs, int lane, int ncols,
                                                 float (&acc)[kMT][NT][4]) {
    const int p = int(u & 3), t = lane & 3;
    uint4 hdr[kMT][2];  // the rows' headers, words from lanes 4g + 0..3 (same rows: same g)
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int base = lane & ~3;
        hdr[mt][h].x = __shfl_sync(0xffffffffu, r[mt][h].hw, base);
        hdr[mt][h].y = __shfl_sync(0xffffffffu, r[mt][h].hw, base + 1);
        hdr[mt][h].z = __shfl_sync(0xffffffffu, r[mt][h].hw, base + 2);
        hdr[mt][h].w = __shfl_sync(0xffffffffu, r[mt][h].hw, base + 3);
      }
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const int j = 2 * p + hi;  // sub-block in the 256-block
      float part[kMT][NT][4];
      zero(part);
      mma_subblock<NT>([&](int mt, int h, int s, uint32_t& lo, uint32_t& hw) {
        uint32_t v = ((s ? r[mt][h].q1 : r[mt][h].q0) >> (4 * hi)) & 0x0f0f0f0fu;
        if constexpr (kQ5) v |= (((s ? r[mt][h].h1 : r[mt][h].h0) >> j) & 0x01010101u) << 4;
        u8x4_to_f16<0>(v, lo, hw);
      }, xf, 4 * u + 2 * hi, lane, ncols, part);
      float d1[kMT][2], m1[kMT][2];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float sc, mn;
          scale_min_k4(j, hdr[mt][h].y, hdr[mt][h].z, hdr[mt][h].w, sc, mn);
          d1[mt][h] = __fmul_rn(specd_fp16_bits_to_float(uint16_t(hdr[mt][h].x)), sc);
          m1[mt][h] = -__fmul_rn(specd_fp16_bits_to_float(uint16_t(hdr[mt][h].x >> 16)), mn);
        }
      float2 sx[NT];
      scale_cols(part, xs, 2 * u + hi, t, sx);
      apply_scale(acc, part, d1);
      // Min term: acc += (-m1_row) * sum(x over sub-block 2u + hi) for each column.
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int c = 0; c < 4; ++c)
            acc[mt][nt][c] = __fmaf_rn(m1[mt][c >> 1], (c & 1) ? sx[nt].y : sx[nt].x, acc[mt][nt][c]);
      }
    }
  }
};

// Q6_K (210-byte blocks, 2-byte aligned): unit = (half n, h) of a block, u = 4 b + 2 n + h: the
// four 16-input sub-blocks g = 0..3 at inputs 128 n + 32 g + 16 h + i (i = 0..15, l = 16 h + i):
// low 4 bits from ql[64 n + 32 (g & 1) + l] (nibble g >> 1), high 2 bits = bits 2g, 2g+1 of
// qh[32 n + l], scale sc[8 n + 2 g + h]; value (d * sc) * (q - 32). Lane t holds l = 16h + 4t ..
// +3 of each sub-block (one k16 step each).
struct Q6U {
  static constexpr int kUnitElems = 64, kU = 3;  // 3: 5 words per row and unit, <= 128 registers
  static constexpr bool kMins = false;
  struct Raw {
    uint32_t qa, qb, qh, sc, d;  // sc: the scale byte of sub-block g = t (lane t of the row's group)
  };
  __device__ __forceinline__ static Raw load(const uint8_t* __restrict__ row, int64_t u, int t) {
    const uint8_t* blk = row + (u >> 2) * 210;
    const int n = int(u >> 1) & 1, h = int(u & 1);
    const uint8_t* ql = blk + 64 * n + 16 * h + 4 * t;
    const uint8_t* sc = blk + 192 + 8 * n + h;  // sub-block g at sc + 2g
    Raw r;
    // One scale byte per lane (gathered with shuffles in compute): 1 load instead of 4 per row.
    r.qa = ld_u16x2(ql);
    r.qb = ld_u16x2(ql + 32);
    r.qh = ld_u16x2(blk + 128 + 32 * n + 16 * h + 4 * t);
    r.sc = sc[2 * t];
    r.d = ld_u16(blk + 208);
    return r;
  }
  template <int NT>
  __device__ __forceinline__ static void compute(const Raw (&r)[kMT][2], int64_t u, const uint2* __restrict__ xf,
                                                 const float* __restrict__ xs, int lane, int ncols,
                                                 float (&acc)[kMT][NT][4]) {
    const int64_t b = u >> 2;
    const int n = int(u >> 1) & 1, h16 = int(u & 1);
    uint32_t scw[kMT][2];  // byte g = scale of sub-block g, from lane 4 (lane / 4) + g
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int base = lane & ~3;
        scw[mt][h] = __shfl_sync(0xffffffffu, r[mt][h].sc, base) |
                     (__shfl_sync(0xffffffffu, r[mt][h].sc, base + 1) << 8) |
                     (__shfl_sync(0xffffffffu, r[mt][h].sc, base + 2) << 16) |
                     (__shfl_sync(0xffffffffu, r[mt][h].sc, base + 3) << 24);
      }
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      float part[kMT][NT][4], sc[kMT][2];
      zero(part);
      uint32_t a[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        uint32_t lo[2], hw[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          uint32_t v = (((g & 1) ? r[mt][h].qb : r[mt][h].qa) >> (4 * (g >> 1))) & 0x0f0f0f0fu;
          v |= ((r[mt][h].qh >> (2 * g)) & 0x03030303u) << 4;
          u8x4_to_f16<32>(v, lo[h], hw[h]);  // q - 32
          const int isc = int(int8_t(uint8_t(scw[mt][h] >> (8 * g))));
          sc[mt][h] = __fmul_rn(specd_fp16_bits_to_float(uint16_t(r[mt][h].d)), float(isc));  // exact
        }
        make_a(a[mt], lo[0], hw[0], lo[1], hw[1]);
      }
      mma_step<NT>(a, xf, 16 * b + 8 * n + 2 * g + h16, lane, ncols, part);
      float2 unused[NT];
      scale_cols(part, xs, 8 * b + 4 * n + g, lane & 3, unused);  // the 32-input block of k16 step 16b+8n+2g+h
      apply_scale(acc, part, sc);
    }
  }
};

// IQ4_XS (136-byte blocks, 8-byte aligned: fp16 d | u16 scales_h | u8 scales_l[4] | qs[128]):
// unit = sub-blocks 2p, 2p + 1 (u = 4 b + p); sub-block j = qs[16j .. 16j + 15], low nibbles
// inputs 32j + 0..15 (step 0), high nibbles 32j + 16..31 (step 1): lane t reads qs[16j + 4t ..].
// Value (d * (ls_j - 32)) * kvalues[idx] (kvalues in [-127, 113], exact in f16).
struct IQ4U {
  static constexpr int kUnitElems = 64, kU = 4;
  static constexpr bool kMins = false;
  struct Raw {
    uint2 hdr;
    uint32_t q0, q1;
  };
  __device__ __forceinline__ static Raw load(const uint8_t* __restrict__ row, int64_t u, int t) {
    const uint8_t* blk = row + (u >> 2) * 136;
    const int p = int(u & 3);
    Raw r;
    r.hdr = *reinterpret_cast<const uint2*>(blk);
    r.q0 = *reinterpret_cast<const uint32_t*>(blk + 8 + 32 * p + 4 * t);
    r.q1 = *reinterpret_cast<const uint32_t*>(blk + 8 + 32 * p + 16 + 4 * t);
    return r;
  }
  template <int NT>
  __device__ __forceinline__ static void compute(const Raw (&r)[kMT][2], int64_t u, const uint2* __restrict__ xf,
                                                 const float* __restrict__ xs, int lane, int ncols,
                                                 float (&acc)[kMT][NT][4]) {
    const int p = int(u & 3);
#pragma unroll
    for (int jj = 0; jj < 2; ++jj) {
      const int j = 2 * p + jj;
      float part[kMT][NT][4], sc[kMT][2];
      zero(part);
      mma_subblock<NT>([&](int mt, int h, int s, uint32_t& lo, uint32_t& hw) {
        const uint32_t idx = ((jj ? r[mt][h].q1 : r[mt][h].q0) >> (4 * s)) & 0x0f0f0f0fu;
        i8x4_to_f16(IQ4XSW::lookup4(idx), lo, hw);
      }, xf, 4 * u + 2 * jj, lane, ncols, part);
      float2 unused[NT];
      scale_cols(part, xs, 2 * u + jj, lane & 3, unused);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t sh = r[mt][h].hdr.x >> 16, sl = r[mt][h].hdr.y;
          const int ls = int(((sl >> (4 * j)) & 0x0f) | (((sh >> (2 * j)) & 3) << 4));
          sc[mt][h] = __fmul_rn(specd_fp16_bits_to_float(uint16_t(r[mt][h].hdr.x)), float(ls - 32));  // exact
        }
      apply_scale(acc, part, sc);
    }
  }
};

// --- kernels ---------------------------------------------------------------------------------

// x [n, in] F32 -> B fragments xf [in / 16][NT][2][32] uint2 and per-block scales xs [in / 32]
// [kXCols] {scale, sum}. One thread per (32-input block, column of the padded x); columns >= n are
// zero (scale 0, sum 0). For a block with all elements finite and max |x| = m in [2^E, 2^(E+1)):
//   x' = x * 2^k, k = 14 - E (clamped to <= 100), exact in F32, so max |x'| < 2^15 (f16 finite);
//   hi = f16(x'), lo = f16(x' - hi) (the difference is exact in F32);
//   scale = 2^-k (exact power of two in [2^-100, 2^113]); the kernel multiplies the block's partial
//   dot product by it. |x - scale * (hi + lo)| <= 2^-22 |x| + 2^-39 m (f16 keeps 11 bits per term;
//   the floor is lo's f16 subnormal spacing 2^-24 * scale), with 2^-125 as the floor instead when
//   the clamp applies (m < 2^-86).
// A block with a non-finite element keeps k = 0 (scale 1): hi = f16(x) is then inf / NaN where x is
// (or finite x beyond the f16 range overflows to inf) and lo = 0 there, so the column's result is
// non-finite, as the CPU's. The sum is the F32 rounding of the exact (double) sum of the block
// (for the Q4_K / Q5_K min terms).
__global__ void split_x_kernel(const float* __restrict__ x, int64_t ldx, int n, int64_t nblk, int NT,
                               uint2* __restrict__ xf, float* __restrict__ xs) {
  const int64_t id = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (id >= nblk * NT * 8) return;
  const int64_t blk = id / (NT * 8);
  const int col = int(id % (NT * 8)), nt = col >> 3, g = col & 7;
  float v[32];
#pragma unroll
  for (int k = 0; k < 32; ++k) v[k] = 0.0f;
  if (col < n) {
    const float4* src = reinterpret_cast<const float4*>(x + int64_t(col) * ldx + 32 * blk);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float4 f = src[k];
      v[4 * k] = f.x, v[4 * k + 1] = f.y, v[4 * k + 2] = f.z, v[4 * k + 3] = f.w;
    }
  }
  float m = 0.0f;
  bool fin = true;
  double sum = 0.0;
#pragma unroll
  for (int k = 0; k < 32; ++k) {
    fin = fin && isfinite(v[k]);
    m = fmaxf(m, fabsf(v[k]));
    sum += double(v[k]);
  }
  int k2 = 0;  // x' = x * 2^k2; k2 in [-113, 100], so 2^k2 and 2^-k2 are normal F32 numbers
  if (fin && m > 0.0f) {
    const int eb = int(__float_as_uint(m) >> 23);  // biased exponent: m in [2^(eb-127), 2^(eb-126))
    k2 = eb == 0 ? 100 : (141 - eb < 100 ? 141 - eb : 100);  // 14 - E; F32 subnormal m: clamp
  }
  // Multiplying by an exact power of two is exact (or correctly rounded into the F32 subnormal
  // range, far below what the F16 terms keep): the same as ldexpf, without its slow path.
  const float up = __uint_as_float(uint32_t(127 + k2) << 23);
  const float scale = col < n ? __uint_as_float(uint32_t(127 - k2) << 23) : 0.0f;
  xs[2 * (blk * kXCols + col)] = scale;
  xs[2 * (blk * kXCols + col) + 1] = float(sum);
  float hi[32], lo[32];
#pragma unroll
  for (int k = 0; k < 32; ++k) {
    const float xv = __fmul_rn(v[k], up);
    hi[k] = __half2float(__float2half_rn(xv));
    lo[k] = isfinite(hi[k]) ? __half2float(__float2half_rn(__fsub_rn(xv, hi[k]))) : 0.0f;
  }
  // k16 step 2 blk + s, lane 4g + t: inputs 16 s + 4t + 0..3 of the block (the k permutation above).
#pragma unroll
  for (int s = 0; s < 2; ++s)
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const int e0 = 16 * s + 4 * t;
      uint2* o = xf + (((2 * blk + s) * NT + nt) * 2) * 32 + 4 * g + t;
      o[0] = make_uint2(pack_f16(hi[e0], hi[e0 + 1]), pack_f16(hi[e0 + 2], hi[e0 + 3]));
      o[32] = make_uint2(pack_f16(lo[e0], lo[e0 + 1]), pack_f16(lo[e0 + 2], lo[e0 + 3]));
    }
}

// Several weights against the same x in one launch (the projections that read one normed hidden
// state: q / k / v, GDN qkv / gate / beta / alpha, FFN gate / up): weight i has out[i] rows, in
// inputs (the same for all) and its own split of the reduction dimension (units_per_split of its
// shape); the grid is flat, weight i owning blocks [block0[i], block0[i + 1]) = its row blocks x
// splits, row blocks fastest. Every weight's arithmetic is that of a launch of its own, so a group
// and separate calls give bit-identical results.
constexpr int kMaxGroup = 8;
struct Group {
  int count = 0;
  const uint8_t* w[kMaxGroup] = {};
  int64_t row_bytes[kMaxGroup] = {}, out[kMaxGroup] = {}, per_split[kMaxGroup] = {};
  float* dst[kMaxGroup] = {};                 // split partials [splits][n][out] (or y when one split)
  int64_t block0[kMaxGroup + 1] = {};         // first flat block of each weight; block0[count] = grid
};

// This block's weight wi (the last whose first block is <= blockIdx.x), row block and split.
struct GroupBlock {
  int wi;
  int64_t rb, split;
};
__device__ __forceinline__ GroupBlock locate(const Group& g_) {
  int wi = 0;
#pragma unroll
  for (int i = 1; i < kMaxGroup; ++i)
    if (i < g_.count && int64_t(blockIdx.x) >= g_.block0[i]) wi = i;
  const int64_t row_blocks = (g_.out[wi] + kRowsPerBlock - 1) / kRowsPerBlock, local = int64_t(blockIdx.x) - g_.block0[wi];
  return GroupBlock{wi, local % row_blocks, local / row_blocks};
}

// One block: kWarps warps, warp w owns rows row0 + 16 kMT w .. + 16 kMT - 1 of its weight and all
// rows of x, over units [u_begin, u_end) of its split (in order, kU loads in flight). Writes its
// partial sums to dst[split][col][row] of its weight.
template <class F, int NT>
__global__ void __launch_bounds__(kWarps * 32, NT == 1 ? kBlocksPerSM : 3) mma_gemv_kernel(const Group g_,
                                                                int64_t nunits, const uint2* __restrict__ xf,
                                                                const float* __restrict__ xs, int n) {
  const GroupBlock gb = locate(g_);
  const uint8_t* __restrict__ w = g_.w[gb.wi];
  const int64_t row_bytes = g_.row_bytes[gb.wi], out = g_.out[gb.wi], per_split = g_.per_split[gb.wi];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int64_t row0 = gb.rb * kRowsPerBlock + int64_t(warp) * kMT * 16;
  const int64_t u_begin = gb.split * per_split;
  const int64_t u_end = u_begin + per_split < nunits ? u_begin + per_split : nunits;

  const uint8_t* rows[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t r = row0 + 16 * mt + 8 * h + g;
      rows[mt][h] = w + (r < out ? r : out - 1) * row_bytes;  // clamp: ragged last tile
    }

  float acc[kMT][NT][4];
  zero(acc);
  constexpr int kU = F::kU;
  for (int64_t u0 = u_begin; u0 < u_end; u0 += kU) {
    typename F::Raw raw[kU][kMT][2];
#pragma unroll
    for (int i = 0; i < kU; ++i)
      if (u0 + i < u_end) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h) raw[i][mt][h] = F::load(rows[mt][h], u0 + i, t);
      }
#pragma unroll
    for (int i = 0; i < kU; ++i)
      if (u0 + i < u_end) F::template compute<NT>(raw[i], u0 + i, xf, xs, lane, n, acc);
  }

  // Where this block's partials go, located again: nothing of it stays live across the loop.
  const GroupBlock ge = locate(g_);
  const int64_t out_e = g_.out[ge.wi], row0_e = ge.rb * kRowsPerBlock + int64_t(warp) * kMT * 16;
  float* o = g_.dst[ge.wi] + ge.split * n * out_e;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int64_t r = row0_e + 16 * mt + g + 8 * (c >> 1);
        const int col = 8 * nt + 2 * t + (c & 1);
        if (r < out_e && col < n) o[int64_t(col) * out_e + r] = acc[mt][nt][c];
      }
}

// Splits of the reduction dimension for a weight of `out` rows and `nunits` units, on `sms`
// multiprocessors: as many as fit ONE wave of kBlocksPerSM blocks per multiprocessor (rounded DOWN:
// one block over a wave would cost a whole second pass of a latency-bound block, e.g. 136 row
// blocks x 4 splits = 544 blocks on 528 slots ran as two waves), at least 4 units per split.
// Depends on the weight shape and the device only (never on n or on the weights it is grouped
// with), so every row of x sees the same arithmetic whatever the width or grouping of the call.
inline int64_t units_per_split(int64_t out, int64_t nunits, int64_t sms) {
  const int64_t row_blocks = (out + kRowsPerBlock - 1) / kRowsPerBlock;
  const int64_t want = kBlocksPerSM * sms;
  const int64_t splits = std::max<int64_t>(1, std::min<int64_t>(want / row_blocks, nunits / 4));
  int64_t per = (nunits + splits - 1) / splits;
  return std::max<int64_t>(per, 1);
}

// Sums of the split partials of a group (the weights with more than one split): element e of the
// flat range is element e - elem0[i] of weight i; y = split 0 + split 1 + ... (fixed order).
struct SplitSums {
  int count = 0;
  const float* part[kMaxGroup] = {};
  float* y[kMaxGroup] = {};
  int splits[kMaxGroup] = {};
  int64_t elem0[kMaxGroup + 1] = {};
};

// Element e (< elem0[count]) of the flat range of a SplitSums: split 0 + split 1 + ... in order.
__host__ __device__ inline void sum_splits_at(const SplitSums& s_, int64_t e) {
  int i = 0;
  for (int k = 1; k < kMaxGroup; ++k)
    if (k < s_.count && e >= s_.elem0[k]) i = k;
  const int64_t j = e - s_.elem0[i], count = s_.elem0[i + 1] - s_.elem0[i];
  const float* part = s_.part[i];
  float v = part[j];
  for (int k = 1; k < s_.splits[i]; ++k) v += part[int64_t(k) * count + j];  // plain adds: nothing to contract
  s_.y[i][j] = v;
}

// One weight of a grouped launch: its bytes, row bytes and rows, and its output y [n, out] (F32).
struct GroupWeight {
  const uint8_t* w;
  int64_t row_bytes, out;
  float* y;
};

// The launch plan of weights ws[0 .. count) (count <= kMaxGroup; format units of `unit_elems`
// inputs) against n rows of x on `sms` multiprocessors: the kernel's Group (each weight's split,
// its flat blocks) and the SplitSums of the weights with several splits, whose partials go to
// scratch(bytes) buffers (the caller keeps them alive until the sums ran). Shared by the launch and
// the host emulation.
template <class Scratch>
inline void plan_group(const GroupWeight* ws, int count, int64_t in, int unit_elems, int n, int64_t sms,
                       const Scratch& scratch, Group& grp, SplitSums& sums) {
  const int64_t nunits = in / unit_elems;
  grp = Group{};
  sums = SplitSums{};
  grp.count = count;
  for (int i = 0; i < count; ++i) {
    const GroupWeight& wt = ws[i];
    const int64_t per = units_per_split(wt.out, nunits, sms);
    const int64_t splits = (nunits + per - 1) / per, row_blocks = (wt.out + kRowsPerBlock - 1) / kRowsPerBlock;
    grp.w[i] = wt.w, grp.row_bytes[i] = wt.row_bytes, grp.out[i] = wt.out, grp.per_split[i] = per;
    grp.dst[i] = wt.y;
    if (splits > 1) {
      grp.dst[i] = scratch(size_t(splits * n * wt.out) * sizeof(float));
      sums.part[sums.count] = grp.dst[i], sums.y[sums.count] = wt.y, sums.splits[sums.count] = int(splits);
      sums.elem0[sums.count + 1] = sums.elem0[sums.count] + int64_t(n) * wt.out;
      ++sums.count;
    }
    grp.block0[i + 1] = grp.block0[i] + row_blocks * splits;
  }
}

#ifndef SPECD_HOST_EMU
__global__ void sum_splits_kernel(const SplitSums s_) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e < s_.elem0[s_.count]) sum_splits_at(s_, e);
}

// One launch of weights ws[0 .. count) (all of format F, count <= kMaxGroup) against the split x,
// then one launch summing the split partials of those with several splits.
template <class F, int NT>
void launch(const GroupWeight* ws, int count, int64_t in, const uint2* xf, const float* xs, int n, cudaStream_t s) {
  const int64_t nunits = in / F::kUnitElems;
  Group grp;
  SplitSums sums;
  std::vector<std::shared_ptr<void>> scratch;  // freed stream-ordered, after the kernels below
  plan_group(ws, count, in, F::kUnitElems, n, sm_count(), [&](size_t bytes) {
    scratch.push_back(alloc(bytes));
    return static_cast<float*>(scratch.back().get());
  }, grp, sums);
  SPECD_CHECK(grp.block0[count] <= 0x7fffffff, "matmul: too many blocks for one GEMV launch");
  mma_gemv_kernel<F, NT><<<unsigned(grp.block0[count]), kWarps * 32, 0, s>>>(grp, nunits, xf, xs, n);
  SPECD_GPU_CHECK_LAUNCH("mma_gemv_kernel");
  if (sums.count > 0) {
    const int64_t total = sums.elem0[sums.count];
    sum_splits_kernel<<<unsigned((total + 255) / 256), 256, 0, s>>>(sums);
    SPECD_GPU_CHECK_LAUNCH("sum_splits_kernel");
  }
}

// Whether the tensor-core GEMV handles weight format t.
inline bool handles(DType t) {
  return t == DType::Q8_0 || t == DType::Q4_K || t == DType::Q5_K || t == DType::Q6_K || t == DType::IQ4_XS;
}

// One weight of a tensor-core GEMV call: the grouped launch's view of it and its format.
struct Weight {
  GroupWeight g;
  DType t;
};

// y_i[n, out_i] = x[n, in] @ w_i^T for every weight (1 <= n <= 16, x rows 16-byte aligned,
// in % 32 == 0, every format handled): x is split once, then each format's weights (up to
// kMaxGroup per launch) run as one grouped launch.
inline void gemv(const Weight* ws, int count, int64_t in, const float* x, int n) {
  cudaStream_t s = stream();
  const int NT = n <= 8 ? 1 : 2;
  const int64_t nblk = in / 32;
  const size_t xf_bytes = size_t(nblk * 2 * NT * 2 * 32) * sizeof(uint2);
  const size_t xs_bytes = size_t(nblk * kXCols * 2) * sizeof(float);
  std::shared_ptr<void> scratch = alloc(xf_bytes + xs_bytes);  // freed stream-ordered
  uint2* xf = static_cast<uint2*>(scratch.get());
  float* xs = reinterpret_cast<float*>(static_cast<uint8_t*>(scratch.get()) + xf_bytes);  // 16-byte aligned
  const int64_t threads = nblk * NT * 8;
  split_x_kernel<<<unsigned((threads + 127) / 128), 128, 0, s>>>(x, in, n, nblk, NT, xf, xs);
  SPECD_GPU_CHECK_LAUNCH("split_x_kernel");
  std::vector<bool> done(size_t(count), false);
  for (int i = 0; i < count; ++i) {
    if (done[size_t(i)]) continue;
    GroupWeight batch[kMaxGroup];
    int m = 0;
    for (int j = i; j < count && m < kMaxGroup; ++j)  // this format's weights not yet launched
      if (!done[size_t(j)] && ws[j].t == ws[i].t) {
        batch[m++] = ws[j].g;
        done[size_t(j)] = true;
      }
    auto go = [&](auto nt) {
      constexpr int kNT = decltype(nt)::value;
      switch (ws[i].t) {
        case DType::Q8_0: return launch<Q8U, kNT>(batch, m, in, xf, xs, n, s);
        case DType::Q4_K: return launch<QK45U<false>, kNT>(batch, m, in, xf, xs, n, s);
        case DType::Q5_K: return launch<QK45U<true>, kNT>(batch, m, in, xf, xs, n, s);
        case DType::Q6_K: return launch<Q6U, kNT>(batch, m, in, xf, xs, n, s);
        case DType::IQ4_XS: return launch<IQ4U, kNT>(batch, m, in, xf, xs, n, s);
        default: fail("matmul: no tensor-core GEMV for ", dtype_info(ws[i].t).name);
      }
    };
    if (NT == 1)
      go(std::integral_constant<int, 1>());
    else
      go(std::integral_constant<int, 2>());
  }
}

#endif  // SPECD_HOST_EMU

}  // namespace specd::gpu::detail::mma
#endif  // SPECD_MMA_GEMV
