// The split-K chunk pass of the exact attention path on tensor cores: decode, chain verify and tree
// verify over F16 K / V caches of head_dim 64, 128 or 256 with 16-byte aligned head rows (attention.cu's
// use_chunk_mma: every call on such caches that does not take the flash kernel, whatever its rows or
// mask; F32 / Q8_0 caches, other head_dims and HIP keep the CUDA-core chunk kernel). It writes the same
// per-chunk partials as attn_chunk_kernel, which attn_combine_kernel then combines in chunk order: for
// each query row, q head and chunk c of kChunk visible keys (cut by rank from the row's own visible
// sequence, as in attention.cu), m_c = max of the chunk's scores, l_c = sum of exp(s - m_c) and
// acc_c[e] = sum of exp(s - m_c) v[e].
//
// Also compiled for the host by tests/gpu/host_emu/chunk_main.cpp (SPECD_HOST_EMU: mma.sync emulated from
// the PTX ISA fragment layouts, warp_emu.h), which checks the layouts, the key walk and the masks against
// a float64 reference (tests/gpu/test_gpu_attention_mma_host.py); test_gpu_ops2.py checks the device.
//
// Work split. An m-tile is 16 (query row, q head) slots of one KV head's GQA group: without a window the
// heads of consecutive rows, packed in row order (every row's chunk c starts at rank kChunk c from
// position 0), with a window the heads of one row (each row's keys start at its own window). A block of
// kWarps warps takes one m-tile, one KV head and kWarps / ds * cpw chunks; it stages the m-tile's q once in
// shared memory as MMA fragments, then each warp walks its own chunks (no block-wide barrier): K and V are
// read from global memory straight into fragment registers (16-byte loads, no shared-memory staging;
// with ds = 1 the chunk's K and V rows requested from L2 first). With few chunks in flight (a short context: a
// decode at 200 keys has 4 chunks per KV head) ds = D / 64 warps share a chunk (the kernel's DS): each
// computes 8 / ds of S's key n-tiles, the warps exchange them in shared memory (a named barrier of the ds
// warps), then each computes P (the same values) and one 64-dim round of P V. A warp issues all of its K and
// V loads at once, so its chain of dependent loads is one round trip (with ds = 1, at head_dim 256: 8 K slabs,
// then 16 V k-steps); every value is computed by the same MMAs in the same order as with ds = 1, so ds never
// changes a bit. A chunk is read once per m-tile
// with the positions of the tile's row with the most keys when the tile's rows can share it: a decode
// reads each K row and each V row once, an 8-row chain verify three
// times from L2 (its m-tiles' blocks are adjacent in the grid). Else (a mask
// whose compacted positions differ between the rows, e.g. a tree's rows past the committed prefix; or a
// non-finite V at a key some row of the tile does not see) it is read once per row of the tile, each
// pass keeping its own row's slots.
//
// Arithmetic per warp and chunk (m16n8k16, F16 inputs, F32 accumulation):
//   S = Q K^T over the chunk's 64 keys: q is scaled by 2^sigma (sigma per slot, so that max |q| of the
//       slot lies in [2^13, 2^14)) and split into two F16 terms, q_hi = f16(q) and q_lo = f16(q - q_hi)
//       (|q - q_hi - q_lo| <= 2^-22 |q| + 2^-25), one MMA per term into the same F32 accumulator; K as
//       stored (F16, exact). The dims of a 16-byte load are the k indices of two k-steps (a fixed
//       permutation of the dot product's terms, the same for q and K).
//   s = (S * 2^-sigma) * scale (two F32 multiplies, the first exact), -inf past the slot's visible count;
//   m = max s; p = expf(s - m); l = fixed-order sum of p (lane, then quad butterfly);
//   acc = P V: p * 2^14 (exact) split into two F16 terms as q, V as stored, one MMA per term; then
//       acc * 2^-14 (exact). V's 16-byte loads hold 8 dims of one key; byte permutes pair two keys'
//       halves into the B fragment (8 dim n-tiles per load round).
// Each MMA output element is the dot product of one A row with one B column, so a slot's results depend
// only on its own q, its visible keys and the cache, not on which other slots share its m-tile: the path
// is batch invariant and a tree node equals the chain verify of its path bitwise (tests/gpu). Keys past
// the slot's count but below the tile's largest count (visible to another row of the tile) enter the
// MMAs with an exact zero weight: they are written rows, and a non-finite V among them sends the chunk
// to the per-row passes (zero times inf is NaN); keys past a pass's count are zero-filled.
// Error vs the CPU op: the q and p splits leave ~2^-22 relative, the tensor core's F32 accumulation a
// few F32 ulps per k-step: inside the exact path's tolerance (atol 2e-5 * max|v| + rtol 1e-4).
#pragma once

