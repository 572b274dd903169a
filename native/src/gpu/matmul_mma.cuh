// Integer tensor-core GEMV of the quantized weight formats (Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS, and
// IQ4_XS_TILED / Q4_K_TILED / Q5_K_TILED / Q6_K_TILED: those formats in this GEMV's 16-row tiles, IQ4T / Q4T /
// Q5T / Q6T below), and of BF16 weights on bf16 tensor cores (BF16U), for n <= 16 rows of x:
// y[n, out] = x[n, in] @ w[out, in]^T; each call is split_x, the grouped GEMV (a programmatic
// dependent of split_x, as every kernel: pdl.cuh; it loads its first weight units before pdl_wait) and
// the split-K sums. Included by matmul.cu (see its header for
// the exactness and batch-invariance arguments). NVIDIA only (mma.sync inline PTX, sm_80+):
// SPECD_MMA_GEMV is 0 on HIP, where the FP32-FMA GEMV (gemv_fma.cuh) serves every format.
//
// Why integers: a decode step streams every weight byte once, so the kernel must spend few
// instructions per byte (the H200 issues ~1000 warp instructions per SM in the time its memory
// delivers 4 KB to that SM). The weights' integer quants go to mma.sync m16n8k32 s8 x s8 -> s32 as
// they come out of the bytes (IQ4_XS: its table lookup IS the A fragment, no float conversion), x is
// split once per call into three int8 terms, sums are exact integers, and the per-sub-block integer
// scales are applied with one IMAD per accumulator; floats appear once per 256-input super-block.
//
// Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k32", .s8; lane = 4 g + t):
//   A (16 x 32, weights: rows = output rows, k = inputs), 4 registers of 4 bytes: reg0 = (row g,
//     k 4t..4t+3), reg1 = (row g+8, k 4t..), reg2 = (row g, k 16+4t..), reg3 = (row g+8, k 16+4t..).
//   B (32 x 8, x terms: k = inputs, columns = term columns), 2 registers: reg0 = (k 4t..4t+3, col g),
//     reg1 = (k 16+4t.., col g).   C/D (16 x 8, s32): c0, c1 = (row g, col 2t, 2t+1), c2, c3 = row g+8.
// k order (A and B alike; a dot product is order-free within one MMA): in the k32 step of a
// 32-input sub-block, lane t's k = 4t..4t+3 hold the physical inputs 4t, 4t+16, 4t+1, 4t+17 and
// k = 16+4t..16+4t+3 hold 4t+2, 4t+18, 4t+3, 4t+19: the order in which IQ4_XS's nibbles come out of
// a word of its quants (byte i of qs[16 j + 4t ..]: low nibble = input 4t+i, high = 16+4t+i), so that
// format needs no reordering; the byte-per-weight formats reorder with one byte permute per register.
//
// BF16 weights (BF16U, below) run in the same kernel on x split into three BF16 terms instead
// (split_x_bf16_kernel), with m16n8k16 bf16 -> f32 MMAs.
//
// x (split_x_kernel): per row r of x and 256-input group (the last one ragged for Q8_0 with
// in % 256 != 0), with m = max |x| over the group in [2^E, 2^(E+1)), x' = x * 2^k, k = 19 - E
// (exact; clamped to <= 126), |x'| < 2^20, and three int8 terms in [-64, 64]:
//   hi = rint(x' / 2^14), mid = rint((x' - 2^14 hi) / 2^7), lo = rint(x' - 2^14 hi - 2^7 mid)
// (each difference exact in F32), |x - 2^-k (2^14 hi + 2^7 mid + lo)| <= 2^-20 max(m, 2^-100) (the clamp
// and subnormal d * 2^-k products set the floor: groups whose maximum is below ~1e-30). Term tau of row r
// is B column 3 r + tau (n8 tile (3r + tau) / 8), with the column scale 2^-k * {2^14, 2^7, 1}: 48
// columns for n = 16. A group holding inf / NaN gets zero terms and NaN column scales, so the
// row's results are non-finite, as on the CPU.
#pragma once

#if !SPECD_HIP
#define SPECD_MMA_GEMV 1
#else
#define SPECD_MMA_GEMV 0
#endif

#if SPECD_MMA_GEMV
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#ifndef SPECD_HOST_EMU
#include "common.cuh"
#include "specd/gpu.h"  // alloc: the launches' scratch
#endif
#include "partials.cuh"
#include "pdl.cuh"
#include "weight_formats.cuh"

namespace specd::gpu::detail::mma {

constexpr int kWarps = 4;                   // warps per block; warp w owns output rows 16 w .. 16 w + 15
constexpr int kRowsPerBlock = kWarps * 16;
// Tuning constants: tools/device/gemv_sweep.sh compiles variants of this header with -D overrides
// and times them on the GPU (BENCHMARKS.md); the defaults are the measured best.
#ifndef SPECD_MMA_SPLIT_BLOCKS
#define SPECD_MMA_SPLIT_BLOCKS 16  // blocks per SM the split-K sizing aims at (units_per_split)
#endif
#ifndef SPECD_MMA_SPLIT_UNITS
#define SPECD_MMA_SPLIT_UNITS 4  // fewest units per split (units_per_split)
#endif
#ifndef SPECD_MMA_L2_AHEAD
#define SPECD_MMA_L2_AHEAD 2  // tiled formats without a register ring: units ahead each warp asks L2 for (0: none; gemv_block)
#endif
#ifndef SPECD_MMA_SPLIT_WAVES
#define SPECD_MMA_SPLIT_WAVES 1  // 1: splits sized by the waves they fill (units_per_split); 0: the fewest-units rule alone
#endif
#ifndef SPECD_MMA_SPLIT_MAX_INPUTS
#define SPECD_MMA_SPLIT_MAX_INPUTS 2048  // longest split the wave rule takes, in inputs (units_per_split)
#endif
#ifndef SPECD_MMA_LOADS_ONLY
#define SPECD_MMA_LOADS_ONLY 0  // sweep diagnostic: load every unit, skip its arithmetic (wrong results)
#endif
#ifndef SPECD_MMA_RING_REGS
#define SPECD_MMA_RING_REGS 64  // registers for weight words in flight per thread at 1 tile (units_ahead)
#endif
#ifndef SPECD_MMA_MAX_AHEAD
#define SPECD_MMA_MAX_AHEAD 4  // most units loading ahead (units_ahead)
#endif
#ifndef SPECD_MMA_Q6_X4_TILES
#define SPECD_MMA_Q6_X4_TILES 3  // Q6_K's quants built as 4 (q - 32) at up to this many n8 tiles (Q6U::unit): the same
                                 // results; 0 never, 6 always. H200 (BENCHMARKS.md, 2026-12-04 15:58 UTC): -5 % at one
                                 // tile (decode), up to -9 % at three, slower at six
#endif
#ifndef SPECD_MMA_X_AHEAD
#define SPECD_MMA_X_AHEAD 1  // 1: the tiled formats' 1-tile instances load the next unit's x ahead (x_ahead, XUnit)
#endif
#ifndef SPECD_MMA_X_RING_REGS
#define SPECD_MMA_X_RING_REGS 56  // SPECD_MMA_RING_REGS of the x_ahead instances (their x: 2 x 18-19 registers)
#endif
#ifndef SPECD_MMA_MIN_BLOCKS
#define SPECD_MMA_MIN_BLOCKS 4  // resident blocks per SM the 1-tile instances are compiled for (min_blocks)
#endif
// Tiled IQ4_XS's own (min_blocks, units_ahead): its 2-tile instance (3-5 rows of x), its 3- and 4-tile ones (6-10).
#ifndef SPECD_MMA_IQ4T_BLOCKS_2
#define SPECD_MMA_IQ4T_BLOCKS_2 6
#endif
#ifndef SPECD_MMA_IQ4T_RING_2
#define SPECD_MMA_IQ4T_RING_2 0
#endif
#ifndef SPECD_MMA_IQ4T_BLOCKS_34
#define SPECD_MMA_IQ4T_BLOCKS_34 4
#endif
#ifndef SPECD_MMA_IQ4T_RING_34
#define SPECD_MMA_IQ4T_RING_34 0
#endif
constexpr int kBlocksPerSM = SPECD_MMA_SPLIT_BLOCKS;
static_assert(kBlocksPerSM >= 1, "SPECD_MMA_SPLIT_BLOCKS: at least one block per multiprocessor");
static_assert(SPECD_MMA_SPLIT_UNITS >= 1, "SPECD_MMA_SPLIT_UNITS: at least one unit per split");
constexpr int kTerms = 3;                   // int8 terms per x value
constexpr int kMaxTiles = 6;                // n8 tiles of term columns for n = 16 (48 columns)
constexpr int kMaxCols = 8 * kMaxTiles;
constexpr int kGroup = 256;                 // inputs sharing one power-of-two x scale
// Most units (of any format) one GEMV reduces over: the kernel's unit indices and some offsets from them are 32-bit
// products (XUnit::load: u * 1536 B fragments, RowSource::prefetch: u * a tiled unit's <= 3360 bytes).
constexpr int64_t kMaxUnits = 600000;

// n8 tiles of term columns a call of n rows of x runs (3 n columns): the kernel instance NT. One
// instance per tile count, so no tile is all padding: a run-time skip of dead tiles put a branch and
// a convergence barrier around every MMA and cost 3x at n = 8 (H200, tools/device/gemv_sweep.sh).
__host__ __device__ constexpr int tiles_for(int n) { return (3 * n + 7) / 8; }

// f(std::integral_constant<int, NT>()) for the instance of n rows of x (1 <= n <= 16).
template <class Fn>
decltype(auto) with_tiles(int n, const Fn& f) {
  switch (tiles_for(n)) {
    case 1: return f(std::integral_constant<int, 1>());
    case 2: return f(std::integral_constant<int, 2>());
    case 3: return f(std::integral_constant<int, 3>());
    case 4: return f(std::integral_constant<int, 4>());
    case 5: return f(std::integral_constant<int, 5>());
    default: return f(std::integral_constant<int, 6>());
  }
}

// byte permutes of two words w0 (inputs 4t..4t+3 of a sub-block) and w1 (inputs 16+4t..) of
// byte-per-weight quants into the k order above: register 0 / register 1 of the lane's row.
constexpr uint32_t kPairLo = 0x5140u, kPairHi = 0x7362u;

// --- tensor-core instructions -----------------------------------------------------------------

// d = a * b, mma.sync m16n8k32 s8 x s8 -> s32 (C = 0): exact integer products and sums.
__device__ __forceinline__ void imma(int (&d)[4], const uint32_t (&a)[4], uint2 b) {
#if defined(SPECD_HOST_EMU)
  specd_emu_imma(d, a, b);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %10, %10, %10};\n"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y), "r"(0));
#else
  __trap();  // never launched below sm_80 (the build targets sm_90)
#endif
}

// d = a * b, mma.sync m16n8k16 f16 x f16 -> f32 (C = 0), with b's second register zero. Used for the
// Q4_K / Q5_K min terms, whose operands are small integers (exact in f16, sums exact in F32).
// Layout: A reg0 = (row g, k 2t, 2t+1), reg1 = (row g+8, k 2t, 2t+1), reg2/3 = k + 8; B reg0 =
// (k 2t, 2t+1, col g); the lower 16 bits hold the lower k.
__device__ __forceinline__ void hmma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0) {
#if defined(SPECD_HOST_EMU)
  d[0] = d[1] = d[2] = d[3] = 0.0f;
  specd_emu_mma(d, a, make_uint2(b0, 0u));
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const float z = 0.0f;
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %10, %10, %10};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(0u), "f"(z));
#else
  __trap();
#endif
}

// d += a * b, mma.sync m16n8k16 bf16 x bf16 -> f32 (C = d): the BF16 weights' GEMV (BF16U). Products
// are exact (8 x 8 significant bits); the tensor core accumulates them and d in F32 (its internal
// alignment and rounding are not an IEEE add per product). Layouts as hmma's.
__device__ __forceinline__ void bmma(float (&d)[4], const uint32_t (&a)[4], uint2 b) {
#if defined(SPECD_HOST_EMU)
  specd_emu_mma_bf16(d, a, b);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y));
#else
  __trap();
#endif
}

// --- small helpers ----------------------------------------------------------------------------

// PTX prmt.b32 in its default mode: byte i of the result = byte (sel nibble i & 7) of {b, a}, or
// that byte's sign replicated when the nibble's bit 3 is set; only the low 16 bits of sel count.
// __byte_perm documents 3-bit selectors, so nvcc masks every selector it cannot prove clean (an
// extra instruction per permute); the callers here pass selectors with bit 3 clear, except
// IQ4TableRecoded and sbyte, which use the sign mode.
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
#if defined(SPECD_HOST_EMU)
  return __byte_perm(a, b, sel & 0xffffu);
#else
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
#endif
}

// A weight load (each weight byte is read once per call). Loads that skip L1 (ld.global.nc.L1::no_allocate) were
// measured three times on the H200 and not kept (BENCHMARKS.md, 2026-11-30 19:07, 2026-12-01 23:37, 2026-12-02 22:45).
template <class T>
__device__ __forceinline__ T ldw(const uint8_t* p) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8 || sizeof(T) == 16, "ldw: 4, 8 or 16 bytes");
  return *reinterpret_cast<const T*>(p);
}

// Byte i (0..3) of v, unsigned.
__device__ __forceinline__ int ubyte(uint32_t v, int i) { return int(prmt(v, 0u, 0x4440u | uint32_t(i))); }
// Byte i (0..3) of v as a signed int8: byte i, then its sign replicated (one PRMT for a constant i; the
// shift and sign extension of int8_t(v >> 8 i) take two instructions for i = 1, 2).
__device__ __forceinline__ int sbyte(uint32_t v, int i) { return int(prmt(v, 0u, 0x8880u | 0x1111u * uint32_t(i))); }

// Exact float of an integer with |v| < 2^22 (magic-number trick: two full-rate instructions instead
// of the quarter-rate converter).
__device__ __forceinline__ float small_int_to_float(int v) {
  return __fsub_rn(__int_as_float(0x4B400000 + v), 12582912.0f);
}

