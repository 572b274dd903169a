// The FP32-FMA GEMV (gpu::matmul's GEMV for F32 / F16 weights and BF16 off the tensor cores on CUDA, and for
// every format on HIP, where the tensor-core GEMV of matmul_mma.cuh does not exist): y[n, out] = x[n, in] @
// w[out, in]^T for n <= kNMax rows of x, the weights decoded by the chunk policies of weight_formats.cuh. A header,
// so that the host emulation (tests/gpu/host_emu/gemv_fma_main.cpp) runs the kernel on the CPU for every policy;
// launched by matmul.cu (launch_r).
//
// Work. A block of kWarps warps owns R consecutive
// output rows and ALL (up to kNMax = 16) rows of x, so each weight byte is read from memory once
// per launch; the warps split the reduction dimension. A weight row is cut into chunks and thread
// t of the block handles chunks c = t + k*kThreads, so each warp-wide load covers contiguous bytes;
// each thread first issues the loads of U chunk steps for its R rows, then decodes and accumulates.
// Chunk formats ("policies", weight_formats.cuh): Q8_0 quarter blocks (8 weights, 16-bit loads),
// F32 (4 or 1 floats), F16/BF16 (8 values in one 16-byte load, or 1), Q4_K/Q5_K (32 weights: 16
// bytes of nibbles + the block's 16-byte header, Q5_K also 16 bytes of fifth bits), Q6_K (32
// weights from 16-bit loads: its 210-byte blocks are only 2-byte aligned), IQ4_XS (32 weights, two
// 8-byte loads + 8-byte header). A chunk is decoded in parts of 8 weights so that only 8 decoded
// floats per weight row are live; per part s = sum_k w_k * x_k (fmaf chain), then acc += s (Q8_0:
// acc += d * s with the integer quants as w_k).
// Reduction and batch invariance. Per (output row, x row) each lane sums its chunks in a fixed
// order; the 32 x kWarps lane partials are then summed in shared memory, lane by lane within a
// warp and then warp by warp, also in a fixed order. None of this depends on n, R or the template
// instance, so row i of y is bit-identical whether x has 1 or 16 rows.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#ifndef SPECD_HOST_EMU
#include "common.cuh"
#endif
#include "pdl.cuh"
#include "weight_formats.cuh"

namespace specd::gpu::detail::fma_gemv {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * SPECD_WARP;
constexpr int kNMax = 16;

// Calls f(std::integral_constant<int, NMAX>{}) with the kernel instance for n (1 <= n <= kNMax) rows of x: the
// fewest of 1, 2, 4, 8 or 16 rows that hold them (matmul.cu's launches and the host emulation both choose here).
template <class F>
void with_rows_instance(int n, F&& f) {
  if (n <= 1) f(std::integral_constant<int, 1>{});
  else if (n <= 2) f(std::integral_constant<int, 2>{});
  else if (n <= 4) f(std::integral_constant<int, 4>{});
  else if (n <= 8) f(std::integral_constant<int, 8>{});
  else f(std::integral_constant<int, 16>{});
}

// Chunks of a weight row of `in` inputs under policy W (in a multiple of W::kElems: matmul.cu's check_weight and its
// choice of policy).
template <class W>
constexpr int64_t chunks_per_row(int64_t in) {
  return in / W::kElems;
}

// Chunk steps whose loads a thread issues before the first use, for R rows per block and up to
// NMAX rows of x. Chosen from H200 measurements (BENCHMARKS.md): 4 chunk-rows in flight, except 8
// for R = 4 at n <= 2; more (8 at R = 1, 2 at R = 4 with n >= 4) cost occupancy and ran slower.
template <int R, int NMAX>
__host__ __device__ constexpr int steps_in_flight() {
  if (R == 4 && NMAX <= 2) return 2;
  return 4 / R > 0 ? 4 / R : 1;
}

// x values of a part: kPE consecutive floats at element `off` of an x row (16-byte aligned rows
// and offsets for kPE = 4 / 8).
template <int E>
__device__ __forceinline__ void load_x(const float* __restrict__ xr, int64_t off, float (&v)[E]) {
  if constexpr (E == 8) {
    const float4* p = reinterpret_cast<const float4*>(xr + off);
    float4 a = p[0], b = p[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else if constexpr (E == 4) {
    float4 a = *reinterpret_cast<const float4*>(xr + off);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
  } else {
    v[0] = xr[off];
  }
}

// --- kernel ---------------------------------------------------------------------------------

// One part of a chunk against every x row: s = sum_k w_k * x_k (fixed order, fmaf chain), then
// acc += scale * s (scaled formats) or acc += s. Same arithmetic for every NMAX and R.
template <class W, int NMAX, int R, int P>
__device__ __forceinline__ void gemv_part(const typename W::Raw (&raw)[R], int64_t c, const float* __restrict__ x,
                                          int64_t ldx, int n, float (&acc)[R][NMAX]) {
  constexpr int E = W::kPE;
  float wv[R][E], sc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) sc[r] = W::template decode_part<P>(raw[r], wv[r]);
  const int64_t off = W::offset(c, P);
#pragma unroll
  for (int i = 0; i < NMAX; ++i) {
    if (i < n) {
      float xv[E];
      load_x<E>(x + int64_t(i) * ldx, off, xv);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < E; ++k) s = fmaf(wv[r][k], xv[k], s);
        if constexpr (W::kScaled)
          acc[r][i] = fmaf(sc[r], s, acc[r][i]);
        else
          acc[r][i] += s;
      }
    }
  }
}

