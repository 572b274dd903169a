// Matrix product y[n, out] = x[n, in] @ w[out, in]^T for small n (decode / verify widths), with
// Q8_0 or F32 weights and F32 activations, F32 accumulation.
//
// Kernel shape (GEMV-style, weight-streaming). A block of kWarps warps owns R consecutive output
// rows and ALL (up to kNMax = 16) rows of x, so each weight byte is read from memory once per
// launch; the warps split the reduction dimension. A row is cut into chunks (Q8_0: a quarter of a
// 32-weight block, 8 int8 + the block's fp16 scale; F32: 4 floats, or 1 when unaligned); lane
// `l` of warp `w` handles chunks c = w*32 + l + k*kWarps*32, so a warp reads contiguous bytes of
// each weight row and contiguous 16-byte vectors of each x row. Each lane first issues the loads
// of kLoadsInFlight chunks-times-rows, then decodes and accumulates them.
//
// Q8_0 decode: ggml block_q8_0 = { fp16 d; int8 q[32] } (34 bytes, so blocks are only 2-byte
// aligned: quants are read as 16-bit words). int8 -> float uses the exact magic-number trick
// (bits 0x4B0000uu = 2^23 + uu with uu = q + 128) to keep the integer-to-float converter off the
// critical path; per chunk s = sum_k q_k * x_k in float, then acc += d * s.
//
// Reduction and batch invariance. Per (output row, x row) each lane sums its chunks in a fixed
// order; the 32 x kWarps lane partials are then summed in shared memory, lane by lane within a
// warp and then warp by warp, also in a fixed order. None of this depends on n, R or the template
// instance, so row i of y is bit-identical whether x has 1 or 16 rows (required for lossless
// speculative decoding). n > 16 is processed 16 rows at a time (the weights are re-read per 16
// rows: prefill should use a tiled GEMM / vendor BLAS instead).
#include <algorithm>
#include <vector>

#include "common.cuh"
#include "ops.h"
#include "specd/gpu.h"