// The IQ4_XS table (kvalues, int8) as byte-permute operands: entries 0-3, 4-7, 8-11, 12-15. The
// permutes take the first of each pair from a register. Written as constants, ptxas keeps them in
// uniform registers and copies one into a register before every permute (one instruction each, 14 %
// of the kernel's); built with a lane-dependent selector that picks the same bytes on every lane
// (bytes 0-3 or 4-7 of {c, c}), they are ordinary registers it keeps.
struct IQ4Table {
  uint32_t t0, t2;
  static constexpr uint32_t t1 = 0xF6EADDCFu, t3 = 0x71594535u;
  __device__ __forceinline__ explicit IQ4Table(int lane) {
    const uint32_t sel = 0x3210u + 0x4444u * uint32_t(lane & 1);
    t0 = prmt(0xBFAD9881u, 0xBFAD9881u, sel), t2 = prmt(0x26190D01u, 0x26190D01u, sel);
  }
  // The 8 nibbles of w -> their int8 table values in nibble order (byte i of .x = value of nibble
  // i, of .y = nibble 4 + i). Each 3-bit index selects from entries 0-7 and 8-15, bit 3 then picks
  // between the two: 12 instructions for 8 weights (sm_90 SASS: 6 PRMT, 3 LOP3, 3 SHF).
  __device__ __forceinline__ uint2 lookup8(uint32_t w) const {
    const uint32_t s = w & 0x77777777u;
    const uint32_t pick = ((w >> 1) & 0x44444444u) | 0x32103210u;
    const uint32_t lo0 = prmt(t0, t1, s), hi0 = prmt(t2, t3, s);
    const uint32_t lo1 = prmt(t0, t1, s >> 16), hi1 = prmt(t2, t3, s >> 16);
    return make_uint2(prmt(lo0, hi0, pick), prmt(lo1, hi1, pick >> 16));
  }
};

// The same table for IQ4_XS_TILED's recoded indices (iq4_tile_recode: bits 2 and 3 of each stored
// index swapped, so stored index c holds kvalues[pi(c)], pi that swap). Recoded, entries j and j + 8
// have the same sign for every j < 8 (j < 4: both negative, else both positive), which lets prmt's
// sign mode (selector bit 3) do the select between the halves: with U = entries 0-7 and V[j] = entry
// j + 8 XOR (0xFF where U[j] < 0), so every V[j] is >= 0, value(c) = prmt(U, c) ^ prmt(V, c ^ 8): index
// j < 8 gives U[j] ^ sign(V[j]) = U[j]; index j + 8 gives sign(U[j]) ^ V[j] = entry j + 8. 9 instructions
// for 8 weights (4 PRMT, 3 LOP3, 2 SHF) instead of IQ4Table's 12, the same int8 values: the width-1
// GEMV's unit loop is 13 % shorter. u0 and v0 (the permutes' first operands) are built as IQ4Table's
// t0 / t2 so they stay in ordinary registers; u1 and v1 are PRMT immediates.
struct IQ4TableRecoded {
  uint32_t u0, v0;
  static constexpr uint32_t u1 = 0x26190D01u, v1 = 0x71594535u;  // entries 4-7: 1 13 25 38; V 4-7: 53 69 89 113
  __device__ __forceinline__ explicit IQ4TableRecoded(int lane) {
    const uint32_t sel = 0x3210u + 0x4444u * uint32_t(lane & 1);
    u0 = prmt(0xBFAD9881u, 0xBFAD9881u, sel);  // entries 0-3: -127 -104 -83 -65
    v0 = prmt(0x09152230u, 0x09152230u, sel);  // V 0-3: ~(-49 -35 -22 -10) = 48 34 21 9
  }
  // The 8 recoded nibbles of w -> their int8 values, in lookup8's order (byte i of .x = nibble i,
  // of .y = nibble 4 + i).
  __device__ __forceinline__ uint2 lookup8(uint32_t w) const {
    const uint32_t wx = w ^ 0x88888888u;
    return make_uint2(prmt(u0, u1, w) ^ prmt(v0, v1, wx), prmt(u0, u1, w >> 16) ^ prmt(v0, v1, wx >> 16));
  }
};

// The views of the split x a kernel reads (see split_x_kernel for the layouts).
struct XView {
  const uint2* __restrict__ xb;     // [in / 32][kMaxTiles][32] B fragments of the terms
  const float* __restrict__ xs;     // [groups][kMaxCols] column scales
  const uint32_t* __restrict__ xm;  // [groups][kMaxTiles][32] f16x2 sub-block sums of the terms
  int cols;                         // 3 n: live term columns
  int lane;
  const uint4* __restrict__ xh = nullptr;  // BF16U only: [in / 32][kMaxTiles][32] BF16 terms (split_x_bf16_kernel)
  __device__ __forceinline__ bool live(int nt) const { return 8 * nt + (lane >> 2) < cols; }
  // B fragment of n8 tile nt for k32 step `kstep` (sub-block of 32 inputs); lanes of padding
  // columns feed zeros (and skip the load).
  __device__ __forceinline__ uint2 b(int64_t kstep, int nt) const {
    return live(nt) ? __ldg(xb + (kstep * kMaxTiles + nt) * 32 + lane) : make_uint2(0u, 0u);
  }
  // The scales of the lane's columns 8 nt + 2t, + 1 in group grp.
  __device__ __forceinline__ float2 scale(int64_t grp, int nt) const {
    return *reinterpret_cast<const float2*>(xs + grp * kMaxCols + 8 * nt + 2 * (lane & 3));
  }
  __device__ __forceinline__ uint32_t mins(int64_t grp, int nt) const {
    return live(nt) ? __ldg(xm + (grp * kMaxTiles + nt) * 32 + lane) : 0u;
  }
  // BF16U: the lane's 8 BF16 term values of n8 tile nt in 32-input chunk kc (zeros for padding columns).
  __device__ __forceinline__ uint4 h(int64_t kc, int nt) const {
    return live(nt) ? __ldg(xh + (kc * kMaxTiles + nt) * 32 + lane) : make_uint4(0u, 0u, 0u, 0u);
  }
};

// A lane's pointers into the split x: XView's arrays with the lane's offsets folded in, indexed by 32-bit unit
// numbers (XUnit's loads; with XView's 64-bit indices and per-lane predicates, and the kernel's 64-bit unit loop,
// tiled IQ4_XS's one-tile loop took ~30 instructions more a unit: 338 against 309, sm_90 SASS).
struct XLane {
  const uint2* __restrict__ xb;
  const float* __restrict__ xs;
  const uint32_t* __restrict__ xm;
  __device__ __forceinline__ explicit XLane(const XView& v)
      : xb(v.xb + v.lane), xs(v.xs + 2 * (v.lane & 3)), xm(v.xm + v.lane) {}
};

// What one 256-input unit u reads of the split x (k32 steps 8 u .. 8 u + 7, group u, n8 tiles 0 .. NT - 1),
// held in registers: the kernel loads the next unit's while it computes this one (x_ahead), so the unit's
// MMAs and its float step do not wait on x's L1 / L2 round trip. A format that reads no sub-block sums
// leaves m unread, and ptxas drops its loads (the SASS is the same without them).
template <int NT>
struct XUnit {
  uint2 f[8][NT];  // B fragments
  float2 s[NT];    // column scales
  uint32_t m[NT];  // sub-block sums (Q4_K / Q5_K's mins)
  // XView::b / scale / mins of unit u's k32 steps and group (the same layout: split_x_kernel), except that every
  // lane loads, padding columns' lanes too: what they read only reaches the padding columns of the MMAs' outputs,
  // which store_partials never stores (the emulation poisons the split x's unwritten bytes with NaN f16 / -1 int8).
  __device__ __forceinline__ void load(const XLane& x, int u) {
    const uint2* b = x.xb + u * (8 * kMaxTiles * 32);  // 32-bit products: launch bounds nunits (kMaxUnits)
    const float* sc = x.xs + u * kMaxCols;
    const uint32_t* mn = x.xm + u * (kMaxTiles * 32);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int j = 0; j < 8; ++j) f[j][nt] = __ldg(b + (j * kMaxTiles + nt) * 32);
      s[nt] = *reinterpret_cast<const float2*>(sc + 8 * nt), m[nt] = __ldg(mn + nt * 32);
    }
  }
};
// An XView that answers from the XUnit of the unit being computed: the formats' units pass kstep = 8 u +
// a constant (so kstep & 7 is that constant and the fragments stay in registers) and grp = u.
template <int NT>
struct XUnitView : XView {
  const XUnit<NT>& xu;
  __device__ __forceinline__ XUnitView(const XView& v, const XUnit<NT>& u) : XView(v), xu(u) {}
  __device__ __forceinline__ uint2 b(int64_t kstep, int nt) const { return xu.f[kstep & 7][nt]; }
  __device__ __forceinline__ float2 scale(int64_t, int nt) const { return xu.s[nt]; }
  __device__ __forceinline__ uint32_t mins(int64_t, int nt) const { return xu.m[nt]; }
};
static_assert(kGroup == 256, "XUnit: a 256-input unit is one x group");

// One k32 step: for each of P weight fragments a[p] (same inputs, e.g. the two 16-input scale
// groups of Q6_K) and each n8 tile, acc += sc[p][row] * (a[p] . b) (integer; sc[p][h] is the scale
// of row g + 8 h).
template <int NT, int P, class X>
__device__ __forceinline__ void step(const uint32_t (&a)[P][4], const int (&sc)[P][2], int64_t kstep,
                                     const X& xv, int (&acc)[NT][4]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const uint2 b = xv.b(kstep, nt);
#pragma unroll
    for (int p = 0; p < P; ++p) {
      int d[4];
      imma(d, a[p], b);
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[nt][c] += sc[p][c >> 1] * d[c];
    }
  }
}

// End of a super-block: accf += (d_row * scale_col) * float(acc) (the product exact: scales are
// powers of two), in a fixed order.
template <int NT, class X>
__device__ __forceinline__ void finish(const int (&acc)[NT][4], int64_t grp, const float (&d)[2], const X& xv,
                                       float (&accf)[NT][4]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const float2 s = xv.scale(grp, nt);
#pragma unroll
    for (int c = 0; c < 4; ++c)
      accf[nt][c] = __fmaf_rn(__fmul_rn(d[c >> 1], (c & 1) ? s.y : s.x), float(acc[nt][c]), accf[nt][c]);
  }
}

template <int NT>
__device__ __forceinline__ void zero(int (&acc)[NT][4]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[nt][c] = 0;
}

// A fragment from the lane's two rows' registers (row g: r0, row g + 8: r1; .x = k 4t.., .y = k 16+4t..).
__device__ __forceinline__ void make_a(uint32_t (&a)[4], uint2 r0, uint2 r1) { a[0] = r0.x, a[1] = r1.x, a[2] = r0.y, a[3] = r1.y; }

// Two words of byte-per-weight quants (inputs 4t.. and 16+4t.. of a sub-block) in the k order.
__device__ __forceinline__ uint2 pair(uint32_t w0, uint32_t w1) {
  return make_uint2(prmt(w0, w1, kPairLo), prmt(w0, w1, kPairHi));
}
__device__ __forceinline__ uint2 and2(uint2 v, uint32_t m) { return make_uint2(v.x & m, v.y & m); }
__device__ __forceinline__ uint2 shr2(uint2 v, int s) { return make_uint2(v.x >> s, v.y >> s); }

// --- formats: a "unit" is one 256-input super-block (Q8_0: one 32-input block) of a row ----------
// load(row, u, t): the registers lane t needs of unit u of one row; unit<NT>(raw[2], u, xv, accf):
// the unit's contribution for the lane's two rows (g, g + 8) added to accf.

// IQ4_XS (136-byte blocks: fp16 d | u16 scales_h | u8 scales_l[4] | qs[128]): sub-block j = qs[16j ..
// 16j + 15], value (d * (ls_j - 32)) * kvalues[idx]; ls_j = scales_l nibble j | scales_h bits 2j << 4.
struct IQ4U {
  static constexpr int kUnitElems = 256;
  static constexpr bool kTiled = false;
  struct Raw {
    uint32_t q[8];  // qs[16 j + 4t ..]
    uint2 hdr;
  };
  __device__ __forceinline__ static Raw load(const uint8_t* __restrict__ row, int64_t u, int t) {
    const uint8_t* blk = row + u * 136;
    Raw r;
    r.hdr = ldw<uint2>(blk);
#pragma unroll
    for (int j = 0; j < 8; ++j) r.q[j] = ldw<uint32_t>(blk + 8 + 16 * j + 4 * t);
    return r;
  }
  // The sub-block scales ls_j - 32 as int8: byte k of .x = ls_{2k} - 32, of .y = ls_{2k+1} - 32. Bytewise, for
  // ls in [0, 64): (ls + 0x60) ^ 0x80 = ls - 32 (mod 256), and ls + 0x60 < 0x100 carries into no other byte, so
  // a word takes one add and one XOR, and each k32 step reads its scale with one sign-extending byte permute
  // (sbyte) instead of a permute and a subtraction.
  __device__ __forceinline__ static uint2 scales(uint2 hdr) {
    const uint32_t sl = hdr.y, sh = hdr.x >> 16;
    uint32_t s = (sh | (sh << 8)) & 0x00ff00ffu;  // nibble k of sh -> low nibble of byte k
    s = (s | (s << 4)) & 0x0f0f0f0fu;
    const uint32_t ev = (sl & 0x0f0f0f0fu) | ((s << 4) & 0x30303030u), od = ((sl >> 4) & 0x0f0f0f0fu) | ((s << 2) & 0x30303030u);
    return make_uint2((ev + 0x60606060u) ^ 0x80808080u, (od + 0x60606060u) ^ 0x80808080u);
  }
  // Table: IQ4Table (GGUF's indices) or IQ4TableRecoded (IQ4T's).
  template <int NT, class Table = IQ4Table, class X = XView>
  __device__ __forceinline__ static void unit(const Raw (&r)[2], int64_t u, const X& xv, float (&accf)[NT][4]) {
    const Table tab(xv.lane);
    uint2 ls[2];
    float d[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) ls[h] = scales(r[h].hdr), d[h] = specd_fp16_bits_to_float(uint16_t(r[h].hdr.x));
    int acc[NT][4];
    zero(acc);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      uint32_t a[1][4];
      make_a(a[0], tab.lookup8(r[0].q[j]), tab.lookup8(r[1].q[j]));
      int sc[1][2];
#pragma unroll
      for (int h = 0; h < 2; ++h) sc[0][h] = sbyte((j & 1) ? ls[h].y : ls[h].x, j >> 1);
      step<NT, 1>(a, sc, 8 * u + j, xv, acc);
    }
    finish(acc, u, d, xv, accf);
  }
};