#include <type_traits>

#include "attention_flash.cuh"  // SPECD_FLASH_ATTN, mma(), quad_max(), quad_sum(), pdl
#include "attention_rows.cuh"   // SplitKParams, row_range()

#if SPECD_FLASH_ATTN

namespace specd::gpu::detail::chunk_mma {

using flash::mma;
using flash::quad_max;
using flash::quad_sum;

constexpr int kChunk = 64;           // keys per partial: attention.cu's kChunk (static_assert there)
constexpr int kWarps = 4;            // warps per block
constexpr int kSlots = 16;           // (row, q head) slots per m-tile: the MMA's 16 rows
constexpr int kMinBlocks = 3;        // blocks per multiprocessor the kernel is compiled for
constexpr float kPScale = 16384.0f;  // 2^14: p in [0, 1] scaled into F16's normal range before the split
constexpr int kQExp = 14;            // max |q| of a slot is scaled into [2^13, 2^14)

inline bool supported_dim(int64_t d) { return d == 64 || d == 128 || d == 256; }

// The split-K call's fields (attention_rows.cuh; dp = D) and the launch plan's.
struct Params : SplitKParams {
  int packed, mpr;  // slots of several rows per m-tile (packed) or mpr m-tiles per row
  int64_t mtiles;   // m-tiles in the slice
  int groups, cpw;  // chunk groups of kWarps / ds * cpw chunks per (m-tile, KV head) (ds: Plan's, the kernel's DS)
};

// The launch plan of a slice of `rows` rows: m-tiles, chunks per warp and the grid. packed: the rows'
// chunk c starts at the same rank (no window), so their slots share m-tiles. cpw only spreads the same per-chunk
// work over fewer warps (each chunk's partial is computed alone), so it never changes a result.
struct Plan {
  int packed, mpr, groups, cpw;
  int ds;  // warps per chunk: 1, or D / 64 (<= kWarps), each warp then taking one of P V's 64-dim rounds
  int64_t mtiles, blocks;
};

// d: the head_dim (supported_dim). ds, like cpw, only changes which warp computes a value, never how.
inline Plan plan(int64_t rows, int64_t r, int64_t hkv, int64_t nch, bool packed, int64_t resident_warps, int d) {
  Plan p{};
  p.packed = packed ? 1 : 0;
  p.mpr = int((r + kSlots - 1) / kSlots);
  p.mtiles = packed ? (rows * r + kSlots - 1) / kSlots : rows * p.mpr;
  // (m-tile, KV head, chunk) tasks, cpw per warp. Below 1.5 waves of warps one chunk each (halving the
  // warps in flight costs more than the tail wave), else one wave of ceil(tasks / warps) chunks each (a
  // short last wave would run at a fraction of the bandwidth). H200: at 32k keys a decode (1.3 waves)
  // runs its chunk pass in 65 us with 1 against 68 with 2, an 8-row verify (3.9) in 135 us with 4 against
  // 153 with 1; at 131k a decode (5.2) in 197 us with 6 against 234 with 5.
  const int64_t tasks = p.mtiles * hkv * nch, warps = resident_warps > 0 ? resident_warps : 1;
  int64_t cpw = 2 * tasks < 3 * warps ? 1 : (tasks + warps - 1) / warps;
  cpw = cpw > nch ? nch : cpw;
  p.cpw = int(cpw);
  // A warp per 64-dim round of P V where that keeps the tasks' warps under 1.5 waves too (then cpw = 1).
  // (Only ds = 1 or d / 64, the kernel instances there are: a warp of a shared chunk takes one 64-dim round.)
  const int rounds = d / 64;
  p.ds = rounds <= kWarps && 2 * tasks * rounds < 3 * warps ? rounds : 1;
  const int64_t per_group = kWarps / p.ds * cpw;  // chunks per (m-tile, KV head, group)
  p.groups = int((nch + per_group - 1) / per_group);
  p.blocks = p.mtiles * p.groups * hkv;
  return p;
}

// f(std::integral_constant<int, D>(), std::integral_constant<int, DS>()) for the kernel instance of head_dim d
// and a plan's ds (D = d, DS = ds); false (nothing called) for a pair without an instance.
template <class F>
bool with_instance(int d, int ds, F&& f) {
  using std::integral_constant;
  if (d == 64 && ds == 1) return f(integral_constant<int, 64>(), integral_constant<int, 1>()), true;
  if (d == 128 && ds == 1) return f(integral_constant<int, 128>(), integral_constant<int, 1>()), true;
  if (d == 128 && ds == 2) return f(integral_constant<int, 128>(), integral_constant<int, 2>()), true;
  if (d == 256 && ds == 1) return f(integral_constant<int, 256>(), integral_constant<int, 1>()), true;
  if (d == 256 && ds == 4) return f(integral_constant<int, 256>(), integral_constant<int, 4>()), true;
  return false;
}

// The plan's fields of Params (the split-K call's are the caller's).
inline void set_plan(Params& P, const Plan& pl) {
  P.packed = pl.packed;
  P.mpr = pl.mpr;
  P.mtiles = pl.mtiles;
  P.groups = pl.groups;
  P.cpw = pl.cpw;
}

// --- helpers ---------------------------------------------------------------------------------------

// Two floats as two F16 terms each: hi = f16(a), lo = f16(a - hi) (a - hi is exact in F32), packed two
// per register, the first in the lower 16 bits.
__device__ __forceinline__ void split_f16x2(float a, float b, uint32_t& hi, uint32_t& lo) {
#if defined(SPECD_HOST_EMU)
  const uint16_t ha = f16_rn(a), hb = f16_rn(b);
  hi = uint32_t(ha) | (uint32_t(hb) << 16);
  lo = uint32_t(f16_rn(__fsub_rn(a, f16_f(ha)))) | (uint32_t(f16_rn(__fsub_rn(b, f16_f(hb)))) << 16);
#else
  const __half2 h = __floats2half2_rn(a, b);
  const float2 f = __half22float2(h);
  const __half2 l = __floats2half2_rn(__fsub_rn(a, f.x), __fsub_rn(b, f.y));
  hi = *reinterpret_cast<const uint32_t*>(&h);
  lo = *reinterpret_cast<const uint32_t*>(&l);
#endif
}

// Whether none of the 8 F16 values is inf or NaN (exponent bits all ones).
__device__ __forceinline__ bool finite_f16x8(const uint4& v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  bool ok = true;
#pragma unroll
  for (int i = 0; i < 4; ++i) ok = ok && (w[i] & 0x7c00u) != 0x7c00u && (w[i] & 0x7c000000u) != 0x7c000000u;
  return ok;
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// 16 bytes of a cache row (read-only for the kernel's duration), or zeros.
__device__ __forceinline__ uint4 load16(const uint8_t* p, bool ok) {
  return ok ? __ldg(reinterpret_cast<const uint4*>(p)) : uint4{0u, 0u, 0u, 0u};
}

// Asks L2 for the 128-byte line at p (no register, no wait): the chunk's K and V lines are requested
// ahead of the fragment loads, which then wait on L2 instead of DRAM.
__device__ __forceinline__ void prefetch_l2(const uint8_t* p) {
#if !defined(SPECD_HOST_EMU) && defined(__CUDA_ARCH__)
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#else
  (void)p;
#endif
}

// Barrier of the DS warps that share a chunk (PTX named barrier 1 + wc; __syncthreads is barrier 0): the warps of
// a block's other chunk may have left the chunk loop or be in another of its passes.
template <int DS>
__device__ __forceinline__ void chunk_sync(int wc) {
#if defined(SPECD_HOST_EMU)
  specd_emu_bar_sync(1 + wc, DS * 32);
#else
  asm volatile("bar.sync %0, %1;" ::"r"(1 + wc), "n"(DS * 32) : "memory");
#endif
}

// --- the kernel ------------------------------------------------------------------------------------

// Grid: m-tiles fastest, then chunk groups, then KV heads. Idx: the rows' visible positions come from
// P.idx (a mask) rather than lo + rank.
template <int D, bool Idx, int DS>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks) attn_chunk_mma_kernel(const Params P) {
  pdl_enter();
  static_assert(D % 64 == 0 && D <= 256, "head_dim 64, 128 or 256");
  static_assert((DS == 1 || DS == D / 64) && kWarps % DS == 0, "DS: 1, or D / 64 warps per chunk, one round each");
  constexpr int NS = D / 32;  // 32-dim slabs of q / K: two k-steps each
  // q fragments: [slab][register quad][lane], 16 bytes each; quads: hi of k-step 2 slab (A regs 0-3),
  // lo of it, hi of k-step 2 slab + 1, lo of it.
  __shared__ uint4 sq[NS * 4 * 32];
  __shared__ uint4 sp[kWarps * 8 * 32];  // each warp's P fragments of its current chunk
  __shared__ float4 ss[DS > 1 ? kWarps / DS * 8 * 32 : 1];  // DS > 1: a chunk's S, [chunk of the block][n-tile][lane]
  __shared__ int s_row[kSlots], s_head[kSlots], s_cnt[kSlots];
  __shared__ float s_unscale[kSlots];
  __shared__ int64_t s_lo;

  int64_t b = blockIdx.x;
  const int64_t mt = b % P.mtiles;
  b /= P.mtiles;
  const int grp = int(b % P.groups);
  const int g = int(b / P.groups);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gq = lane >> 2, tq = lane & 3;
  // This warp's chunk of the block's kWarps / DS in flight and its P V rounds [rd0, rd0 + kRounds) of D / 64.
  constexpr int cpb = kWarps / DS, kRounds = D / 64 / DS;
  const int wc = warp / DS, rd0 = warp % DS * kRounds;

  // Slot table: slice row (-1: empty slot), q head, visible count.
  if (tid < kSlots) {
    int64_t il = -1;
    int hh = 0;
    if (P.packed) {
      const int64_t rh = mt * kSlots + tid;
      if (rh < P.rows * P.r) {
        il = rh / P.r;
        hh = int(rh % P.r);
      }
    } else {
      hh = int(mt % P.mpr) * kSlots + tid;
      if (hh < P.r) il = mt / P.mpr;
    }
    int64_t lo = 0, cnt = 0;
    if (il >= 0) row_range(P, P.i0 + il, lo, cnt);
    s_row[tid] = int(il);
    s_head[tid] = g * P.r + hh;
    s_cnt[tid] = int(cnt);
    if (tid == 0) s_lo = lo;  // slot 0 is never empty; unpacked, every slot is its row
  }
  __syncthreads();
  int maxcnt = 0;
#pragma unroll
  for (int s = 0; s < kSlots; ++s) maxcnt = max(maxcnt, s_cnt[s]);
  if (int64_t(grp) * cpb * P.cpw * kChunk >= maxcnt) return;  // uniform over the block

  // Stage q: warp w takes slots 4w .. 4w + 3; lane = 8 dims (dims 8 lane .. 8 lane + 7).
  for (int s = warp * 4; s < warp * 4 + 4; ++s) {
    const int il = s_row[s];
    const bool has = lane < D / 8;
    float x[8];
    float amax = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      x[e] = has && il >= 0 ? P.q[((P.i0 + il) * P.hq + s_head[s]) * D + 8 * lane + e] : 0.0f;
      amax = fmaxf(amax, fabsf(x[e]));
    }
    amax = warp_max(amax);
    // sigma in [-114, 126] for finite q (2^-sigma stays a normal float); 0 for a zero or non-finite q.
    int ex = 0;
    const bool scaled = amax > 0.0f && isfinite(amax);
    if (scaled) frexpf(amax, &ex);
    const int sigma = scaled ? min(126, kQExp - ex) : 0;
    if (lane == 0) s_unscale[s] = ldexpf(1.0f, -sigma);  // a power of two in the normal range
    if (has) {
      uint32_t hi[4], lo[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) split_f16x2(ldexpf(x[2 * e], sigma), ldexpf(x[2 * e + 1], sigma), hi[e], lo[e]);
      // Dims 8 lane + {0,1}, {2,3} are k-step 2j's a0 / a2 (rows 0-7) or a1 / a3 (rows 8-15) of lane
      // 4 (s % 8) + lane % 4, dims {4,5}, {6,7} the same registers of k-step 2j + 1 (j = lane / 4).
      uint32_t* const w = reinterpret_cast<uint32_t*>(sq);
      const int j = lane / 4, t = (s % 8) * 4 + lane % 4, ar = s >= 8 ? 1 : 0;
      auto put = [&](int reg, uint32_t v) { w[((j * 4 + reg / 4) * 32 + t) * 4 + reg % 4] = v; };
      put(ar, hi[0]);
      put(ar + 2, hi[1]);
      put(8 + ar, hi[2]);
      put(8 + ar + 2, hi[3]);
      put(4 + ar, lo[0]);
      put(4 + ar + 2, lo[1]);
      put(12 + ar, lo[2]);
      put(12 + ar + 2, lo[3]);
    }
  }
  __syncthreads();

