// The compaction of an attention mask (attention.cu, calls with a mask): idx[i, 0..cnt[i]) = the positions
// of row i's visible range [lo, hi) (visible_range) whose mask entry is nonzero, in increasing order;
// idx[i, cnt[i]..) is never written. Also compiled for the host by the emulation harness
// (tests/gpu/host_emu/mask_main.cpp).
//
// Each row is cut into segments of kSeg positions from 0 (the grid is sized from the host kv_len alone)
// and every kernel runs one block per (row, segment), so a few rows of long masks still fill the device
// (one block per row was latency-bound: 36 us for 8 rows of 32768 keys, 151 us at 131072, on an H200).
//   pass 1 (attn_mask_count_kernel): the segment's visible entries -> seg[i, s];
//   pass 2 (attn_mask_compact_kernel): the segment's first rank = the sum of seg[i, 0..s) (summed by the
//           block: at most kv_len / kSeg counts), plus an exclusive scan of its threads' counts (a shuffle
//           scan per warp plus a scan of the warp totals); the row's last segment writes cnt[i].
// A row of one segment needs no pass 1 (nothing precedes it), so short masks (tree verify over a short
// prefix) stay one launch. Integer sums only: the result does not depend on the split.
#pragma once

#ifndef SPECD_HOST_EMU
#include "common.cuh"
#endif

#include <cstdint>

#include "attention_rows.cuh"
#include "pdl.cuh"
#include "warp_reduce.cuh"

namespace specd::gpu::detail::mask {

// kPer consecutive entries per thread (32 measured slower on the H200: a warp's loads then touch 32 lines
// each), so a segment is one load of each thread.
constexpr int kThreads = 256, kPer = 8, kWarps = kThreads / SPECD_WARP;
constexpr int64_t kSeg = int64_t(kThreads) * kPer;

struct Params {
  const int32_t* mask;   // [n, kv_len]
  const int32_t* q_pos;  // [n]
  int64_t kv_len, window;
  int causal;
  int nseg;      // segments per row: ceil(kv_len / kSeg)
  int32_t* seg;  // [n, nseg] visible entries per segment (pass 1); unused when nseg == 1
  int32_t* idx;  // [n, kv_len]
  int32_t* cnt;  // [n]
};

inline int segments(int64_t kv_len) { return int((kv_len + kSeg - 1) / kSeg); }

// Bit e: the entry j0 + e (j0 = this thread's first entry of segment s of row i) is visible. Reads only
// [lo, hi), a subrange of [0, kv_len) whatever q_pos holds.
__device__ __forceinline__ unsigned visible_bits(const Params& P, int64_t i, int64_t s, int t, int64_t& j0) {
  int64_t lo, hi;
  visible_range(P.q_pos[i], P.window, P.causal != 0, P.kv_len, lo, hi);
  j0 = s * kSeg + int64_t(t) * kPer;
  const int32_t* mrow = P.mask + i * P.kv_len;
  unsigned vis = 0;
#pragma unroll
  for (int e = 0; e < kPer; ++e) vis |= (j0 + e >= lo && j0 + e < hi && mrow[j0 + e] != 0) ? 1u << e : 0u;
  return vis;
}

__global__ void __launch_bounds__(kThreads) attn_mask_count_kernel(const Params P) {
  pdl_enter();
  __shared__ int wsum[kWarps];
  const int64_t i = blockIdx.x / P.nseg, s = blockIdx.x % P.nseg;
  const int t = threadIdx.x;
  int64_t j0;
  const int c = warp_sum(__popc(visible_bits(P, i, s, t, j0)));
  if (t % SPECD_WARP == 0) wsum[t / SPECD_WARP] = c;
  __syncthreads();
  if (t == 0) {
    int total = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += wsum[w];
    P.seg[blockIdx.x] = total;
  }
}

__global__ void __launch_bounds__(kThreads) attn_mask_compact_kernel(const Params P) {
  pdl_enter();
  __shared__ int wsum[kWarps], wpre[kWarps];
  const int64_t i = blockIdx.x / P.nseg, s = blockIdx.x % P.nseg;
  const int t = threadIdx.x, lane = t % SPECD_WARP, warp = t / SPECD_WARP;
  int pre = 0;  // this thread's share of the row's visible entries before the segment
  for (int64_t x = t; x < s; x += kThreads) pre += P.seg[i * P.nseg + x];
  pre = warp_sum(pre);
  int64_t j0;
  const unsigned vis = visible_bits(P, i, s, t, j0);
  const int own = __popc(vis);
  int incl = own;  // inclusive scan over the warp
#pragma unroll
  for (int m = 1; m < SPECD_WARP; m <<= 1) {
    const int v = SPECD_SHFL_UP(incl, m);
    if (lane >= m) incl += v;
  }
  if (lane == SPECD_WARP - 1) wsum[warp] = incl, wpre[warp] = pre;
  __syncthreads();
  int before = 0, total = 0, base = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    before += w < warp ? wsum[w] : 0;
    total += wsum[w];
    base += wpre[w];
  }
  int32_t* irow = P.idx + i * P.kv_len;
  int64_t k = int64_t(base) + before + incl - own;
  for (int e = 0; e < kPer; ++e)
    if (vis >> e & 1u) irow[k++] = int32_t(j0 + e);
  if (s == P.nseg - 1 && t == 0) P.cnt[i] = base + total;
}

}  // namespace specd::gpu::detail::mask