// IQ4_XS in the GEMV's tiled layout (DType::IQ4_XS_TILED, made by tile_q4_kernel): rows in tiles of 16; per tile and unit
// (256 inputs) 2176 bytes: first the 16 rows' quants in lane order, 4 runs of 512 bytes, run i holding
// at 16 l the words 4 i .. 4 i + 3 of lane l = 4 g + t, whose 16 words are qs[16 j + 4 t ..] (j = 0..7)
// of row g, then of row g + 8; then the 16 rows' 8-byte headers (d, scales_h, scales_l) in row
// order. Each warp load covers 512 contiguous bytes (the row-major loads: 8 rows x 16 bytes); a
// warp's units are contiguous. The stored 4-bit indices are recoded (iq4_tile_recode: bits 2 and 3
// swapped) so that IQ4TableRecoded's lookup takes 9 instructions per 8 weights instead of IQ4Table's
// 12; it gives the same int8 values, and the rest is IQ4U's arithmetic, so results are bit-identical.
// The 2048 quant bytes of an IQ4T / Q4T tile unit at p: 4 runs of 512 bytes, run i holding at 16 lane the
// words 4 (i & 1) .. + 3 of the lane's row g + 8 (i / 2) (Raw::q, 8 words per row).
template <class Raw>
__device__ __forceinline__ void load_quant_runs(const uint8_t* __restrict__ p, int lane, Raw (&r)[2]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint4 v = ldw<uint4>(p + 512 * i + 16 * lane);
    uint32_t* q = r[i >> 1].q + 4 * (i & 1);
    q[0] = v.x, q[1] = v.y, q[2] = v.z, q[3] = v.w;
  }
}

struct IQ4T {
  static constexpr int kUnitElems = 256, kTileUnitBytes = int(kIq4TileUnitBytes);
  static constexpr bool kTiled = true;
  using Raw = IQ4U::Raw;
  // Lane `lane`'s registers of the tile unit at p: r[0] row g, r[1] row g + 8.
  __device__ __forceinline__ static void load_tile(const uint8_t* __restrict__ p, int lane, Raw (&r)[2]) {
    load_quant_runs(p, lane, r);
    const int g = lane >> 2;
    r[0].hdr = ldw<uint2>(p + 2048 + 8 * g);
    r[1].hdr = ldw<uint2>(p + 2048 + 8 * (g + 8));
  }
  template <int NT, class X = XView>
  __device__ __forceinline__ static void unit(const Raw (&r)[2], int64_t u, const X& xv, float (&accf)[NT][4]) {
    IQ4U::unit<NT, IQ4TableRecoded>(r, u, xv, accf);
  }
};

// Q4_K / Q5_K (144 / 176-byte blocks: fp16 d | fp16 dmin | scales[12] | (Q5_K: qh[32]) | qs[128]):
// sub-block pair p = qs[32p + l] (l = 0..31), low nibbles sub-block 2p, high 2p + 1; Q5_K's fifth bit
// of sub-block j, input l = bit j of qh[l]. Value d * sc_j * q - dmin * m_j, so a super-block adds
// d * sum_j sc_j (q . x)_j - dmin * sum_j m_j * sum(x over sub-block j): the first with integer MMAs
// and IMADs, the second with one f16 MMA of the 8 m_j against the terms' sub-block sums (xm).
template <bool kQ5>
struct QK45U {
  static constexpr int kUnitElems = 256;
  static constexpr bool kTiled = false;
  static constexpr int kBlock = kQ5 ? 176 : 144, kQs = kQ5 ? 48 : 16;
  struct Raw {
    uint4 hdr;
    uint32_t q[8];               // q[2p + s] = qs[32p + 16s + 4t ..]
    uint32_t h[kQ5 ? 2 : 1];     // Q5_K: qh[4t ..], qh[16 + 4t ..]
    static constexpr int kWords = int(sizeof(hdr) + sizeof(q) + sizeof(h)) / 4;  // without the padding (RawWords)
  };
  __device__ __forceinline__ static Raw load(const uint8_t* __restrict__ row, int64_t u, int t) {
    const uint8_t* blk = row + u * kBlock;
    Raw r;
    r.hdr = ldw<uint4>(blk);
#pragma unroll
    for (int i = 0; i < 8; ++i) r.q[i] = ldw<uint32_t>(blk + kQs + 16 * i + 4 * t);
    if constexpr (kQ5) {
      r.h[0] = ldw<uint32_t>(blk + 16 + 4 * t);
      r.h[1] = ldw<uint32_t>(blk + 32 + 4 * t);
    } else {
      r.h[0] = 0;
    }
    return r;
  }
  // Scales (.x: bytes j = 0..3, .y: j = 4..7) and mins of the 12 packed bytes s0 | s1 | s2 (ggml
  // get_scale_min_k4, four at a time).
  __device__ __forceinline__ static void scales_mins(uint4 hdr, uint2& sc, uint2& mn) {
    const uint32_t s0 = hdr.y, s1 = hdr.z, s2 = hdr.w;
    sc = make_uint2(s0 & 0x3f3f3f3fu, (s2 & 0x0f0f0f0fu) | ((s0 >> 2) & 0x30303030u));
    mn = make_uint2(s1 & 0x3f3f3f3fu, ((s2 >> 4) & 0x0f0f0f0fu) | ((s1 >> 2) & 0x30303030u));
  }
  template <int NT, class X = XView>
  __device__ __forceinline__ static void unit(const Raw (&r)[2], int64_t u, const X& xv, float (&accf)[NT][4]) {
    const int t = xv.lane & 3;
    uint2 sc[2];
    uint32_t am[4] = {0u, 0u, 0u, 0u};  // A of the min MMA: m_{2t}, m_{2t+1} of rows g, g + 8 (f16)
    float d[2], dmin[2];
    uint2 hb[2] = {};  // Q5_K: the fifth bits in the k order
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint2 mn;
      scales_mins(r[h].hdr, sc[h], mn);
      // f16 bits 0x6400 | m = 1024 + m, exact; minus 1024 (HSUB2) = m.
      const uint32_t v = prmt(t < 2 ? mn.x : mn.y, 0x64646464u, 0x4040u | uint32_t(2 * (t & 1)) |
                                                                     (uint32_t(2 * (t & 1) + 1) << 8));
      const uint32_t bias = 0x64006400u;
      __half2 m2 = __hsub2(*reinterpret_cast<const __half2*>(&v), *reinterpret_cast<const __half2*>(&bias));
      am[h] = *reinterpret_cast<uint32_t*>(&m2);
      d[h] = specd_fp16_bits_to_float(uint16_t(r[h].hdr.x));
      dmin[h] = specd_fp16_bits_to_float(uint16_t(r[h].hdr.x >> 16));
      if constexpr (kQ5) hb[h] = pair(r[h].h[0], r[h].h[1]);
    }
    int acc[NT][4];
    zero(acc);
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const uint2 w0 = pair(r[0].q[2 * p], r[0].q[2 * p + 1]), w1 = pair(r[1].q[2 * p], r[1].q[2 * p + 1]);
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        const int j = 2 * p + hi;
        uint2 q0 = and2(shr2(w0, 4 * hi), 0x0f0f0f0fu), q1 = and2(shr2(w1, 4 * hi), 0x0f0f0f0fu);
        if constexpr (kQ5) {
          const uint2 f0 = and2(shr2(hb[0], j), 0x01010101u), f1 = and2(shr2(hb[1], j), 0x01010101u);
          q0 = make_uint2(q0.x | (f0.x << 4), q0.y | (f0.y << 4));
          q1 = make_uint2(q1.x | (f1.x << 4), q1.y | (f1.y << 4));
        }
        uint32_t a[1][4];
        make_a(a[0], q0, q1);
        int s[1][2];
#pragma unroll
        for (int h = 0; h < 2; ++h) s[0][h] = ubyte(j < 4 ? sc[h].x : sc[h].y, j & 3);
        step<NT, 1>(a, s, 8 * u + j, xv, acc);
      }
    }
    // accf += (d * scale) * acc - (dmin * scale) * (m . sub-block sums). The two parts can nearly
    // cancel (the weights d sc q - dmin m much smaller than either), so their difference is formed
    // with one rounding: p + e = (dmin * scale) * mins exactly, then fma(d * scale, acc, -p) - e.
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const float2 s = xv.scale(u, nt);
      float mp[4];
      hmma(mp, am, xv.mins(u, nt));
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float sc_col = (c & 1) ? s.y : s.x;
        const float dm = __fmul_rn(dmin[c >> 1], sc_col), p = __fmul_rn(dm, mp[c]);
        const float e = __fmaf_rn(dm, mp[c], -p);
        const float v = __fsub_rn(__fmaf_rn(__fmul_rn(d[c >> 1], sc_col), float(acc[nt][c]), -p), e);
        accf[nt][c] = __fadd_rn(accf[nt][c], v);
      }
    }
  }
};

// Q6_K (210-byte blocks, 2-byte aligned: ql[128] | qh[64] | int8 scales[16] | fp16 d): half n
// (inputs 128n ..), sub-block g4 (inputs 128n + 32 g4 + l, l = 0..31): low 4 bits = nibble g4 >> 1 of
// ql[64n + 32 (g4 & 1) + l], high 2 bits = bits 2 g4 of qh[32n + l], value d * sc[8n + 2 g4 + l / 16] *
// (q - 32). The two 16-input scale groups of a sub-block are two MMAs of the same B (bytes 0, 2 of
// each register hold inputs < 16 in the k order, bytes 1, 3 inputs >= 16).
struct Q6U {
  static constexpr int kUnitElems = 256;
  static constexpr bool kTiled = false;
  struct Raw {
    uint32_t ql[8];  // ql[64n + 32c + 16s + 4t ..] at 4n + 2c + s
    uint32_t qh[4];  // qh[32n + 16s + 4t ..] at 2n + s
    uint32_t sc[4];  // scales[4i .. 4i + 3]
    uint32_t d;
  };
  __device__ __forceinline__ static Raw load(const uint8_t* __restrict__ row, int64_t u, int t) {
    const uint8_t* blk = row + u * 210;
    Raw r;
#pragma unroll
    for (int i = 0; i < 8; ++i) r.ql[i] = ld_u16x2(blk + 16 * i + 4 * t);
#pragma unroll
    for (int i = 0; i < 4; ++i) r.qh[i] = ld_u16x2(blk + 128 + 16 * i + 4 * t);
#pragma unroll
    for (int i = 0; i < 4; ++i) r.sc[i] = ld_u16x2(blk + 192 + 4 * i);
    r.d = ld_u16(blk + 208);
    return r;
  }
  template <int NT, class X = XView>
  __device__ __forceinline__ static void unit(const Raw (&r)[2], int64_t u, const X& xv, float (&accf)[NT][4]) {
    constexpr bool kX4 = NT <= SPECD_MMA_Q6_X4_TILES;
    float d[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) d[h] = specd_fp16_bits_to_float(uint16_t(r[h].d));
    int acc[NT][4];
    zero(acc);
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      uint2 hw[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) hw[h] = pair(r[h].qh[2 * n], r[h].qh[2 * n + 1]);
#pragma unroll
      for (int g4 = 0; g4 < 4; ++g4) {
        uint32_t a[2][4];
        uint2 v[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int c = g4 & 1;
          const uint2 lw = pair(r[h].ql[4 * n + 2 * c], r[h].ql[4 * n + 2 * c + 1]);
          if constexpr (kX4) {
            // 4 (q - 32) per byte: the nibble shifted into bits 2..5, qh's two bits into bits 6..7, bit 7 flipped
            // (4 q ^ 128 = 4 q - 128 as an int8); each word one shift of each source, a mask and a merge.
            const auto bits = [&](uint32_t l, uint32_t hq) {
              const uint32_t l2 = (g4 >> 1) ? l >> 2 : l << 2, h6 = hq << (6 - 2 * g4);
              return (l2 & 0x3c3c3c3cu) | ((h6 ^ 0x80808080u) & 0xc0c0c0c0u);
            };
            v[h] = make_uint2(bits(lw.x, hw[h].x), bits(lw.y, hw[h].y));
          } else {
            const uint2 lo = and2(shr2(lw, 4 * (g4 >> 1)), 0x0f0f0f0fu), hi = and2(shr2(hw[h], 2 * g4), 0x03030303u);
            // q - 32 per byte (q < 64): (q + 128 - 32) ^ 128 never borrows across bytes.
            v[h] = make_uint2((((lo.x | (hi.x << 4)) | 0x80808080u) - 0x20202020u) ^ 0x80808080u,
                              (((lo.y | (hi.y << 4)) | 0x80808080u) - 0x20202020u) ^ 0x80808080u);
          }
        }
        make_a(a[0], and2(v[0], 0x00ff00ffu), and2(v[1], 0x00ff00ffu));  // inputs 0..15 of the sub-block
        make_a(a[1], and2(v[0], 0xff00ff00u), and2(v[1], 0xff00ff00u));  // inputs 16..31
        int sc[2][2];
        const int i = 8 * n + 2 * g4;  // scale index of inputs 0..15
#pragma unroll
        for (int h = 0; h < 2; ++h) sc[0][h] = sbyte(r[h].sc[i >> 2], i & 3), sc[1][h] = sbyte(r[h].sc[i >> 2], (i & 3) + 1);
        step<NT, 2>(a, sc, 8 * u + 4 * n + g4, xv, acc);
      }
    }
    if constexpr (kX4) {  // every product was 4x: the sums are exact multiples of 4 (|acc| < 2^30)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] >>= 2;
    }
    finish(acc, u, d, xv, accf);
  }
};