  // This thread's slots: gq (accumulator elements 0, 1) and gq + 8 (2, 3).
  const int row_a = s_row[gq], row_b = s_row[gq + 8];
  const int cnt_a = s_cnt[gq], cnt_b = s_cnt[gq + 8];
  const float un_a = s_unscale[gq], un_b = s_unscale[gq + 8];
  const int64_t out_a = row_a >= 0 ? (int64_t(row_a) * P.hq + s_head[gq]) * P.nch : 0;
  const int64_t out_b = row_b >= 0 ? (int64_t(row_b) * P.hq + s_head[gq + 8]) * P.nch : 0;
  const int64_t lo = s_lo;
  const uint8_t* const kline = P.kc + int64_t(g) * P.k_head_stride;  // the KV head's rows
  const uint8_t* const vline = P.vc + int64_t(g) * P.v_head_stride;
  const uint8_t* const kbase = kline + 16 * tq;  // this lane's 16 bytes of a slab
  const uint8_t* const vbase = vline + 16 * gq;  // of a load round
  // The tile's rows (consecutive) and the one with the most visible keys (the leader: its positions
  // serve every row when the rows agree on a chunk).
  int first_row = s_row[0], last_row = s_row[0], lead = s_row[0], lead_cnt = s_cnt[0];
#pragma unroll
  for (int x = 1; x < kSlots; ++x)
    if (s_row[x] >= 0) {
      last_row = s_row[x];
      if (s_cnt[x] > lead_cnt) lead = s_row[x], lead_cnt = s_cnt[x];
    }
  auto row_cnt = [&](int row) {  // a row of the tile's visible count
    int n = 0;
#pragma unroll
    for (int x = 0; x < kSlots; ++x) n = s_row[x] == row ? s_cnt[x] : n;
    return n;
  };
  auto idx_of = [&](int row) { return P.idx + (P.i0 + row) * P.kv_len; };

