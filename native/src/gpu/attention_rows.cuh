// What the attention kernels share about a call's rows: cpu::attention's visibility of a query row and
// the fields of the split-K passes (attention.cu's CUDA-core chunk kernel and combine,
// attention_chunk_mma.cuh's tensor-core chunk kernel). Also compiled for the host by the emulation
// harnesses (tests/gpu/host_emu).
#pragma once

#include <cstdint>

#include "portability.h"  // __host__ / __device__ (host_emu's stand-ins in the emulation harnesses)

namespace specd::gpu::detail {

// The keys [lo, hi) a query row at position pos sees before any mask (empty when hi <= lo):
// lo = max(0, pos - window + 1) with a window (window > 0), else 0; hi = min(kv_len, pos + 1) when causal,
// else kv_len.
__host__ __device__ inline void visible_range(int64_t pos, int64_t window, bool causal, int64_t kv_len, int64_t& lo,
                                              int64_t& hi) {
  lo = window > 0 ? (pos - window + 1 > 0 ? pos - window + 1 : 0) : 0;
  hi = causal ? (kv_len < pos + 1 ? kv_len : pos + 1) : kv_len;
}

// A split-K call (one slice of its rows): each row's visible keys, in order, cut into fixed chunks of 64
// by rank; per (row, q head, chunk) the partials m_c, l_c (ml) and acc_c[dp] (part).
struct SplitKParams {
  const float* q;  // F32 [n, hq, d] contiguous
  const uint8_t* kc;
  const uint8_t* vc;
  int64_t k_row_stride, k_head_stride;  // cache strides (bytes); K and V may have different dtypes
  int64_t v_row_stride, v_head_stride;
  const int32_t* q_pos;  // [n]
  const int32_t* idx;    // [n, kv_len] visible positions in order (a mask), or null
  const int32_t* cnt;    // [n] visible counts (a mask), or null
  int64_t kv_len, window;
  int causal, hq, hkv, r;  // r = hq / hkv
  int nch, dp;             // chunks per (row, q head) bounding every row's; dp = d rounded up to 8
  int64_t i0, rows;        // the slice: first row, rows
  float scale;
  float* part;  // [rows, hq, nch, dp] acc_c
  float* ml;    // [rows, hq, nch, 2] (m_c, l_c)
};

// Row i's first visible position and its number of visible keys (the mask's count when there is one).
__host__ __device__ inline void row_range(const SplitKParams& P, int64_t i, int64_t& lo, int64_t& cnt) {
  int64_t hi;
  visible_range(P.q_pos[i], P.window, P.causal != 0, P.kv_len, lo, hi);
  cnt = P.cnt ? int64_t(P.cnt[i]) : (hi > lo ? hi - lo : 0);
}

}  // namespace specd::gpu::detail