// Q4_K in the GEMV's tiled layout (DType::Q4_K_TILED, made by tile_q4_kernel; weight_formats.cuh
// kQ4TileUnitBytes): IQ4T's arrangement with Q4_K's 16-byte headers: per tile and unit 2304 bytes, the
// 16 rows' quants in lane order (4 runs of 512 bytes, run i holding at 16 l the words 4 (i & 1) .. + 3 of
// lane l = 4 g + t for row g + 8 (i / 2), whose 8 words are qs[16 k + 4 t ..]), then the 16 rows' 16-byte
// headers (d, dmin, scales) in row order. Same values and arithmetic as QK45U<false>: bit-identical.
struct Q4T {
  static constexpr int kUnitElems = 256, kTileUnitBytes = int(kQ4TileUnitBytes);
  static constexpr bool kTiled = true;
  using Raw = QK45U<false>::Raw;
  __device__ __forceinline__ static void load_tile(const uint8_t* __restrict__ p, int lane, Raw (&r)[2]) {
    load_quant_runs(p, lane, r);
    const int g = lane >> 2;
#pragma unroll
    for (int h = 0; h < 2; ++h) r[h].hdr = ldw<uint4>(p + 2048 + 16 * (g + 8 * h)), r[h].h[0] = 0;
  }
  template <int NT, class X = XView>
  __device__ __forceinline__ static void unit(const Raw (&r)[2], int64_t u, const X& xv, float (&accf)[NT][4]) {
    QK45U<false>::unit<NT>(r, u, xv, accf);
  }
};

// Q5_K in the GEMV's tiled layout (DType::Q5_K_TILED, made by tile_q4_kernel; weight_formats.cuh
// kQ5TileUnitBytes): Q4T's arrangement with Q5_K's fifth bits between the quants and the headers: per tile and
// unit 2816 bytes (Q5_K's 16 x 176), the 16 rows' quants in lane order (as Q4T's), then one 512-byte run holding
// at 16 l lane l = 4 g + t's qh[4 t ..], qh[16 + 4 t ..] of row g, then of row g + 8, then the 16 rows' 16-byte
// headers in row order. A lane's unit is seven 16-byte loads where the row-major blocks take 20 4-byte and two
// 16-byte ones. Same values and arithmetic as QK45U<true>: bit-identical.
struct Q5T {
  static constexpr int kUnitElems = 256, kTileUnitBytes = int(kQ5TileUnitBytes);
  static constexpr bool kTiled = true;
  using Raw = QK45U<true>::Raw;
  __device__ __forceinline__ static void load_tile(const uint8_t* __restrict__ p, int lane, Raw (&r)[2]) {
    load_quant_runs(p, lane, r);
    const uint4 h = ldw<uint4>(p + 2048 + 16 * lane);
    r[0].h[0] = h.x, r[0].h[1] = h.y, r[1].h[0] = h.z, r[1].h[1] = h.w;
    const int g = lane >> 2;
#pragma unroll
    for (int k = 0; k < 2; ++k) r[k].hdr = ldw<uint4>(p + 2560 + 16 * (g + 8 * k));
  }
  template <int NT, class X = XView>
  __device__ __forceinline__ static void unit(const Raw (&r)[2], int64_t u, const X& xv, float (&accf)[NT][4]) {
    QK45U<true>::unit<NT>(r, u, xv, accf);
  }
};

// Q6_K in the GEMV's tiled layout (DType::Q6_K_TILED, made by tile_q6_k_kernel; weight_formats.cuh
// kQ6TileUnitBytes): rows in tiles of 16; per tile and unit (256 inputs) 3360 bytes: first the 16 rows'
// quants in lane order, 6 runs of 512 bytes, run i = 3 h + c holding at 16 l the words 4 c .. 4 c + 3
// of lane l = 4 g + t for row g + 8 h, whose 12 words are Q6U::Raw's ql[0..7] then qh[0..3]; then the
// 16 rows' 16 scale bytes in row order; then the 16 rows' fp16 d. Every load is a 16-byte word (the
// row-major Q6_K's 210-byte blocks allow 2-byte loads only) except d. Same values and arithmetic as
// Q6U, so bit-identical results.
struct Q6T {
  static constexpr int kUnitElems = 256, kTileUnitBytes = int(kQ6TileUnitBytes);
  static constexpr bool kTiled = true;
  using Raw = Q6U::Raw;
  __device__ __forceinline__ static void load_tile(const uint8_t* __restrict__ p, int lane, Raw (&r)[2]) {
#pragma unroll
    for (int i = 0; i < 6; ++i) {
      const uint4 v = ldw<uint4>(p + 512 * i + 16 * lane);
      uint32_t* q = (i % 3 == 2) ? r[i / 3].qh : r[i / 3].ql + 4 * (i % 3);
      q[0] = v.x, q[1] = v.y, q[2] = v.z, q[3] = v.w;
    }
    const int g = lane >> 2;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 sc = ldw<uint4>(p + kQ6TileScales + 16 * (g + 8 * h));
      r[h].sc[0] = sc.x, r[h].sc[1] = sc.y, r[h].sc[2] = sc.z, r[h].sc[3] = sc.w;
      r[h].d = ld_u16(p + kQ6TileD + 2 * (g + 8 * h));
    }
  }
  template <int NT, class X = XView>
  __device__ __forceinline__ static void unit(const Raw (&r)[2], int64_t u, const X& xv, float (&accf)[NT][4]) {
    Q6U::unit<NT>(r, u, xv, accf);
  }
};

// Q8_0 (34-byte blocks, 2-byte aligned: fp16 d | int8 q[32]): unit = one block, accf += (d * scale)
// * (q . x') per block (|q . x'| < 2^22: converted exactly).
struct Q8U {
  static constexpr int kUnitElems = 32;
  static constexpr bool kTiled = false;
  struct Raw {
    uint32_t q0, q1, d;
  };
  __device__ __forceinline__ static Raw load(const uint8_t* __restrict__ row, int64_t u, int t) {
    const uint8_t* blk = row + u * 34;
    return Raw{ld_u16x2(blk + 2 + 4 * t), ld_u16x2(blk + 18 + 4 * t), ld_u16(blk)};
  }
  template <int NT>
  __device__ __forceinline__ static void unit(const Raw (&r)[2], int64_t u, const XView& xv, float (&accf)[NT][4]) {
    uint32_t a[4];
    make_a(a, pair(r[0].q0, r[0].q1), pair(r[1].q0, r[1].q1));
    const float d[2] = {specd_fp16_bits_to_float(uint16_t(r[0].d)), specd_fp16_bits_to_float(uint16_t(r[1].d))};
    const int64_t grp = u / (kGroup / 32);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      int p[4];
      imma(p, a, xv.b(u, nt));
      const float2 s = xv.scale(grp, nt);
#pragma unroll
      for (int c = 0; c < 4; ++c)
        accf[nt][c] = __fmaf_rn(__fmul_rn(d[c >> 1], (c & 1) ? s.y : s.x), small_int_to_float(p[c]), accf[nt][c]);
    }
  }
};

// BF16 (row-major, rows 16-byte aligned, in % 64 == 0; not a quantized format: the FP32-FMA GEMV
// (gemv_fma.cuh) is bound by its FMAs at 8-16 rows, e.g. a DFlash drafter's block): unit = 64 inputs, two
// 32-input chunks, of which lane t holds inputs 8t .. 8t + 7 (one 16-byte load per row and chunk). x
// comes as three BF16 terms per value (split_x_bf16_kernel: hi + mid + lo == x), each a B column like
// the int8 terms; m16n8k16 bf16 -> f32 MMAs multiply exactly and accumulate in F32 straight into accf
// (no scales), and store_partials sums the terms (hi + mid) + lo as for every format. k order of a
// chunk's step s (0, 1), A and B alike: k 2t, 2t + 1 = inputs 8t + 4s, + 1; k 2t + 8, 2t + 9 =
// inputs 8t + 4s + 2, + 3 (word 2s, 2s + 1 of the lane's 16 bytes).
struct BF16U {
  static constexpr int kUnitElems = 64;
  static constexpr bool kTiled = false;
  static constexpr bool kLightUnit = true;  // loads and MMAs only: a load ring at every tile count
  struct Raw {
    uint4 w[2];  // chunk c: inputs 64 u + 32 c + 8t .. + 7
  };
  __device__ __forceinline__ static Raw load(const uint8_t* __restrict__ row, int64_t u, int t) {
    Raw r;
#pragma unroll
    for (int c = 0; c < 2; ++c) r.w[c] = ldw<uint4>(row + 128 * u + 64 * c + 16 * t);
    return r;
  }
  template <int NT>
  __device__ __forceinline__ static void unit(const Raw (&r)[2], int64_t u, const XView& xv, float (&accf)[NT][4]) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const uint32_t a0[4] = {r[0].w[c].x, r[1].w[c].x, r[0].w[c].y, r[1].w[c].y};
      const uint32_t a1[4] = {r[0].w[c].z, r[1].w[c].z, r[0].w[c].w, r[1].w[c].w};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const uint4 b = xv.h(2 * u + c, nt);
        bmma(accf[nt], a0, make_uint2(b.x, b.y));
        bmma(accf[nt], a1, make_uint2(b.z, b.w));
      }
    }
  }
};

// Whether F's unit body is light (loads and MMAs: BF16U): it keeps a load ring at 5-6 tiles too.
template <class F, class = void>
struct LightUnit : std::false_type {};
template <class F>
struct LightUnit<F, std::void_t<decltype(F::kLightUnit)>> : std::bool_constant<F::kLightUnit> {};

// Whether instance (F, NT) takes tiled IQ4_XS's own blocks and ring (SPECD_MMA_IQ4T_*: 2 tiles, 3-4 tiles), with no
// unit loading ahead by default (a unit's words are 20 registers): more resident warps beat a ring there. Two tiles
// at 6 blocks instead of 5 with a 40-register ring: the FFN gate at 3-5 rows 27.1-27.7 -> 24.1-24.8 us a call,
// verify at 4 rows 8.79-8.84 -> 8.25-8.27 ms; three and four tiles at 4 blocks instead of 3 with 48: the FFN gate at
// 6 / 8 / 10 rows 29.0 / 30.0 / 34.6 -> 28.6 / 29.4 / 32.9 us, gate + up 50.5 / 52.6 / 62.0 -> 49.1 / 50.9 / 58.0
// (H200, gemv_sweep.sh, session of 2026-12-03 18:53 UTC; 5 blocks, or 4 with one unit ahead, were slower). Not tiled
// Q6_K: it spills 80 bytes at 6 blocks, and its 4-row 6144-input projection went 18.3 -> 20.5 us.
template <class F, int NT>
constexpr bool kIq4tTuning = std::is_same_v<F, IQ4T> && NT >= 2 && NT <= 4;

// 32-bit words of one row's Raw: Raw::kWords where a uint4 member pads sizeof(Raw) on the device to a
// multiple of 16 bytes (QK45U: 13 / 14 words in 64 bytes; the host emulation's uint4 has no such
// alignment, so counting sizeof would give the two different ring depths), else sizeof(Raw) / 4.
template <class Raw, class = void>
struct RawWords : std::integral_constant<int, int(sizeof(Raw) / 4)> {};
template <class Raw>
struct RawWords<Raw, std::void_t<decltype(Raw::kWords)>> : std::integral_constant<int, Raw::kWords> {};

// Whether instance (F, NT) loads the next unit's x ahead (SPECD_MMA_X_AHEAD; XUnit: B fragments, column scales
// and sub-block sums, 18-19 registers a unit at one tile, two units live): the tiled formats' one-tile instances,
// the decode step's GEMVs (H200: decode +2.2-5.4 %, BENCHMARKS.md, session of 2026-12-03 22:13 UTC). At
// two tiles and more x takes the registers of the ring or of resident blocks (tiled IQ4_XS at two tiles spilled at
// 4 blocks). Needs a unit of weights loading ahead too (SPECD_MMA_MAX_AHEAD >= 1).
template <class F, int NT>
__host__ __device__ constexpr bool x_ahead() {
  return SPECD_MMA_X_AHEAD && SPECD_MMA_MAX_AHEAD >= 1 && NT == 1 && F::kTiled;
}
// Registers of one unit's raw words (both rows).
template <class F>
__host__ __device__ constexpr int unit_regs() {
  return RawWords<typename F::Raw>::value * 2;
}
// The x_ahead instances keep at least one unit of weights loading ahead too: where two units' words exceed
// SPECD_MMA_X_RING_REGS (tiled Q6_K: 68 registers) they run at one block fewer (SPECD_MMA_MIN_BLOCKS - 1). Tiled
// Q6_K's 17408 x 5120 GEMV at width 1: 29.5 us without x ahead, 30.1 with x ahead and no ring at 4 blocks, 28.5
// with both at 3 blocks (gemv_sweep.sh, H200, same session).
template <class F, int NT>
__host__ __device__ constexpr bool x_ahead_fewer_blocks() {
  return x_ahead<F, NT>() && 2 * unit_regs<F>() > SPECD_MMA_X_RING_REGS;
}

// Resident blocks per multiprocessor an instance is compiled for: SPECD_MMA_MIN_BLOCKS (4: <= 128 registers a
// thread) for one tile, one more for two (<= 96, with 5/8 of the ring: units_ahead), one fewer for three and more
// (3 .. 6 tiles: 12 .. 24 accumulators; 3 blocks: <= 168 registers); kIq4tTuning: its own; tiled Q6_K's one tile
// one fewer too (x_ahead_fewer_blocks). Two tiles at 5 blocks
// rather than 4 (tiled Q6_K, the Q5_K head): verify at 4 rows 9.52-9.60 -> 9.32-9.34 ms (H200, session of
// 2026-12-02 22:45 UTC); one tile at 5 blocks made the decode step's GEMV 4 % slower, at 6 blocks 15 %. ptxas spills
// a few bytes in some instances at these caps (sm_90, CUDA 13.0, bytes of spill stores: row-major IQ4_XS 2 / 4 tiles
// 8 / 12, Q6_K 6 tiles 24, Q4_K 6 tiles 28; tiled Q4_K 5 / 6 tiles 12 / 20, tiled Q5_K 6 tiles 20, tiled Q6_K 2 / 6 tiles
// 16 / 4 (its 2-tile instance from the 4 (q - 32) quants), tiled IQ4_XS 5 tiles 4; the pair kernel's at 2 tiles 12).
template <class F, int NT>
__host__ __device__ constexpr int min_blocks() {
  if constexpr (kIq4tTuning<F, NT>) return NT == 2 ? SPECD_MMA_IQ4T_BLOCKS_2 : SPECD_MMA_IQ4T_BLOCKS_34;
  if constexpr (x_ahead_fewer_blocks<F, NT>()) return SPECD_MMA_MIN_BLOCKS - 1;
  return NT == 1 ? SPECD_MMA_MIN_BLOCKS : NT == 2 ? SPECD_MMA_MIN_BLOCKS + 1 : SPECD_MMA_MIN_BLOCKS - 1;
}
static_assert(SPECD_MMA_MIN_BLOCKS >= 2,
              "SPECD_MMA_MIN_BLOCKS: the 3+ tile instances and x_ahead_fewer_blocks take one block fewer");