  for (int k = 0; k < P.cpw; ++k) {
    const int c = (grp * P.cpw + k) * cpb + wc;
    const int64_t r0 = int64_t(c) * kChunk;
    if (r0 >= maxcnt) break;  // uniform over the warp; later chunks are further
    // Packed rows read the chunk once, with the leader's positions, when they can share it; else once
    // per row, each pass keeping only its own row's slots. They cannot (1) under a mask where their
    // compacted positions differ (a tree's rows past the committed prefix), (2) where a key that some
    // row of the tile does not see holds a non-finite V (an F16 cache stores inf past 65504): that row's
    // zero weight times it would be NaN, which the row alone would never compute.
    bool agree = true;
    if (first_row != last_row) {
      int ok = 1, min_vis = kChunk;  // min_vis: the fewest keys a row with keys in this chunk sees
      for (int row = first_row; row <= last_row; ++row) {
        const int64_t n = row_cnt(row) - r0;
        if (n > 0 && n < min_vis) min_vis = int(n);  // a row without keys here writes nothing for it
        if (Idx) {
          for (int j = lane; j < kChunk; j += 32)
            if (j < n && idx_of(row)[r0 + j] != idx_of(lead)[r0 + j]) ok = 0;
        }
      }
      agree = warp_min(ok) != 0;
      const int cc = int(maxcnt - r0 < kChunk ? maxcnt - r0 : kChunk);
      if (agree && min_vis < cc) {  // V of the keys [min_vis, cc), 16 bytes a lane
        for (int x = lane; x < (cc - min_vis) * (D / 8); x += 32) {
          const int j = min_vis + x / (D / 8);
          const int64_t key_row = Idx ? int64_t(idx_of(lead)[r0 + j]) : lo + r0 + j;
          const uint4 w = __ldg(reinterpret_cast<const uint4*>(vline + key_row * P.v_row_stride) + x % (D / 8));
          if (!finite_f16x8(w)) ok = 0;
        }
        agree = warp_min(ok) != 0;
      }
    }
    for (int only = agree ? -1 : first_row; only <= (agree ? -1 : last_row); ++only) {  // uniform
      const int src = only < 0 ? lead : only;  // whose positions the pass reads
      const int64_t span = (only < 0 ? maxcnt : row_cnt(only)) - r0;
      if (span <= 0) continue;
      const int cc = int(span < kChunk ? span : kChunk);  // keys read (zeros past them)
      const int32_t* const idx_row = Idx ? idx_of(src) : nullptr;
      auto pos = [&](int j) -> int64_t { return Idx ? int64_t(idx_row[r0 + j]) : lo + r0 + j; };

      // S = Q K^T: key n-tile t holds keys 8 t .. 8 t + 7; this lane loads key 8 t + gq, dims
      // 32 slab + 8 tq .. + 7 (one 16-byte load = B of k-steps 2 slab and 2 slab + 1).
      auto kload_row = [&](int32_t row, int sl) { return load16(kbase + int64_t(row) * P.k_row_stride + 64 * sl, row >= 0); };
      // S of key n-tile t over slab sl: q's hi and lo terms of the slab's two k-steps, in that order (one fixed
      // order of MMAs per element, whichever warp computes it).
      auto s_slab = [&](float (&st)[4], const uint4& kb, int sl) {
        const uint4* const qf = sq + sl * 4 * 32 + lane;
        const uint4 q0 = qf[0], q1 = qf[32], q2 = qf[64], q3 = qf[96];
        const uint32_t ah0[4] = {q0.x, q0.y, q0.z, q0.w}, al0[4] = {q1.x, q1.y, q1.z, q1.w};
        const uint32_t ah1[4] = {q2.x, q2.y, q2.z, q2.w}, al1[4] = {q3.x, q3.y, q3.z, q3.w};
        mma(st, ah0, kb.x, kb.y);
        mma(st, al0, kb.x, kb.y);
        mma(st, ah1, kb.z, kb.w);
        mma(st, al1, kb.z, kb.w);
      };
      // V of round rd0: lane loads keys 16 kk + 2 tq + {0, 1, 8, 9} of k-step kk, dims 64 rd + 8 gq .. + 7.
      int32_t vp[4][4];  // cache row of each key, -1 past cc (set_vp: after S with DS == 1, which needs the registers)
      auto set_vp = [&] {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const int j = 16 * kk + 2 * tq + (u & 1) + 8 * (u >> 1);
            vp[kk][u] = j < cc ? int32_t(pos(j)) : -1;
          }
      };
      auto vload = [&](int kk, int u, int rd) {
        return load16(vbase + int64_t(vp[kk][u]) * P.v_row_stride + 128 * rd, vp[kk][u] >= 0);
      };
      float s[8][4];
      uint4 vb[4];                         // DS == 1: V of the k-step computed next (the others load during P V)
      uint4 vall[DS > 1 ? 4 : 1][4];       // DS > 1 (one round, kRounds == 1): V of all four k-steps, loaded with K
      if constexpr (DS == 1) {
        int32_t kp[8];  // cache row of each key, -1 past cc
#pragma unroll
        for (int t = 0; t < 8; ++t) kp[t] = 8 * t + gq < cc ? int32_t(pos(8 * t + gq)) : -1;
        // The chunk's K rows requested from L2 at once: line tq of key 8 t + gq.
        if (tq < D / 64) {
#pragma unroll
          for (int t = 0; t < 8; ++t)
            if (kp[t] >= 0) prefetch_l2(kline + int64_t(kp[t]) * P.k_row_stride + 128 * tq);
        }
#pragma unroll
        for (int t = 0; t < 8; ++t)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[t][e] = 0.0f;
        uint4 kb[8];
#pragma unroll
        for (int t = 0; t < 8; ++t) kb[t] = kload_row(kp[t], 0);
#pragma unroll 2  // not whole: fully unrolled, the scheduler interleaves the slabs and spills
        for (int sl = 0; sl < NS; ++sl) {
          uint4 kn[8];
          if (sl + 1 < NS) {
#pragma unroll
            for (int t = 0; t < 8; ++t) kn[t] = kload_row(kp[t], sl + 1);
          }
#pragma unroll
          for (int t = 0; t < 8; ++t) s_slab(s[t], kb[t], sl);
          if (sl + 1 < NS) {
#pragma unroll
            for (int t = 0; t < 8; ++t) kb[t] = kn[t];
          }
        }
#pragma unroll 1
        for (int j = lane; j < cc; j += 32) {  // the V lines of this warp's rounds requested from L2 at once
          const uint8_t* const row = vline + pos(j) * P.v_row_stride;
#pragma unroll
          for (int x = 0; x < kRounds; ++x) prefetch_l2(row + 128 * (rd0 + x));
        }
        // V of load round rd0, k-step 0 in flight during the softmax.
        set_vp();
#pragma unroll
        for (int u = 0; u < 4; ++u) vb[u] = vload(0, u, rd0);
      } else {
        // The DS warps of the chunk split S's 8 key n-tiles (TPW each) and exchange them in shared memory. A warp
        // issues every load of its tiles' K (every slab) and of its round's V at once: one round trip to memory
        // where one warp computing all of S waited on NS dependent ones, and the P V k-steps on 3 more. Each S
        // element is the same MMAs in the same order as with DS == 1 (s_slab), so the split changes no bit.
        static_assert(kRounds == 1, "DS > 1: one 64-dim round of P V a warp");
        constexpr int TPW = 8 / DS;
        const int t0 = (warp % DS) * TPW;
        uint4 kb[TPW][NS];
#pragma unroll
        for (int i = 0; i < TPW; ++i) {
          const int j = 8 * (t0 + i) + gq;
          const int32_t row = j < cc ? int32_t(pos(j)) : -1;
#pragma unroll
          for (int sl = 0; sl < NS; ++sl) kb[i][sl] = kload_row(row, sl);
        }
        set_vp();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
          for (int u = 0; u < 4; ++u) vall[kk][u] = vload(kk, u, rd0);
        float sk[TPW][4];
#pragma unroll
        for (int i = 0; i < TPW; ++i) {
#pragma unroll
          for (int e = 0; e < 4; ++e) sk[i][e] = 0.0f;
#pragma unroll
          for (int sl = 0; sl < NS; ++sl) s_slab(sk[i], kb[i][sl], sl);
        }
        float4* const sx = ss + wc * 8 * 32 + lane;
#pragma unroll
        for (int i = 0; i < TPW; ++i) sx[(t0 + i) * 32] = make_float4(sk[i][0], sk[i][1], sk[i][2], sk[i][3]);
        chunk_sync<DS>(wc);
#pragma unroll
        for (int t = 0; t < 8; ++t) {
          const float4 v = sx[t * 32];
          s[t][0] = v.x, s[t][1] = v.y, s[t][2] = v.z, s[t][3] = v.w;
        }
        chunk_sync<DS>(wc);  // every warp holds the chunk's S before a next pass overwrites it
      }

      // Softmax within the chunk. Element (t, e): slot gq (e < 2) or gq + 8, key 8 t + 2 tq + e % 2.
      const int vis_a = int(cnt_a - r0 < kChunk ? cnt_a - r0 : kChunk);
      const int vis_b = int(cnt_b - r0 < kChunk ? cnt_b - r0 : kChunk);
      float ma = -INFINITY, mb = -INFINITY;
#pragma unroll
      for (int t = 0; t < 8; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = 8 * t + 2 * tq + (e & 1);
          const bool a = e < 2;
          const float x = j < (a ? vis_a : vis_b) ? __fmul_rn(__fmul_rn(s[t][e], a ? un_a : un_b), P.scale) : -INFINITY;
          s[t][e] = x;
          if (a) ma = fmaxf(ma, x);
          else mb = fmaxf(mb, x);
        }
      ma = quad_max(ma);
      mb = quad_max(mb);
      float la = 0.0f, lb = 0.0f;
#pragma unroll
      for (int t = 0; t < 8; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool a = e < 2;
          const float m = a ? ma : mb;
          const float p = s[t][e] == -INFINITY ? 0.0f : expf(s[t][e] - m);
          s[t][e] = __fmul_rn(p, kPScale);
          if (a) la += p;
          else lb += p;
        }
      la = quad_sum(la);
      lb = quad_sum(lb);
      // P as the A fragments of the 4 key k-steps (n-tiles 2 kk, 2 kk + 1), two F16 terms each, parked in
      // the warp's shared memory (registers are what bounds the kernel's occupancy).
      uint4* const pf = sp + warp * 8 * 32 + lane;  // [kk][hi, lo][lane]
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        uint32_t h[4], l[4];
        split_f16x2(s[2 * kk][0], s[2 * kk][1], h[0], l[0]);
        split_f16x2(s[2 * kk][2], s[2 * kk][3], h[1], l[1]);
        split_f16x2(s[2 * kk + 1][0], s[2 * kk + 1][1], h[2], l[2]);
        split_f16x2(s[2 * kk + 1][2], s[2 * kk + 1][3], h[3], l[3]);
        pf[(2 * kk) * 32] = uint4{h[0], h[1], h[2], h[3]};
        pf[(2 * kk + 1) * 32] = uint4{l[0], l[1], l[2], l[3]};
      }
      const bool wa = row_a >= 0 && vis_a > 0 && (only < 0 || row_a == only);
      const bool wb = row_b >= 0 && vis_b > 0 && (only < 0 || row_b == only);
      if (tq == 0 && rd0 == 0) {  // one writer of the chunk's (m, l)
        if (wa) *reinterpret_cast<float2*>(P.ml + (out_a + c) * 2) = make_float2(ma, la);
        if (wb) *reinterpret_cast<float2*>(P.ml + (out_b + c) * 2) = make_float2(mb, lb);
      }