// All parts of chunk c, in part order.
template <class W, int NMAX, int R, int... P>
__device__ __forceinline__ void gemv_chunk(const typename W::Raw (&raw)[R], int64_t c, const float* __restrict__ x,
                                           int64_t ldx, int n, float (&acc)[R][NMAX], std::integer_sequence<int, P...>) {
  (gemv_part<W, NMAX, R, P>(raw, c, x, ldx, n, acc), ...);
}

// w: [out, row_bytes] bytes, nchunks chunks per row; x: [n, ldx] F32 (n <= NMAX; the activations in
// the layout the policy reads); y: [n, out] F32.
template <class W, int NMAX, int R>
__global__ void __launch_bounds__(kThreads) gemv_kernel(const uint8_t* __restrict__ w, int64_t row_bytes,
                                                        int64_t nchunks, const float* __restrict__ x,
                                                        int64_t ldx, float* __restrict__ y, int n, int64_t out) {
  pdl_enter();
  constexpr int U = steps_in_flight<R, NMAX>();
  constexpr int kStride = kThreads;                                    // chunks per block step
  __shared__ float lane_part[R * NMAX][kThreads + 1];  // +1: conflict-free column reads
  __shared__ float warp_part[R * NMAX][kWarps];

  const int tid = threadIdx.x;
  const int64_t o0 = int64_t(blockIdx.x) * R;

  const uint8_t* rows[R];
#pragma unroll
  for (int r = 0; r < R; ++r) rows[r] = w + (o0 + r < out ? o0 + r : out - 1) * row_bytes;  // clamp: tail block

  float acc[R][NMAX];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int i = 0; i < NMAX; ++i) acc[r][i] = 0.0f;

  for (int64_t c0 = tid; c0 < nchunks; c0 += int64_t(kStride) * U) {
    typename W::Raw raw[U][R];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      int64_t c = c0 + int64_t(u) * kStride;
      if (c < nchunks) {
#pragma unroll
        for (int r = 0; r < R; ++r) raw[u][r] = W::load(rows[r], c);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      int64_t c = c0 + int64_t(u) * kStride;
      if (c < nchunks)
        gemv_chunk<W, NMAX, R>(raw[u], c, x, ldx, n, acc, std::make_integer_sequence<int, W::kParts>());
    }
  }

  // Fixed-order reduction: lanes of a warp in order, then warps in order.
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int i = 0; i < NMAX; ++i) lane_part[r * NMAX + i][tid] = acc[r][i];
  __syncthreads();
  for (int p = tid; p < R * NMAX * kWarps; p += kThreads) {
    int v = p / kWarps, wi = p % kWarps;
    float s = 0.0f;
    for (int l = 0; l < SPECD_WARP; ++l) s += lane_part[v][wi * SPECD_WARP + l];
    warp_part[v][wi] = s;
  }
  __syncthreads();
  if (tid < R * NMAX) {
    int r = tid / NMAX, i = tid % NMAX;
    if (i < n && o0 + r < out) {
      float s = 0.0f;
#pragma unroll
      for (int wi = 0; wi < kWarps; ++wi) s += warp_part[tid][wi];
      y[int64_t(i) * out + o0 + r] = s;
    }
  }
}

}  // namespace specd::gpu::detail::fma_gemv