static_assert((SPECD_MMA_MIN_BLOCKS + 1) * kWarps * 32 <= 2048,
              "SPECD_MMA_MIN_BLOCKS: the two-tile instances' blocks (one more) must fit a multiprocessor's 2048 threads");
static_assert(SPECD_MMA_IQ4T_BLOCKS_2 >= 1 && SPECD_MMA_IQ4T_BLOCKS_2 * kWarps * 32 <= 2048 &&
                  SPECD_MMA_IQ4T_BLOCKS_34 >= 1 && SPECD_MMA_IQ4T_BLOCKS_34 * kWarps * 32 <= 2048,
              "SPECD_MMA_IQ4T_BLOCKS_*: the blocks must fit a multiprocessor's 2048 threads");

// Units a warp keeps loading ahead of the one it computes (software pipelining: before computing a unit,
// the slot of the previous one is refilled with the unit kAhead later): as many as a register budget for
// the raw words allows, with one unit's words being computed, 0 .. 4. The budget follows the registers
// min_blocks leaves: SPECD_MMA_RING_REGS at one tile (x_ahead: SPECD_MMA_X_RING_REGS, or two units at one
// block fewer), 5/8 of it at two, 3/4 at three and more (kIq4tTuning: its own). 0 (load one unit, then
// compute it) for 5 and 6 tiles: the old 6-tile instance's ~800-instruction unit body was doubled by the
// ring, unrolled over its slots (H200: verify at 9..16 rows 24-25.7 ms against 19.7-21.3 ms with one unit
// ahead through register copies, BENCHMARKS.md); 5 tiles follows it unmeasured on its own.
// Light units (BF16U) keep their ring (a few instructions per unit).
template <class F, int NT>
__host__ __device__ constexpr int units_ahead() {
  if constexpr (NT >= 5 && !LightUnit<F>::value) return 0;
  constexpr int regs = unit_regs<F>();
  constexpr int budget = kIq4tTuning<F, NT>              ? (NT == 2 ? SPECD_MMA_IQ4T_RING_2 : SPECD_MMA_IQ4T_RING_34)
                         : x_ahead_fewer_blocks<F, NT>() ? 2 * regs
                         : x_ahead<F, NT>()              ? SPECD_MMA_X_RING_REGS
                         : NT == 1                       ? SPECD_MMA_RING_REGS
                         : NT == 2                       ? SPECD_MMA_RING_REGS * 5 / 8
                                                         : SPECD_MMA_RING_REGS * 3 / 4;
  constexpr int ahead = budget / regs - 1;
  return ahead < 0 ? 0 : ahead > SPECD_MMA_MAX_AHEAD ? SPECD_MMA_MAX_AHEAD : ahead;
}

// --- kernels ---------------------------------------------------------------------------------

// The unit's contribution (F::unit), or with SPECD_MMA_LOADS_ONLY a fold of its raw words into one
// accumulator (keeps the loads, drops the arithmetic: the memory side's ceiling of a variant).
template <class F, int NT, class X = XView>
__device__ __forceinline__ void compute(const typename F::Raw (&raw)[2], int64_t u, const X& xv, float (&accf)[NT][4]) {
  static_assert(std::is_same_v<X, XView> || x_ahead<F, NT>(), "an XUnitView only for the x_ahead instances");
  if constexpr (SPECD_MMA_LOADS_ONLY) {
    uint32_t v = 0;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < RawWords<typename F::Raw>::value; ++i) v ^= reinterpret_cast<const uint32_t*>(&raw[h])[i];
    accf[0][0] = __int_as_float(__float_as_int(accf[0][0]) ^ int(v));
  } else {
    F::template unit<NT>(raw, u, xv, accf);
  }
}

// The inputs of a split: load(r, blk, t, v) gives the 8 values lane t of 32-input block blk of row r
// multiplies in its B-fragment words, inputs 4t .. 4t+3 (v[0..3]) and 16+4t .. 16+4t+3 (v[4..7]) (the
// k order above). PlainInput reads them from x [n, in] F32 (rows 16-byte aligned); the fused ops of
// matmul.cu compute them (a norm's outputs, with the standalone op's device code) or read them from
// shared memory (values computed there first: SwiGLU, the sigmoid gate, the gated norm).
// v[4 k .. 4 k + 3] = a (k = 0: inputs 4t.., k = 1: inputs 16 + 4t..).
__device__ __forceinline__ void put4(float (&v)[8], int k, float4 a) {
  v[4 * k] = a.x, v[4 * k + 1] = a.y, v[4 * k + 2] = a.z, v[4 * k + 3] = a.w;
}

struct PlainInput {
  const float* __restrict__ x;
  int64_t in;
  __device__ __forceinline__ void load(int r, int64_t blk, int t, float (&v)[8]) const {
    const float4* src = reinterpret_cast<const float4*>(x + int64_t(r) * in + 32 * blk);
    put4(v, 0, src[t]), put4(v, 1, src[4 + t]);
  }
};

// Row r's 256-input group grp of the split x of a call (XView), by one whole warp (r < n or not: the
// shuffles need all 32 lanes; rows >= n write nothing), 4 lanes per 32-input sub-block sb = lane / 4,
// t = lane % 4. Lane t of a sub-block gets exactly the inputs of its own B-fragment word, so it writes
// xb[blk][nt][4 (column % 8) + t] (column 3r + tau) for each term without an exchange. The group
// maximum is a warp reduction, the sub-block sums of the terms (exact integers, |sum| <= 2048, so
// exact in f16) a reduction over the 4 lanes, written to xm by lane t = 0; warp lane 0 writes the
// group's column scales to xs, lane 1 of row 0 zeroes the padding columns 3n .. kMaxCols.
// Exactness: see the header.
template <class In>
__device__ __forceinline__ void split_group(const In& src, int r, int n, int64_t grp, int64_t in, int lane,
                                            uint2* __restrict__ xb, float* __restrict__ xs, uint32_t* __restrict__ xm) {
  const int t = lane & 3, sb = lane >> 2;
  const int64_t blk = grp * (kGroup / 32) + sb;
  const bool have = r < n && 32 * blk < in;  // the same for the sub-block's 4 lanes
  float v[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};  // inputs 4t + {0..3}, 16 + 4t + {0..3}
  if (have) src.load(r, blk, t, v);
  float m = 0.0f;  // max |x| of the group, +inf if it holds inf / NaN
#pragma unroll
  for (int k = 0; k < 8; ++k) m = isfinite(v[k]) ? fmaxf(m, fabsf(v[k])) : INFINITY;
#pragma unroll
  for (int s = 1; s < 32; s <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, s));  // all lanes take part
  if (r >= n) return;  // whole warps: the sum shuffles below still see all 32 lanes
  const bool fin = m < INFINITY;
  int k2 = 0;  // x' = x * 2^k2, k2 in [-108, 126]: 2^k2 and 2^-k2 (times 2^14) are normal floats
  if (fin && m > 0.0f) {
    const int e = int((__float_as_uint(m) >> 23) & 0xff) - 127;  // m in [2^e, 2^(e+1)) (e = -127: subnormal)
    k2 = 19 - e < 126 ? 19 - e : 126;
  }
  const float up = __uint_as_float(uint32_t(127 + k2) << 23);
  uint32_t q[kTerms][8];  // the terms as bytes
  int sum[kTerms] = {0, 0, 0};
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float xv = fin ? __fmul_rn(v[k], up) : 0.0f;
    const float hi = rintf(__fmul_rn(xv, 1.0f / 16384.0f));
    const float r1 = __fsub_rn(xv, __fmul_rn(hi, 16384.0f));
    const float mid = rintf(__fmul_rn(r1, 1.0f / 128.0f));
    const float lo = rintf(__fsub_rn(r1, __fmul_rn(mid, 128.0f)));
    q[0][k] = uint8_t(int8_t(hi)), q[1][k] = uint8_t(int8_t(mid)), q[2][k] = uint8_t(int8_t(lo));
    sum[0] += int(hi), sum[1] += int(mid), sum[2] += int(lo);
  }
#pragma unroll
  for (int tau = 0; tau < kTerms; ++tau)
#pragma unroll
    for (int s = 1; s < 4; s <<= 1) sum[tau] += __shfl_xor_sync(0xffffffffu, sum[tau], s);
  if (have) {
#pragma unroll
    for (int tau = 0; tau < kTerms; ++tau) {
      const int c = 3 * r + tau, nt = c >> 3, col = c & 7;
      // k order: reg0 = inputs 4t, 4t+16, 4t+1, 4t+17; reg1 = 4t+2, 4t+18, 4t+3, 4t+19.
      const uint32_t(&w)[8] = q[tau];
      xb[(blk * kMaxTiles + nt) * 32 + 4 * col + t] =
          make_uint2(w[0] | w[4] << 8 | w[1] << 16 | w[5] << 24, w[2] | w[6] << 8 | w[3] << 16 | w[7] << 24);
      // xm: lane 4 col + sb / 2 of tile nt holds (sum of sub-block 2t', 2t' + 1) as f16x2.
      if (t == 0)
        reinterpret_cast<__half*>(xm + (grp * kMaxTiles + nt) * 32 + 4 * col + (sb >> 1))[sb & 1] =
            __float2half_rn(float(sum[tau]));
    }
  }
  if (lane == 0) {
    const float base = fin ? __uint_as_float(uint32_t(127 - k2) << 23) : NAN;  // 2^-k2
    xs[grp * kMaxCols + 3 * r] = base * 16384.0f;
    xs[grp * kMaxCols + 3 * r + 1] = base * 128.0f;
    xs[grp * kMaxCols + 3 * r + 2] = base;
  }
  if (r == 0 && lane == 1)
    for (int c = 3 * n; c < kMaxCols; ++c) xs[grp * kMaxCols + c] = 0.0f;
}

// The inputs of `src` (n rows of `in`) -> the split x of a call (XView): one warp per (row r,
// 256-input group grp), thread id = (r * groups + grp) * 32 + lane.
template <class In>
__global__ void split_x_kernel(const In src, int64_t in, int n, int64_t groups, uint2* __restrict__ xb,
                               float* __restrict__ xs, uint32_t* __restrict__ xm) {
  pdl_enter();  // the GEMV may start loading weights now (it waits for our writes); we wait for our inputs
  const int64_t id = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t rg = id >> 5;
  split_group(src, int(rg / groups), n, rg % groups, in, int(id & 31), xb, xs, xm);
}

// BF16U's x: x [n, in] F32 (rows 16-byte aligned, in % 32 == 0) -> xh [in / 32][kMaxTiles][32] (tiles
// 0 .. `tiles` - 1 written): lane 4 g + t of n8 tile nt in chunk kc holds term tau = c % 3 of row r = c / 3
// (column c = 8 nt + g; zeros for c >= 3 n) at inputs 32 kc + 8t .. + 7 as 8 BF16, the lower input in
// each word's lower half. hi = x truncated to BF16 (its upper 16 bits), mid = (x - hi) truncated, lo = x -
// hi - mid: each difference is exact in F32 and holds at most 16, then 8 significant bits, so hi + mid +
// lo == x for finite |x| >= 2^-110 (truncation never rounds up, so a finite x near F32's maximum stays
// finite; rounding to nearest made hi inf there); below 2^-110 lo's last bits fall under BF16's
// subnormals: an absolute error < 2^-126 per value. A non-finite x is its own hi with mid = lo = 0, so
// a row of x holding inf / NaN gives the CPU's inf / NaN against finite weights. One thread per
// (chunk, tile, lane).
__global__ void split_x_bf16_kernel(const float* __restrict__ x, int64_t in, int n, int tiles, uint4* __restrict__ xh) {
  pdl_enter();  // the GEMV may start loading weights now (it waits for our writes); we wait for our inputs
  const int64_t id = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int lane = int(id & 31), nt = int((id >> 5) % tiles);
  const int64_t kc = (id >> 5) / tiles;
  if (kc >= in / 32) return;
  const int c = 8 * nt + (lane >> 2), t = lane & 3;
  uint32_t w[4] = {0u, 0u, 0u, 0u};
  if (c < 3 * n) {
    const int tau = c % 3;
    const float4* p = reinterpret_cast<const float4*>(x + int64_t(c / 3) * in + 32 * kc + 8 * t);
    const float4 v0 = p[0], v1 = p[1];
    const float v[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float term = v[j];  // tau 0: hi
      if (isfinite(v[j])) {
        const float hi = __uint_as_float(__float_as_uint(v[j]) & 0xffff0000u), r1 = __fsub_rn(v[j], hi);
        const float mid = __uint_as_float(__float_as_uint(r1) & 0xffff0000u);
        term = tau == 0 ? hi : tau == 1 ? mid : __fsub_rn(r1, mid);
      } else if (tau > 0) {
        term = 0.0f;
      }
      w[j >> 1] |= uint32_t(to_bf16(term)) << (16 * (j & 1));
    }
  }
  xh[(kc * kMaxTiles + nt) * 32 + lane] = make_uint4(w[0], w[1], w[2], w[3]);
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

// Block `block` of the group's flat grid: its weight wi (the last whose first block is <= block), row block and split.
struct GroupBlock {
  int wi;
  int64_t rb, split;
};
__device__ __forceinline__ GroupBlock locate(const Group& g_, int64_t block) {
  int wi = 0;
#pragma unroll
  for (int i = 1; i < kMaxGroup; ++i)
    if (i < g_.count && block >= g_.block0[i]) wi = i;
  const int64_t row_blocks = (g_.out[wi] + kRowsPerBlock - 1) / kRowsPerBlock, local = block - g_.block0[wi];
  return GroupBlock{wi, local % row_blocks, local / row_blocks};
}

// The end of a warp's work: its accumulators (lane rows g, g + 8, term columns of its tiles) through
// shared memory `p` (16 x (kMaxCols + 1) floats of its own), the three term columns of each row of x
// summed (hi + mid + lo, in that order) and written to dst[split][r][row] of its weight.
template <int NT>
__device__ __forceinline__ void store_partials(const float (&accf)[NT][4], float (&p)[16][kMaxCols + 1], const Group& g_,
                                               int64_t block, int warp, int lane, int n) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int c = 0; c < 4; ++c) p[g + 8 * (c >> 1)][8 * nt + 2 * t + (c & 1)] = accf[nt][c];
  __syncwarp();
  // Where this block's partials go, located again: nothing of it stays live across the loop.
  const GroupBlock ge = locate(g_, block);
  const int64_t out_e = g_.out[ge.wi], row0_e = ge.rb * kRowsPerBlock + int64_t(warp) * 16;
  float* o = g_.dst[ge.wi] + ge.split * n * out_e;
  for (int e = lane; e < 16 * n; e += 32) {
    const int row = e & 15, r = e >> 4;
    if (row0_e + row < out_e)
      o[int64_t(r) * out_e + row0_e + row] = __fadd_rn(__fadd_rn(p[row][3 * r], p[row][3 * r + 1]), p[row][3 * r + 2]);
  }
}