      // acc = P V, 64 dims per round: dim n-tile e of round rd holds dims 64 rd + 8 n + e (n = the B
      // column, gq for this lane's loads), so this lane's accumulators are dims 64 rd + 16 tq + e (n = 2 tq)
      // and 64 rd + 16 tq + 8 + e (n = 2 tq + 1).
#pragma unroll 1
      for (int ri = 0; ri < kRounds; ++ri) {  // not unrolled: interleaved rounds would hold two sets of o
        const int rd = rd0 + ri;
        float o[8][4];
#pragma unroll
        for (int e = 0; e < 8; ++e)
#pragma unroll
          for (int x = 0; x < 4; ++x) o[e][x] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          // DS == 1: the next k-step's V (of this round or the next) loads during this one's MMAs.
          uint4 vn[4];
          const int nri = kk == 3 ? ri + 1 : ri, nkk = (kk + 1) & 3;
          const bool next = DS == 1 && nri < kRounds;
          if (next) {
#pragma unroll
            for (int u = 0; u < 4; ++u) vn[u] = vload(nkk, u, rd0 + nri);
          }
          const uint4 h4 = pf[(2 * kk) * 32], l4 = pf[(2 * kk + 1) * 32];  // only this lane's own stores
          const uint32_t ph[4] = {h4.x, h4.y, h4.z, h4.w}, pl[4] = {l4.x, l4.y, l4.z, l4.w};
          const uint4* const v = DS == 1 ? vb : vall[DS > 1 ? kk : 0];
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const uint32_t sel = (e & 1) ? 0x7632u : 0x5410u;
            const uint32_t b0 = __byte_perm(word(v[0], e / 2), word(v[1], e / 2), sel);
            const uint32_t b1 = __byte_perm(word(v[2], e / 2), word(v[3], e / 2), sel);
            mma(o[e], ph, b0, b1);
            mma(o[e], pl, b0, b1);
          }
          if (next) {
#pragma unroll
            for (int u = 0; u < 4; ++u) vb[u] = vn[u];
          }
        }
        // acc * 2^-14 of slot gq (x = 0: elements 0, 1) or gq + 8 (x = 2): dims e0 .. e0 + 15.
        const int e0 = 64 * rd + 16 * tq;
        auto store = [&](int64_t out, int x) {
          constexpr float inv = 1.0f / kPScale;
          float4* const dst = reinterpret_cast<float4*>(P.part + (out + c) * D + e0);
          dst[0] = make_float4(o[0][x] * inv, o[1][x] * inv, o[2][x] * inv, o[3][x] * inv);
          dst[1] = make_float4(o[4][x] * inv, o[5][x] * inv, o[6][x] * inv, o[7][x] * inv);
          dst[2] = make_float4(o[0][x + 1] * inv, o[1][x + 1] * inv, o[2][x + 1] * inv, o[3][x + 1] * inv);
          dst[3] = make_float4(o[4][x + 1] * inv, o[5][x + 1] * inv, o[6][x + 1] * inv, o[7][x + 1] * inv);
        };
        if (wa) store(out_a, 0);
        if (wb) store(out_b, 2);
      }
    }
  }
}

}  // namespace specd::gpu::detail::chunk_mma

#endif  // SPECD_FLASH_ATTN
