// Matrix product y[n, out] = x[n, in] @ w[out, in]^T for small n (decode / verify widths), with
// Q8_0 or F32 weights and F32 activations, F32 accumulation.
//
// Kernel shape (GEMV-style, weight-streaming). A block of kWarps warps owns R consecutive output
// rows and ALL (up to kNMax = 16) rows of x, so each weight byte is read from memory once per
// launch; the warps split the reduction dimension. A weight row is cut into chunks and thread t
// of the block handles chunks c = t + k*kThreads, so each warp-wide load covers contiguous bytes;
// each thread first issues the loads of U chunk steps for its R rows, then decodes and accumulates.
// Chunk formats ("policies"):
//   Q8_0Quarter: a quarter of a 32-weight block per chunk, 8 int8 read as
//     16-bit words (blocks are 34 bytes, so only 2-byte aligned) + the block's fp16 scale; x read
//     directly as two float4.
//   F32W<4> / F32W<1>: 4 floats (16-byte aligned rows) or 1 float per chunk.
// int8 -> float uses the exact magic-number trick (bits 0x4B0000uu = 2^23 + uu with uu = q + 128),
// keeping the integer-to-float converter off the critical path; per chunk s = sum_k q_k * x_k in
// float, then acc += d * s.
//
// Reduction and batch invariance. Per (output row, x row) each lane sums its chunks in a fixed
// order; the 32 x kWarps lane partials are then summed in shared memory, lane by lane within a
// warp and then warp by warp, also in a fixed order. None of this depends on n, R or the template
// instance, so row i of y is bit-identical whether x has 1 or 16 rows (required for lossless
// speculative decoding). n > 16 is processed 16 rows at a time (the weights are re-read per 16
// rows: prefill should use a tiled GEMM / vendor BLAS instead).
//
// Performance (H200, BENCHMARKS.md): at n = 1 weights stream at 0.56 (62 MB) to 0.73 (1.35 GB LM
// head) of the device-to-device copy bandwidth; at n = 8-16 the kernel is bound by FP32 FMA issue
// and L1 traffic of x (16 fp32 FMAs per weight, ~12 TFLOP/s): a tensor-core path (3xTF32 or bf16x3
// splitting) is the next step for verify widths 8-16.
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

// Chunk steps whose loads a thread issues before the first use, for R rows per block and up to
// NMAX rows of x. Chosen from H200 measurements (BENCHMARKS.md): 4 chunk-rows in flight, except 8
// for R = 4 at n <= 2; more (8 at R = 1, 2 at R = 4 with n >= 4) cost occupancy and ran slower.
template <int R, int NMAX>
__host__ __device__ constexpr int steps_in_flight() {
  if (R == 4 && NMAX <= 2) return 2;
  return 4 / R > 0 ? 4 / R : 1;
}

// --- weight formats -------------------------------------------------------------------------

// int8 x 4 (one 32-bit word) -> 4 exact floats.
__device__ __forceinline__ void int8x4_to_float(uint32_t word, float* w) {
  constexpr uint32_t kExp = 0x4B000000u;      // float bits of 2^23
  constexpr float kBias = 8388608.0f + 128.0f;  // 2^23 + 128
  uint32_t u = word ^ 0x80808080u;              // q + 128 as unsigned bytes
  w[0] = __int_as_float(__byte_perm(u, kExp, 0x7540)) - kBias;
  w[1] = __int_as_float(__byte_perm(u, kExp, 0x7541)) - kBias;
  w[2] = __int_as_float(__byte_perm(u, kExp, 0x7542)) - kBias;
  w[3] = __int_as_float(__byte_perm(u, kExp, 0x7543)) - kBias;
}

struct Q8_0Quarter {
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
    int8x4_to_float(r.lo, w);
    int8x4_to_float(r.hi, w + 4);
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

// w: [out, row_bytes] bytes, nchunks chunks per row; x: [n, ldx] F32 (n <= NMAX; the activations in
// the layout the policy reads); y: [n, out] F32.
template <class W, int NMAX, int R>
__global__ void __launch_bounds__(kThreads) gemv_kernel(const uint8_t* __restrict__ w, int64_t row_bytes,
                                                        int64_t nchunks, const float* __restrict__ x,
                                                        int64_t ldx, float* __restrict__ y, int n, int64_t out) {
  constexpr int E = W::kElems;
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
      if (c < nchunks) {
        float wv[R][E], sc[R];
#pragma unroll
        for (int r = 0; r < R; ++r) sc[r] = W::decode(raw[u][r], wv[r]);
#pragma unroll
        for (int i = 0; i < NMAX; ++i) {
          if (i < n) {
            float xv[E];
            load_x<E>(x + int64_t(i) * ldx, c, xv);
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

// Geometry of one launch: weights, activations in the policy's layout, output.
struct Problem {
  const uint8_t* w;
  int64_t row_bytes, nchunks;
  const float* x;
  int64_t ldx;
  float* y;
  int n;
  int64_t out;
};

template <class W, int NMAX, int R>
void launch_r(const Problem& p, cudaStream_t s) {
  int64_t blocks = (p.out + R - 1) / R;
  gemv_kernel<W, NMAX, R><<<unsigned(blocks), kThreads, 0, s>>>(p.w, p.row_bytes, p.nchunks, p.x, p.ldx, p.y, p.n,
                                                                 p.out);
  SPECD_GPU_CHECK_LAUNCH("gemv_kernel");
}

// Rows per block: more rows reuse each activation load for more weights (L1 traffic), fewer keep
// enough blocks (16 per multiprocessor) to fill the device for small `out`. The scalar F32
// fallback always uses one row per block.
template <class W, int NMAX>
void launch_n(const Problem& p, cudaStream_t s) {
  if constexpr (W::kElems > 1) {
    const int64_t target = int64_t(detail::sm_count()) * 16;
    if (p.out / 4 >= target) return launch_r<W, NMAX, 4>(p, s);
    if (p.out / 2 >= target) return launch_r<W, NMAX, 2>(p, s);
  }
  launch_r<W, NMAX, 1>(p, s);
}

template <class W>
void launch(const Problem& p) {
  cudaStream_t s = detail::stream();
  if (p.n <= 1)
    launch_n<W, 1>(p, s);
  else if (p.n <= 2)
    launch_n<W, 2>(p, s);
  else if (p.n <= 4)
    launch_n<W, 4>(p, s);
  else if (p.n <= 8)
    launch_n<W, 8>(p, s);
  else
    launch_n<W, 16>(p, s);
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
  SPECD_CHECK(out <= 0x7fffffff, op, ": w has too many rows for one launch");
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
    Problem p{wb, rb, 0, x.ptr<float>() + i0 * in, in, y.ptr<float>() + i0 * out, int(std::min<int64_t>(kNMax, n - i0)), out};
    if (w.dtype == DType::Q8_0) {
      p.nchunks = in / 8;
      launch<Q8_0Quarter>(p);
    } else if (in % 4 == 0 && detail::aligned16(wb)) {
      p.nchunks = in / 4;
      launch<F32W<4>>(p);
    } else {
      p.nchunks = in;
      launch<F32W<1>>(p);
    }
  }
  return y;
}

}  // namespace specd::gpu