// Where a warp's two lane rows (g, g + 8 of the 16 from row0) come from: a row-major weight (rows
// past `out` clamped to the last: ragged last tile), or, for a tiled format, its 16-row tile.
template <class F, bool kTiled = F::kTiled>
struct RowSource {
  const uint8_t* rows[2];
  int t;
  __device__ __forceinline__ RowSource(const uint8_t* w, int64_t row0, int64_t out, int64_t row_bytes, int64_t, int lane)
      : t(lane & 3) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t rr = row0 + (lane >> 2) + 8 * h;
      rows[h] = w + (rr < out ? rr : out - 1) * row_bytes;
    }
  }
  __device__ __forceinline__ void load(typename F::Raw (&r)[2], int64_t u) const {
#pragma unroll
    for (int h = 0; h < 2; ++h) r[h] = F::load(rows[h], u, t);
  }
};
template <class F>
struct RowSource<F, true> {
  const uint8_t* tile;
  int lane;
  __device__ __forceinline__ RowSource(const uint8_t* w, int64_t row0, int64_t out, int64_t, int64_t nunits, int lane_)
      : lane(lane_) {
    const int64_t last = (out - 1) / 16, ti = row0 / 16 < last ? row0 / 16 : last;
    tile = w + ti * nunits * F::kTileUnitBytes;
  }
  __device__ __forceinline__ void load(typename F::Raw (&r)[2], int64_t u) const {
    F::load_tile(tile + u * F::kTileUnitBytes, lane, r);
  }
  // Asks L2 for tile unit u (contiguous: a 128-byte line a lane). A hint that returns nothing: results never change.
  __device__ __forceinline__ void prefetch(int u) const {
#if !defined(SPECD_HOST_EMU) && defined(__CUDA_ARCH__)
    const uintptr_t p = reinterpret_cast<uintptr_t>(tile + u * F::kTileUnitBytes), first = p & ~uintptr_t(127);
    static_assert(F::kTileUnitBytes + 127 <= 32 * 128, "prefetch: a tile unit's lines, one a lane");
    if (uintptr_t(lane) * 128 < p + F::kTileUnitBytes - first) asm volatile("prefetch.global.L2 [%0];" ::"l"(first + 128 * lane));
#else
    (void)u;
#endif
  }
};

// One block's work: kWarps warps, warp w owns rows row0 + 16 w .. + 15 of its weight (lane rows g, g + 8) and
// all rows of x, over units [u_begin, u_end) of its split, in order (kAhead units loading ahead; kXAhead: x a unit
// ahead, x_ahead), as block `block` of group g_'s flat grid. Loads its first weight units, then waits for the
// kernels before it (pdl_wait: the split x is then readable). The kernels below run it; a block's arithmetic is
// the same whichever kernel runs it and whatever its ring, so results never depend on the launch.
template <class F, int NT, int kAhead, bool kXAhead>
__device__ __forceinline__ void gemv_block(const Group& g_, int64_t block, int64_t nunits, const XView& xv0, int n,
                                           float (&part)[kWarps][16][kMaxCols + 1]) {
  const GroupBlock gb = locate(g_, block);
  const uint8_t* __restrict__ w = g_.w[gb.wi];
  const int64_t row_bytes = g_.row_bytes[gb.wi], out = g_.out[gb.wi], per_split = g_.per_split[gb.wi];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  XView xv = xv0;
  xv.lane = lane;
  const int64_t row0 = gb.rb * kRowsPerBlock + int64_t(warp) * 16;
  // Unit indices in 32 bits (launch checks nunits <= kMaxUnits): 64-bit index arithmetic took ~15 instructions of a
  // unit.
  const int u_begin = int(gb.split * per_split);
  const int u_end = int(u_begin + per_split < nunits ? u_begin + per_split : nunits);

  float accf[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int c = 0; c < 4; ++c) accf[nt][c] = 0.0f;
  const RowSource<F> src(w, row0, out, row_bytes, nunits, lane);
  static_assert(!kXAhead || (kAhead > 0 && F::kUnitElems == kGroup),
                "x_ahead instances: a unit of weights loading ahead (units_ahead), units of one x group (XUnit)");
  if constexpr (kAhead == 0) {
    // No unit loads ahead into registers here (the tiled formats' 2- to 6-tile instances: the verify widths; a pair
    // launch's second format at every width), so each unit is asked of L2 kL2 units before its load
    // (SPECD_MMA_L2_AHEAD). H200, same GGUF and call: verify at 8 / 16 rows 10.53 / 14.94 -> 9.63 / 14.00 ms, the
    // scripted loop at AL 3 / 5 / 7 285 / 474 / 653 -> 304 / 501 / 689 tok/s (session of 2026-12-04 03:10 UTC). The
    // one-tile instances of mma_gemv_kernel, whose register ring holds the next unit, were 3-9 % slower with it (tiled
    // IQ4_XS: GDN qkv 13.89 -> 14.29 us, FFN gate + up 34.92 -> 38.11): none there.
    constexpr int kL2 = F::kTiled ? SPECD_MMA_L2_AHEAD : 0;
    if constexpr (kL2 > 0)
      for (int u = u_begin; u < u_begin + kL2 && u < u_end; ++u) src.prefetch(u);
    pdl_wait();  // split_x complete: xv readable
    for (int u = u_begin; u < u_end; ++u) {
      if constexpr (kL2 > 0)
        if (u + kL2 < u_end) src.prefetch(u + kL2);
      typename F::Raw raw[2];
      src.load(raw, u);
      compute<F, NT>(raw, u, xv, accf);
    }
  } else {
    // kAhead + 1 slots, unit u in slot (u - u_begin) % kSlots; the loop is unrolled over the slots so
    // that every slot index is static (no register copies): before computing a unit, the slot of the
    // unit before it is refilled with the unit kAhead later.
    constexpr int kSlots = kAhead + 1;
    typename F::Raw ring[kSlots][2];
#pragma unroll
    for (int i = 0; i < kAhead; ++i)
      if (u_begin + i < u_end) src.load(ring[i], u_begin + i);
    pdl_wait();  // the first units' weights are in flight; from here on x is read
    // kXAhead: unit u's x in xu[(u - u_begin) % kSlots], the next unit's loaded before a unit is computed.
    XUnit<NT> xu[kXAhead ? kSlots : 1];
    const XLane xl(xv);
    if constexpr (kXAhead)
      if (u_begin < u_end) xu[0].load(xl, u_begin);
    for (int u0 = u_begin; u0 < u_end; u0 += kSlots) {
#pragma unroll
      for (int i = 0; i < kSlots; ++i) {
        const int u = u0 + i;
        if (u < u_end) {
          if (u + kAhead < u_end) src.load(ring[(i + kAhead) % kSlots], u + kAhead);
          if constexpr (kXAhead) {
            if (u + 1 < u_end) xu[(i + 1) % kSlots].load(xl, u + 1);
            compute<F, NT>(ring[i], u, XUnitView<NT>(xv, xu[i]), accf);
          } else {
            compute<F, NT>(ring[i], u, xv, accf);
          }
        }
      }
    }
  }
  store_partials<NT>(accf, part[warp], g_, block, warp, lane, n);
}

// The grouped GEMV of one format: block b of the flat grid is block b of g_ (gemv_block), with F's ring
// (units_ahead) and x ahead where the instance takes it (x_ahead).
template <class F, int NT>
__global__ void __launch_bounds__(kWarps * 32, min_blocks<F, NT>()) mma_gemv_kernel(const Group g_, int64_t nunits,
                                                                             const XView xv0, int n) {
  pdl_launch_dependents();  // the next kernel may launch; this one waits in gemv_block, after its first weight loads
  __shared__ float part[kWarps][16][kMaxCols + 1];
  gemv_block<F, NT, units_ahead<F, NT>(), x_ahead<F, NT>()>(g_, blockIdx.x, nunits, xv0, n, part);
}

// The pair kernel's resident blocks: F's at one tile (G's blocks, without a ring, fit F's registers), the fewer of
// the two formats' at more. Instances up to kPairMaxTiles n8 tiles (10 rows of x); past it the tiled IQ4_XS pair
// spills 16-44 bytes (ptxas, sm_90, at 5 and 6 tiles), and those calls launch a kernel per format. (At two tiles it
// spills 12 bytes, as tiled Q6_K's own two-tile instance does 16; H200: a verify of 4 rows -1.2 % GPU time with the
// pair, 8 rows -0.5 %, BENCHMARKS.md, session of 2026-12-04 18:22 UTC.)
constexpr int kPairMaxTiles = 4;
template <class F, class G, int NT>
__host__ __device__ constexpr int pair_min_blocks() {
  return NT == 1 || min_blocks<F, NT>() < min_blocks<G, NT>() ? min_blocks<F, NT>() : min_blocks<G, NT>();
}
// Two formats' groups against the same x in one launch (with_pair: the 27B's attention q / k, tiled IQ4_XS, with v,
// tiled Q6_K), so that the small second group costs no launch, ramp and tail of its own: blocks [0, gg's grid) are
// gg's (G, started first so that its blocks are not the launch's tail), the rest gf's. F's blocks run as
// mma_gemv_kernel's (ring, x ahead), G's without a register ring (L2 ahead, as the verify widths' instances), at
// pair_min_blocks. Each block runs one gemv_block, which waits (pdl_wait) after its first weight loads.
template <class F, class G, int NT>
__global__ void __launch_bounds__(kWarps * 32, pair_min_blocks<F, G, NT>()) mma_gemv_pair_kernel(const Group gf, int64_t nf,
                                                                                  const Group gg, int64_t ng,
                                                                                  const XView xv0, int n) {
  pdl_launch_dependents();  // the next kernel may launch; this one waits in gemv_block, after its first weight loads
  __shared__ float part[kWarps][16][kMaxCols + 1];
  const int64_t g_blocks = gg.block0[gg.count];
  if (int64_t(blockIdx.x) < g_blocks)
    gemv_block<G, NT, 0, false>(gg, blockIdx.x, ng, xv0, n, part);
  else
    gemv_block<F, NT, units_ahead<F, NT>(), x_ahead<F, NT>()>(gf, int64_t(blockIdx.x) - g_blocks, nf, xv0, n, part);
}

// Splits of the reduction dimension for a weight of `out` rows and `nunits` units of `unit_elems` inputs, on `sms`
// multiprocessors that each hold `bps` blocks of the format's one-tile (decode) instance (wave_blocks; 0: the
// fewest-units rule below alone). Depends on the weight's
// shape and format and the device only (never on n or on the weights it is grouped with), so every row of x sees
// the same arithmetic whatever the width or grouping of the call.
//   The fewest splits of at most SPECD_MMA_SPLIT_MAX_INPUTS (2048) inputs whose blocks fill the resident slots (bps
// * sms) to a good wave shape: 0.8 to 1 wave, or past one wave whole waves or a last wave at least 0.4 full (integer
// comparisons: the host, the device and the emulation agree). The shape is judged per weight, as the contract
// above requires, though a grouped launch runs its weights' blocks as one grid. A block pays a ramp
// (its first unit's weights and x arrive before any arithmetic), so longer blocks are cheaper per unit, while a
// last wave of a few blocks costs about a whole block's time for little work. H200, width 1 (gemv_sweep.sh,
// session of 2026-12-04 03:10 UTC), tiled IQ4_XS: FFN gate + up, one launch, 36.97 -> 35.02 us (3 splits of 7 units
// instead of 5 of 4: 1.55 waves a weight), down 21.55 -> 20.79 (10 of 7: 1.5 waves; 12 of 6: 19.95), GDN qkv 14.69 -> 13.98 (0.9
// wave); tiled Q6_K's 5120 x 6144 14.44 -> 13.53 (4 of 6: 0.8 wave); against 1.03-1.21 waves at 23.15 / 22.16
// / 15.50 / 14.46. Otherwise (no such split, or SPECD_MMA_SPLIT_WAVES 0) the fewest-units rule: about
// kBlocksPerSM blocks per multiprocessor, at least SPECD_MMA_SPLIT_UNITS (4) units per split (16 against 4 took the
// 27B FFN gate + up launch from 67 to 55 us, Q8_0 17408 x 5120 from 102 to 68 us, 2026-11-30).
inline int64_t units_per_split(int64_t out, int64_t nunits, int unit_elems, int64_t sms, int bps) {
  const int64_t row_blocks = (out + kRowsPerBlock - 1) / kRowsPerBlock;
  const int64_t want = kBlocksPerSM * sms;
  const int64_t splits = std::max<int64_t>(1, std::min<int64_t>(want / row_blocks, nunits / SPECD_MMA_SPLIT_UNITS));
  if (SPECD_MMA_SPLIT_WAVES && bps > 0)
    for (int64_t s = 1; s <= splits; ++s) {
      const int64_t per = (nunits + s - 1) / s;
      if (per * unit_elems > SPECD_MMA_SPLIT_MAX_INPUTS || (nunits + per - 1) / per != s) continue;  // too long, or fewer splits
      const int64_t blocks = row_blocks * s, slots = int64_t(bps) * sms, last = blocks % slots;
      if (blocks <= slots ? 100 * blocks >= 80 * slots : last == 0 || 100 * last >= 40 * slots) return per;
    }
  return std::max<int64_t>((nunits + splits - 1) / splits, 1);
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
  s_.y[i][j] = fold_partials(s_.part[i], s_.splits[i], count, j);
}

// One weight of a grouped launch: its bytes, row bytes and rows, and its output y [n, out] (F32); with
// partials > 1, y is instead a buffer of that many split-K partials [partials][n][out], which must be the
// weight's splits (splits_for; plan_group checks), left for the consumer to sum (split 0 first) instead of a sum
// kernel (0: y is the output, summed into when the weight has several splits).
struct GroupWeight {
  const uint8_t* w;
  int64_t row_bytes, out;
  float* y;
  int64_t partials = 0;
};