namespace specd::gpu {

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * SPECD_WARP;
constexpr int kNMax = 16;
constexpr int kLoadsInFlight = 4;  // chunk loads per lane issued before the first use (U * R)

// --- weight formats -------------------------------------------------------------------------

struct Q8_0W {
  static constexpr int kElems = 8;  // elements per chunk (a quarter block)
  static constexpr bool kScaled = true;
  struct Raw {
    uint32_t lo, hi;  // 8 int8 quants
    uint16_t d;       // fp16 block scale
  };
  __device__ __forceinline__ static Raw load(const uint8_t* __restrict__ row, int64_t c) {
    const uint8_t* blk = row + (c >> 2) * 34;
    const uint16_t* q = reinterpret_cast<const uint16_t*>(blk + 2 + 8 * (c & 3));
    Raw r;
    r.d = *reinterpret_cast<const uint16_t*>(blk);
    r.lo = uint32_t(q[0]) | (uint32_t(q[1]) << 16);
    r.hi = uint32_t(q[2]) | (uint32_t(q[3]) << 16);
    return r;
  }
  __device__ __forceinline__ static float decode(const Raw& r, float (&w)[kElems]) {
    constexpr uint32_t kExp = 0x4B000000u;      // float bits of 2^23
    constexpr float kBias = 8388608.0f + 128.0f;  // 2^23 + 128
    uint32_t lo = r.lo ^ 0x80808080u, hi = r.hi ^ 0x80808080u;  // q + 128 as unsigned bytes
    w[0] = __int_as_float(__byte_perm(lo, kExp, 0x7540)) - kBias;
    w[1] = __int_as_float(__byte_perm(lo, kExp, 0x7541)) - kBias;
    w[2] = __int_as_float(__byte_perm(lo, kExp, 0x7542)) - kBias;
    w[3] = __int_as_float(__byte_perm(lo, kExp, 0x7543)) - kBias;
    w[4] = __int_as_float(__byte_perm(hi, kExp, 0x7540)) - kBias;
    w[5] = __int_as_float(__byte_perm(hi, kExp, 0x7541)) - kBias;
    w[6] = __int_as_float(__byte_perm(hi, kExp, 0x7542)) - kBias;
    w[7] = __int_as_float(__byte_perm(hi, kExp, 0x7543)) - kBias;
    return specd_fp16_bits_to_float(r.d);
  }
};

// F32 weights, 4 floats per chunk (16-byte aligned rows) or 1 float per chunk (any alignment).
template <int E>
struct F32W {
  static_assert(E == 1 || E == 4, "F32 chunks are 1 or 4 floats");
  static constexpr int kElems = E;
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
  __device__ __forceinline__ static float decode(const Raw& r, float (&w)[E]) {
#pragma unroll
    for (int k = 0; k < E; ++k) w[k] = r.v[k];
    return 1.0f;
  }
};

template <int E>
__device__ __forceinline__ void load_x(const float* __restrict__ xr, int64_t c, float (&v)[E]) {
  if constexpr (E == 8) {
    const float4* p = reinterpret_cast<const float4*>(xr + c * 8);
    float4 a = p[0], b = p[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else if constexpr (E == 4) {
    float4 a = reinterpret_cast<const float4*>(xr)[c];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
  } else {
    v[0] = xr[c];
  }
}

// --- kernel ---------------------------------------------------------------------------------

// w: [out, row_bytes] bytes; x: [n, in] F32 (n <= NMAX); y: [n, out] F32 (row stride ldy).
template <class W, int NMAX, int R>
__global__ void __launch_bounds__(kThreads) gemv_kernel(const uint8_t* __restrict__ w, int64_t row_bytes,
                                                        const float* __restrict__ x, float* __restrict__ y,
                                                        int n, int64_t in, int64_t out) {
  constexpr int E = W::kElems;
  constexpr int U = kLoadsInFlight / R > 0 ? kLoadsInFlight / R : 1;  // chunk steps in flight
  constexpr int kStride = kThreads;                                    // chunks per block step
  __shared__ float lane_part[R * NMAX][kThreads + 1];  // +1: conflict-free column reads
  __shared__ float warp_part[R * NMAX][kWarps];

  const int tid = threadIdx.x;
  const int64_t o0 = int64_t(blockIdx.x) * R;
  const int64_t nchunks = in / E;

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
      if (c < nchunks) {
        float wv[R][E], sc[R];
#pragma unroll
        for (int r = 0; r < R; ++r) sc[r] = W::decode(raw[u][r], wv[r]);
#pragma unroll
        for (int i = 0; i < NMAX; ++i) {
          if (i < n) {
            float xv[E];
            load_x<E>(x + int64_t(i) * in, c, xv);
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

template <class W, int NMAX, int R>
void launch_r(const uint8_t* w, int64_t row_bytes, const float* x, float* y, int n, int64_t in, int64_t out,
              cudaStream_t s) {
  int64_t blocks = (out + R - 1) / R;
  gemv_kernel<W, NMAX, R><<<unsigned(blocks), kThreads, 0, s>>>(w, row_bytes, x, y, n, in, out);
  SPECD_GPU_CHECK_LAUNCH("gemv_kernel");
}

// Rows per block: more rows reuse each x load for more weights (matters when n is large and the
// kernel is arithmetic/L1 bound), fewer keep enough blocks to fill the device for small `out`.
// (The scalar F32 fallback always uses one row per block.)
template <class W, int NMAX>
void launch_n(const uint8_t* w, int64_t row_bytes, const float* x, float* y, int n, int64_t in, int64_t out,
              cudaStream_t s) {
  if constexpr (W::kElems > 1) {
    const int64_t target = int64_t(detail::sm_count()) * 16;  // blocks: 16 per multiprocessor
    if (NMAX >= 4 && out / 4 >= target) return launch_r<W, NMAX, 4>(w, row_bytes, x, y, n, in, out, s);
    if (out / 2 >= target) return launch_r<W, NMAX, 2>(w, row_bytes, x, y, n, in, out, s);
  }
  launch_r<W, NMAX, 1>(w, row_bytes, x, y, n, in, out, s);
}

template <class W>
void launch(const uint8_t* w, int64_t row_bytes, const float* x, float* y, int n, int64_t in, int64_t out) {
  cudaStream_t s = detail::stream();
  if (n <= 1)
    launch_n<W, 1>(w, row_bytes, x, y, n, in, out, s);
  else if (n <= 2)
    launch_n<W, 2>(w, row_bytes, x, y, n, in, out, s);
  else if (n <= 4)
    launch_n<W, 4>(w, row_bytes, x, y, n, in, out, s);
  else if (n <= 8)
    launch_n<W, 8>(w, row_bytes, x, y, n, in, out, s);
  else
    launch_n<W, 16>(w, row_bytes, x, y, n, in, out, s);
}

}  // namespace

Tensor matmul(const Tensor& x, const Tensor& w) {
  const char* op = "matmul";
  detail::check_gpu(x, op, "x");
  detail::check_gpu(w, op, "w");
  check_dtype(x, DType::F32, op, "x");
  check_contiguous(x, op, "x");
  SPECD_CHECK(x.ndim() >= 1, op, ": x must have at least 1 dimension");
  SPECD_CHECK(w.dtype == DType::Q8_0 || w.dtype == DType::F32, op, ": w must be Q8_0 or F32 on the GPU, got ",
              dtype_info(w.dtype).name);
  check_ndim(w, 2, op, "w");
  check_contiguous(w, op, "w");
  const int64_t out = w.dim(0), in = w.dim(1), n = x.rows();
  SPECD_CHECK(x.cols() == in, op, ": x has ", x.cols(), " columns, w has ", in, " (w is [out, in])");
  SPECD_CHECK((out + 1) / 2 <= 0x7fffffff, op, ": w has too many rows for one launch");
  SPECD_CHECK(detail::aligned16(x.data), op, ": x data must be 16-byte aligned");
  std::vector<int64_t> shape = x.shape;
  shape.back() = out;
  Tensor y = Tensor::empty(shape, DType::F32, Device::GPU);
  if (n == 0 || out == 0) return y;
  if (in == 0) {
    memset_zero(y.data, size_t(y.nbytes()));
    return y;
  }
  const auto* wb = static_cast<const uint8_t*>(w.data);
  const int64_t rb = w.row_bytes();
  for (int64_t i0 = 0; i0 < n; i0 += kNMax) {
    int nn = int(std::min<int64_t>(kNMax, n - i0));
    const float* xi = x.ptr<float>() + i0 * in;
    float* yi = y.ptr<float>() + i0 * out;
    if (w.dtype == DType::Q8_0)
      launch<Q8_0W>(wb, rb, xi, yi, nn, in, out);
    else if (in % 4 == 0 && detail::aligned16(wb))
      launch<F32W<4>>(wb, rb, xi, yi, nn, in, out);
    else
      launch<F32W<1>>(wb, rb, xi, yi, nn, in, out);
  }
  return y;
}

}  // namespace specd::gpu