// The tiled format whose split plan F's weights take: its own, or for a row-major format the tiled layout of the same
// quants, so that a weight gives the same bits in either layout (test_gpu_gemv_tiles.py); void for the formats with
// no tiled layout.
template <class F>
struct SplitTwin {
  using type = std::conditional_t<F::kTiled, F, void>;
};
template <>
struct SplitTwin<IQ4U> {
  using type = IQ4T;
};
template <>
struct SplitTwin<QK45U<false>> {
  using type = Q4T;
};
template <>
struct SplitTwin<Q6U> {
  using type = Q6T;
};
template <>
struct SplitTwin<QK45U<true>> {
  using type = Q5T;
};
// The resident blocks per multiprocessor units_per_split sizes a tiled format's splits by: its one-tile (decode)
// instance's at the default tuning constants (min_blocks<T, 1>(): tiled Q6_K runs one block fewer,
// x_ahead_fewer_blocks; test_gpu_mma_split_plans checks the two agree), written out so that a sweep variant's
// occupancy constants leave the split plan, hence the results, alone.
template <class T>
constexpr int kWaveBlocks = std::is_same_v<T, Q6T> ? 3 : 4;
// units_per_split's bps for format F: its tiled twin's kWaveBlocks; 0 (the fewest-units rule alone) without a twin.
template <class F>
constexpr int wave_blocks() {
  using T = typename SplitTwin<F>::type;
  if constexpr (std::is_void_v<T>)
    return 0;
  else
    return kWaveBlocks<T>;
}

// Units per split and splits of a weight of format F, `out` rows and `nunits` units on `sms` multiprocessors.
template <class F>
inline int64_t units_per_split_of(int64_t out, int64_t nunits, int64_t sms) {
  return units_per_split(out, nunits, F::kUnitElems, sms, wave_blocks<F>());
}
template <class F>
inline int64_t splits_for(int64_t out, int64_t nunits, int64_t sms) {
  const int64_t per = units_per_split_of<F>(out, nunits, sms);
  return (nunits + per - 1) / per;
}

// The launch plan of weights ws[0 .. count) (count <= kMaxGroup; format F) against n rows of x on `sms`
// multiprocessors: the kernel's Group (each weight's split,
// its flat blocks) and the SplitSums of the weights with several splits, whose partials go to
// scratch(bytes) buffers (the caller keeps them alive until the sums ran). Shared by the launch and
// the host emulation. False when a weight's partials buffer does not hold its splits (the plan is then not
// to be launched: its kernel would write past that buffer or leave parts of it unwritten).
template <class F, class Scratch>
inline bool plan_group(const GroupWeight* ws, int count, int64_t in, int n, int64_t sms, const Scratch& scratch, Group& grp,
                       SplitSums& sums) {
  const int64_t nunits = in / F::kUnitElems;
  grp = Group{};
  sums = SplitSums{};
  grp.count = count;
  bool sized = true;
  for (int i = 0; i < count; ++i) {
    const GroupWeight& wt = ws[i];
    const int64_t per = units_per_split_of<F>(wt.out, nunits, sms);
    const int64_t splits = (nunits + per - 1) / per, row_blocks = (wt.out + kRowsPerBlock - 1) / kRowsPerBlock;
    grp.w[i] = wt.w, grp.row_bytes[i] = wt.row_bytes, grp.out[i] = wt.out, grp.per_split[i] = per;
    grp.dst[i] = wt.y;
    if (wt.partials > 0 && wt.partials != splits) sized = false;
    if (splits > 1 && wt.partials == 0) {
      grp.dst[i] = scratch(size_t(splits * n * wt.out) * sizeof(float));
      sums.part[sums.count] = grp.dst[i], sums.y[sums.count] = wt.y, sums.splits[sums.count] = int(splits);
      sums.elem0[sums.count + 1] = sums.elem0[sums.count] + int64_t(n) * wt.out;
      ++sums.count;
    }
    grp.block0[i + 1] = grp.block0[i] + row_blocks * splits;
  }
  return sized;
}

// Bytes of the split x of `in` inputs (any n <= 16): xb, xs, xm, each 16-byte aligned.
struct XSizes {
  size_t xb, xs, xm;
  explicit XSizes(int64_t in) {
    const int64_t groups = (in + kGroup - 1) / kGroup;
    xb = size_t(in / 32 * kMaxTiles * 32) * sizeof(uint2);
    xs = size_t(groups * kMaxCols) * sizeof(float);
    xm = size_t(groups * kMaxTiles * 32) * sizeof(uint32_t);
  }
  size_t total() const { return xb + xs + xm; }
  // The three arrays of a split x laid out at base (total() bytes, 16-byte aligned), as the split writes them.
  struct Parts {
    uint2* xb;
    float* xs;
    uint32_t* xm;
  };
  Parts at(uint8_t* base) const {
    return {reinterpret_cast<uint2*>(base), reinterpret_cast<float*>(base + xb), reinterpret_cast<uint32_t*>(base + xb + xs)};
  }
};

// pending += add, so that one sum launch serves both; flush(pending) first (then pending is emptied) when they
// would not fit one SplitSums (kMaxGroup weights). Host code: the launches' and the host emulation's.
template <class Flush>
inline void queue_sums(SplitSums& pending, const SplitSums& add, const Flush& flush) {
  if (pending.count + add.count > kMaxGroup) {
    flush(pending);
    pending = SplitSums{};
  }
  for (int i = 0; i < add.count; ++i) {
    const int k = pending.count++;
    pending.part[k] = add.part[i], pending.y[k] = add.y[i], pending.splits[k] = add.splits[i];
    pending.elem0[k + 1] = pending.elem0[k] + (add.elem0[i + 1] - add.elem0[i]);
  }
}

// dst (IQ4_XS_TILED / Q4_K_TILED / Q5_K_TILED) = src (IQ4_XS / Q4_K / Q5_K [out, nunits * 256], row-major, 4-byte
// aligned, out % 16 == 0; kBlock-byte blocks: a kHdr-byte header, Q5_K's qh[32] at kHdr, qs[128] at kQs) regrouped
// into IQ4T's / Q4T's / Q5T's tiles: one thread per 16 bytes of dst; a tile unit's kBlock pieces are its 128
// quant pieces (run i = q / 32, lane q % 32: words 4 i .. 4 i + 3, i.e. qs[16 k + 4 t ..] for k = 4 (i & 1) .. + 3,
// of row g + 8 (i / 2)), Q5_K's 32 qh pieces (lane q - 128: qh[4 t ..], qh[16 + 4 t ..] of row g, then of row g + 8)
// and its header pieces (the 16 rows' headers one after the other, 16 bytes a piece).
// kRecode (IQ4_XS): the quant words pass through iq4_tile_recode (IQ4T's indices); the K-quants' are copied.
template <int kBlock, int kHdr, bool kRecode>
__global__ void tile_q4_kernel(const uint8_t* __restrict__ src, int64_t nunits, int64_t pieces,
                               uint4* __restrict__ dst) {
  detail::pdl_wait();  // and never lets the next kernel launch early: a GEMV reads weights before waiting (pdl.cuh)
  const int64_t id = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (id >= pieces) return;
  constexpr int kQh = kBlock - 128 - kHdr, kQs = kHdr + kQh;  // Q5_K: 32 bytes of fifth bits, else none
  static_assert(kQh == 0 || kQh == 32, "tile_q4_kernel: IQ4_XS, Q4_K or Q5_K blocks");
  constexpr int kPieces = kBlock;  // 16-byte pieces per tile unit (16 rows x kBlock bytes): quants, qh, headers
  const int q = int(id % kPieces);
  const int64_t tu = id / kPieces, u = tu % nunits, tile = tu / nunits, row_bytes = nunits * kBlock;
  const uint8_t* base = src + tile * 16 * row_bytes + u * kBlock;  // row 0 of the tile, unit u
  const auto word = [](const uint8_t* p) { return *reinterpret_cast<const uint32_t*>(p); };
  uint32_t v[4];
  if (q < 128) {
    const int i = q >> 5, lane = q & 31, g = lane >> 2, t = lane & 3;
    const uint8_t* blk = base + (g + 8 * (i >> 1)) * row_bytes + kQs + 4 * t;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      v[m] = word(blk + 16 * (4 * (i & 1) + m));
      if constexpr (kRecode) v[m] = iq4_tile_recode(v[m]);
    }
  } else if (q < 128 + kQh) {
    const int lane = q - 128, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int m = 0; m < 4; ++m) v[m] = word(base + (g + 8 * (m >> 1)) * row_bytes + kHdr + 16 * (m & 1) + 4 * t);
  } else {
#pragma unroll
    for (int m = 0; m < 4; ++m) {  // header-area byte b = 16 (q - 128 - kQh) + 4 m: row b / kHdr, offset b % kHdr
      const int b = 16 * (q - 128 - kQh) + 4 * m;
      v[m] = word(base + (b / kHdr) * row_bytes + b % kHdr);
    }
  }
  dst[id] = make_uint4(v[0], v[1], v[2], v[3]);
}

// dst (Q6_K_TILED) = src (Q6_K [out, nunits * 256], row-major, 2-byte aligned, out % 16 == 0) regrouped
// into Q6T's tiles: one thread per 16 bytes of dst; a tile unit's 210 pieces are its 192 quant pieces
// (run i = q / 32 = 3 h + c, lane q % 32: Q6U::Raw words 4 c .. 4 c + 3 of row g + 8 h: ql bytes 16 k + 4 t
// for k = 4 c + m when c < 2, qh bytes 16 m + 4 t when c = 2), its 16 scale pieces (row q - 192) and
// its 2 d pieces (rows 0-7, 8-15). The source is only 2-byte aligned: read as 16-bit words.
__global__ void tile_q6_k_kernel(const uint8_t* __restrict__ src, int64_t nunits, int64_t pieces,
                                 uint4* __restrict__ dst) {
  detail::pdl_wait();  // and never lets the next kernel launch early (as tile_q4_kernel)
  const int64_t id = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (id >= pieces) return;
  const int q = int(id % 210);
  const int64_t tu = id / 210, u = tu % nunits, tile = tu / nunits, row_bytes = nunits * 210;
  const uint8_t* base = src + tile * 16 * row_bytes + u * 210;  // row 0 of the tile, unit u
  const auto half = [](const uint8_t* p) { return uint32_t(*reinterpret_cast<const uint16_t*>(p)); };
  const auto word = [&](const uint8_t* p) { return half(p) | (half(p + 2) << 16); };
  uint32_t v[4];
  if (q < 192) {
    const int i = q >> 5, lane = q & 31, g = lane >> 2, t = lane & 3, h = i / 3, c = i % 3;
    const uint8_t* blk = base + (g + 8 * h) * row_bytes;
#pragma unroll
    for (int m = 0; m < 4; ++m) v[m] = word(blk + (c < 2 ? 16 * (4 * c + m) : 128 + 16 * m) + 4 * t);
  } else if (q < 208) {
    const uint8_t* sc = base + (q - 192) * row_bytes + 192;
#pragma unroll
    for (int m = 0; m < 4; ++m) v[m] = word(sc + 4 * m);
  } else {
    const uint8_t* d0 = base + 8 * (q - 208) * row_bytes + 208;  // d of rows 8 (q - 208) + 0 .. 7
#pragma unroll
    for (int m = 0; m < 4; ++m) v[m] = half(d0 + 2 * m * row_bytes) | (half(d0 + (2 * m + 1) * row_bytes) << 16);
  }
  dst[id] = make_uint4(v[0], v[1], v[2], v[3]);
}

// The 16-byte pieces (threads) of tile_q4_kernel / tile_q6_k_kernel over `out` rows (out % 16 == 0) of nunits units:
// 16 x kBlock bytes a tile unit. The host emulation runs the kernels over these pieces too (host_emu/mma_main.cpp).
template <int kBlock>
__host__ __device__ constexpr int64_t tile_q4_pieces(int64_t out, int64_t nunits) {
  return out / 16 * nunits * kBlock;
}
__host__ __device__ constexpr int64_t tile_q6_k_pieces(int64_t out, int64_t nunits) { return out / 16 * nunits * 210; }

#ifndef SPECD_HOST_EMU
__global__ void sum_splits_kernel(const SplitSums s_) {
  detail::pdl_enter();
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e < s_.elem0[s_.count]) sum_splits_at(s_, e);
}

// The views of the split x of n rows of `in` inputs laid out at base (XSizes(in).total() bytes).
inline XView x_view(const uint8_t* base, int64_t in, int n) {
  const XSizes sz(in);
  return XView{reinterpret_cast<const uint2*>(base), reinterpret_cast<const float*>(base + sz.xb),
               reinterpret_cast<const uint32_t*>(base + sz.xb + sz.xs), 3 * n, 0};
}

// Bytes of BF16U's split x of `in` inputs (any n <= 16).
inline size_t xh_bytes(int64_t in) { return size_t(in / 32 * kMaxTiles * 32) * sizeof(uint4); }

// x [n, in] F32 -> BF16U's split x at xh (xh_bytes(in)), on stream s; the view of it.
inline XView split_x_bf16(const float* x, int64_t in, int n, uint4* xh, cudaStream_t s) {
  const int tiles = tiles_for(n);
  const int64_t threads = in / 32 * tiles * 32;
  detail::launch_kernel<split_x_bf16_kernel>("split_x_bf16_kernel", unsigned((threads + 127) / 128), 128, 0, s, x, in,
                                             n, tiles, xh);
  XView v{nullptr, nullptr, nullptr, 3 * n, 0};
  v.xh = xh;
  return v;
}

// The inputs of src (n rows of `in`, see PlainInput) -> their split at base (x_view), on stream s.
template <class In>
void launch_split_x(const In& src, int64_t in, int n, uint8_t* base, cudaStream_t s) {
  const XSizes::Parts x = XSizes(in).at(base);
  const int64_t groups = (in + kGroup - 1) / kGroup, threads = int64_t(n) * groups * 32;
  detail::launch_kernel<split_x_kernel<In>>("split_x_kernel", unsigned((threads + 127) / 128), 128, 0, s, src, in, n,
                                            groups, x.xb, x.xs, x.xm);
}

// One launch summing the split partials of sums (none when it holds no weight).
inline void launch_sums(const SplitSums& sums, cudaStream_t s) {
  if (sums.count == 0) return;
  const int64_t total = sums.elem0[sums.count];
  detail::launch_kernel<sum_splits_kernel>("sum_splits_kernel", unsigned((total + 255) / 256), 256, 0, s, sums);
}

// A launch's plan of weights ws[0 .. count) of format F (plan_group), checked: each partials output holds its
// weight's splits, the grid fits a launch with `other_blocks` more, the units fit the kernel's 32-bit indices.
template <class F, class Scratch>
Group checked_plan(const GroupWeight* ws, int count, int64_t in, int n, int64_t sms, const Scratch& scratch,
                   SplitSums& sums, int64_t other_blocks = 0) {
  Group grp;
  SPECD_CHECK(plan_group<F>(ws, count, in, n, sms, scratch, grp, sums),
              "matmul: a split-K partials output does not hold its GEMV's split count");
  SPECD_CHECK(grp.block0[count] + other_blocks <= 0x7fffffff, "matmul: too many blocks for one GEMV launch");
  SPECD_CHECK(in / F::kUnitElems <= kMaxUnits, "matmul: more than ", kMaxUnits, " units of ", F::kUnitElems,
              " inputs for one tensor-core GEMV");
  return grp;
}

// One launch of weights ws[0 .. count) (all of format F, count <= kMaxGroup) against the split x on
// `sms` multiprocessors; the split partials of those with several splits are left to sum, added to `pending`
// (queue_sums; when they would not fit, pending's sums are launched first: launch_sums). scratch(bytes) -> float*
// buffers for the partials, alive until the sums ran.
template <class F, int NT, class Scratch>
void launch(const GroupWeight* ws, int count, int64_t in, const XView& xv, int n, int64_t sms, const Scratch& scratch,
            SplitSums& pending, cudaStream_t s) {
  SplitSums sums;
  const Group grp = checked_plan<F>(ws, count, in, n, sms, scratch, sums);
  detail::launch_kernel<mma_gemv_kernel<F, NT>>("mma_gemv_kernel", unsigned(grp.block0[count]), kWarps * 32, 0, s, grp,
                                                in / F::kUnitElems, xv, n);
  queue_sums(pending, sums, [&](const SplitSums& full) { launch_sums(full, s); });
}

// One launch of two formats' weights against the split x (mma_gemv_pair_kernel): fs [0 .. nf) of format F and gs
// [0 .. ng) of format G, each planned as launch() plans them (so each weight's arithmetic is that of its own
// launch), their split partials left to sum as launch() leaves them.
template <class F, class G, int NT, class Scratch>
void launch_pair(const GroupWeight* fs, int nf, const GroupWeight* gs, int ng, int64_t in, const XView& xv, int n,
                 int64_t sms, const Scratch& scratch, SplitSums& pending, cudaStream_t s) {
  SplitSums sf, sg;
  const Group gg = checked_plan<G>(gs, ng, in, n, sms, scratch, sg);
  const Group gf = checked_plan<F>(fs, nf, in, n, sms, scratch, sf, gg.block0[ng]);
  detail::launch_kernel<mma_gemv_pair_kernel<F, G, NT>>("mma_gemv_pair_kernel", unsigned(gf.block0[nf] + gg.block0[ng]),
                                                        kWarps * 32, 0, s, gf, in / F::kUnitElems, gg,
                                                        in / G::kUnitElems, xv, n);
  for (const SplitSums* add : {&sf, &sg}) queue_sums(pending, *add, [&](const SplitSums& full) { launch_sums(full, s); });
}

// dst = src (Q6_K [out, in] on the device, out % 16 == 0, in % 256 == 0) in Q6T's tiled layout.
inline void launch_tile_q6_k(const uint8_t* src, int64_t out, int64_t in, uint8_t* dst, cudaStream_t s) {
  const int64_t nunits = in / 256, pieces = tile_q6_k_pieces(out, nunits);
  if (pieces == 0) return;
  SPECD_CHECK((pieces + 255) / 256 <= 0x7fffffff, "tile_for_gemv: too many blocks for one launch");
  detail::launch_kernel<tile_q6_k_kernel>("tile_q6_k_kernel", unsigned((pieces + 255) / 256), 256, 0, s, src, nunits,
                                          pieces, reinterpret_cast<uint4*>(dst));
}

// dst = src (IQ4_XS, Q4_K or Q5_K [out, in] on the device, out % 16 == 0, in % 256 == 0) in IQ4T's / Q4T's /
// Q5T's tiled layout.
template <int kBlock, int kHdr, bool kRecode>
inline void launch_tile_q4(const uint8_t* src, int64_t out, int64_t in, uint8_t* dst, cudaStream_t s) {
  const int64_t nunits = in / 256, pieces = tile_q4_pieces<kBlock>(out, nunits);
  if (pieces == 0) return;
  SPECD_CHECK((pieces + 255) / 256 <= 0x7fffffff, "tile_for_gemv: too many blocks for one launch");
  detail::launch_kernel<tile_q4_kernel<kBlock, kHdr, kRecode>>("tile_q4_kernel", unsigned((pieces + 255) / 256),
                                                               256, 0, s, src, nunits, pieces,
                                                               reinterpret_cast<uint4*>(dst));
}
inline void launch_tile_iq4_xs(const uint8_t* src, int64_t out, int64_t in, uint8_t* dst, cudaStream_t s) {
  launch_tile_q4<136, 8, true>(src, out, in, dst, s);
}
inline void launch_tile_q4_k(const uint8_t* src, int64_t out, int64_t in, uint8_t* dst, cudaStream_t s) {
  launch_tile_q4<144, 16, false>(src, out, in, dst, s);
}
inline void launch_tile_q5_k(const uint8_t* src, int64_t out, int64_t in, uint8_t* dst, cudaStream_t s) {
  launch_tile_q4<176, 16, false>(src, out, in, dst, s);
}

// Whether the tensor-core GEMV handles weight format t.
inline bool handles(DType t) {
  return t == DType::Q8_0 || t == DType::Q4_K || t == DType::Q5_K || t == DType::Q6_K || t == DType::IQ4_XS ||
         is_gemv_tiled(t);
}

// One weight of a tensor-core GEMV call: the grouped launch's view of it and its format.
struct Weight {
  GroupWeight g;
  DType t;
};

template <class F>
struct FormatTag {
  using type = F;
};

// f(FormatTag<F>{}) for the tensor-core unit type F of weight format t (handles(t), or BF16); fails
// naming the format otherwise.
template <class Fn>
void with_format(DType t, const Fn& f) {
  switch (t) {
    case DType::Q8_0: return f(FormatTag<Q8U>{});
    case DType::Q4_K: return f(FormatTag<QK45U<false>>{});
    case DType::Q5_K: return f(FormatTag<QK45U<true>>{});
    case DType::Q6_K: return f(FormatTag<Q6U>{});
    case DType::IQ4_XS: return f(FormatTag<IQ4U>{});
    case DType::IQ4_XS_TILED: return f(FormatTag<IQ4T>{});
    case DType::Q6_K_TILED: return f(FormatTag<Q6T>{});
    case DType::Q4_K_TILED: return f(FormatTag<Q4T>{});
    case DType::Q5_K_TILED: return f(FormatTag<Q5T>{});
    case DType::BF16: return f(FormatTag<BF16U>{});
    default: fail("matmul: no tensor-core GEMV for ", dtype_info(t).name);
  }
}

// Split-K partials the tensor-core GEMV computes for a weight of format t (handles(t)), `out` rows and
// `in` inputs (a multiple of the format's unit) on this device: plan_group's count, which a caller asking
// for the partials (GroupWeight::partials) sizes their buffer [splits][n][out] by.
inline int64_t gemv_splits(DType t, int64_t out, int64_t in) {
  int64_t splits = 1;
  with_format(t, [&](auto tag) {
    using F = typename decltype(tag)::type;
    splits = splits_for<F>(out, in / F::kUnitElems, sm_count());
  });
  return splits;
}

// The formats with a pair launch (mma_gemv_pair_kernel; try_pair): f(FormatTag<F>{}, FormatTag<G>{}) for a batch of
// format tf beside one of tg, true; false for any other pair. The pairs are the attention projections of the quant
// mixes the 27B ships in: q / k in tiled IQ4_XS or Q4_K, v in tiled Q6_K.
template <class Fn>
bool with_pair(DType tf, DType tg, const Fn& f) {
  if (tg != DType::Q6_K_TILED) return false;
  if (tf == DType::IQ4_XS_TILED) return f(FormatTag<IQ4T>{}, FormatTag<Q6T>{}), true;
  if (tf == DType::Q4_K_TILED) return f(FormatTag<Q4T>{}, FormatTag<Q6T>{}), true;
  return false;
}

// The launch batches of a call: each format's weights in order of first appearance, up to kMaxGroup a batch.
struct Batch {
  DType t;
  GroupWeight w[kMaxGroup];
  int count = 0;
};
inline std::vector<Batch> batches_of(const Weight* ws, int count) {
  std::vector<Batch> out;
  std::vector<bool> done(size_t(count), false);
  for (int i = 0; i < count; ++i) {
    if (done[size_t(i)]) continue;
    Batch b{ws[i].t};
    for (int j = i; j < count && b.count < kMaxGroup; ++j)  // this format's weights not yet batched
      if (!done[size_t(j)] && ws[j].t == ws[i].t) {
        b.w[b.count++] = ws[j].g;
        done[size_t(j)] = true;
      }
    out.push_back(b);
  }
  return out;
}

// Blocks of batch b's grouped launch (format F): each weight's row blocks x splits, as plan_group lays them out.
template <class F>
int64_t batch_blocks(const Batch& b, int64_t in, int64_t sms) {
  int64_t blocks = 0;
  for (int i = 0; i < b.count; ++i)
    blocks += (b.w[i].out + kRowsPerBlock - 1) / kRowsPerBlock * splits_for<F>(b.w[i].out, in / F::kUnitElems, sms);
  return blocks;
}

// Batches f and g launched as one pair launch (launch_pair, F = f's format) when their formats make a pair
// (with_pair), n rows fit the pair's instances (kPairMaxTiles) and g is small beside f (at most a quarter of f's
// blocks: G's blocks run without their register ring, which a large group would pay for); true when launched, false
// (nothing queued) otherwise.
template <class Scratch>
bool try_pair(const Batch& f, const Batch& g, int64_t in, const XView& xv, int n, int64_t sms, const Scratch& scratch,
              SplitSums& pending, cudaStream_t s) {
  if (tiles_for(n) > kPairMaxTiles) return false;
  bool launched = false;
  with_pair(f.t, g.t, [&](auto tf, auto tg) {
    using F = typename decltype(tf)::type;
    using G = typename decltype(tg)::type;
    if (4 * batch_blocks<G>(g, in, sms) > batch_blocks<F>(f, in, sms)) return;
    with_tiles(n, [&](auto nt) {  // n's tile count is at most kPairMaxTiles here: the clamp only keeps the tile
      constexpr int NT = std::min(int(decltype(nt)::value), kPairMaxTiles);  // counts past it from being instantiated
      launch_pair<F, G, NT>(f.w, f.count, g.w, g.count, in, xv, n, sms, scratch, pending, s);
    });
    launched = true;
  });
  return launched;
}

// y_i[n, out_i] = x[n, in] @ w_i^T for every weight (1 <= n <= 16, in % 32 == 0, every format
// handled) on x already split (xv: x_view of a split queued on the library stream before this
// call): each format's weights (up to kMaxGroup per launch) run as one grouped launch, or two batches as one pair
// launch (try_pair), and the split partials of all of them are summed by one launch after the last (the 27B's
// attention q / k (tiled IQ4_XS) and v (tiled Q6_K): one GEMV launch and one sum launch a layer).
inline void gemv_split(const Weight* ws, int count, int64_t in, const XView& xv, int n) {
  cudaStream_t s = stream();
  std::vector<std::shared_ptr<void>> scratch;  // split partials, freed stream-ordered after the kernels
  auto partials = [&](size_t bytes) {
    scratch.push_back(alloc(bytes));
    return static_cast<float*>(scratch.back().get());
  };
  const int64_t sms = sm_count();
  SplitSums pending;
  const std::vector<Batch> bs = batches_of(ws, count);
  const bool paired = bs.size() == 2 && (try_pair(bs[0], bs[1], in, xv, n, sms, partials, pending, s) ||
                                         try_pair(bs[1], bs[0], in, xv, n, sms, partials, pending, s));
  if (!paired)
    for (const Batch& b : bs)
      with_format(b.t, [&](auto tag) {
        using F = typename decltype(tag)::type;
        with_tiles(n, [&](auto nt) { launch<F, decltype(nt)::value>(b.w, b.count, in, xv, n, sms, partials, pending, s); });
      });
  launch_sums(pending, s);
}

// y_i = x @ w_i^T as gemv_split after splitting x [n, in] F32 (rows 16-byte aligned).
inline void gemv(const Weight* ws, int count, int64_t in, const float* x, int n) {
  std::shared_ptr<void> xsplit = alloc(XSizes(in).total());  // freed stream-ordered
  launch_split_x(PlainInput{x, in}, in, n, static_cast<uint8_t*>(xsplit.get()), stream());
  gemv_split(ws, count, in, x_view(static_cast<const uint8_t*>(xsplit.get()), in, n), n);
}

// Whether BF16 weight w ([out, in], data at `data`) runs on the tensor cores (BF16U): in % 64 == 0 and
// 16-byte aligned rows. Depends on the weight only, so a weight takes one GEMV at every width.
inline bool bf16_on_tensor_cores(const void* data, int64_t in) {
  return in % 64 == 0 && reinterpret_cast<uintptr_t>(data) % 16 == 0;
}

// y_i = x @ w_i^T for BF16 weights (bf16_on_tensor_cores) on x [n, in] F32 (rows 16-byte aligned).
inline void gemv_bf16(const Weight* ws, int count, int64_t in, const float* x, int n) {
  std::shared_ptr<void> xh = alloc(xh_bytes(in));  // freed stream-ordered
  const XView xv = split_x_bf16(x, in, n, static_cast<uint4*>(xh.get()), stream());
  gemv_split(ws, count, in, xv, n);
}

#endif  // SPECD_HOST_EMU

}  // namespace specd::gpu::detail::mma
#endif  // SPECD_MMA_GEMV
