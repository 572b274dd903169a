// Row-wise argmax on the GPU (greedy token choice over a ~248k vocabulary).
//
// Two passes. Pass 1 splits each row into `parts` contiguous slices, one block per (slice, row);
// each thread scans its elements (16-byte vector loads when the row allows it), then the block
// reduces the (value, index) candidates with warp shuffles and shared memory. Pass 2 (one warp
// per row) reduces the parts. With a single part, pass 1 writes the answer directly. The number of
// parts is chosen so that about two blocks per multiprocessor are busy even for one row.
//
// The comparison is a total order on (value, index): larger value first, NaN above every number,
// and on equal values the smaller index, so the result is the first maximum (numpy.argmax) and
// does not depend on how the row was split.
#include <algorithm>
#include <climits>
#include <cmath>
#include <vector>

#include "common.cuh"
#include "ops.h"
#include "ranking.cuh"
#include "specd/gpu.h"

namespace specd::gpu {

namespace {

constexpr int kThreads = 256;

using detail::better;
using detail::Cand;

__device__ __forceinline__ void take(Cand& best, float v, int32_t i) {
  if (better(v, i, best.v, best.i)) best = {v, i};
}

__device__ __forceinline__ Cand warp_best(Cand c) {
#pragma unroll
  for (int m = SPECD_WARP / 2; m > 0; m >>= 1) {
    float v = SPECD_SHFL_XOR(c.v, m);
    int32_t i = SPECD_SHFL_XOR(c.i, m);
    take(c, v, i);
  }
  return c;
}

// Best candidate of the block; valid in thread 0.
__device__ __forceinline__ Cand block_best(Cand c) {
  __shared__ Cand part[kThreads / SPECD_WARP];
  int lane = threadIdx.x % SPECD_WARP, warp = threadIdx.x / SPECD_WARP;
  c = warp_best(c);
  if (lane == 0) part[warp] = c;
  __syncthreads();
  if (warp == 0) {
    c = lane < kThreads / SPECD_WARP ? part[lane] : Cand{-INFINITY, INT32_MAX};
    c = warp_best(c);
  }
  return c;
}

// x: [rows, V]. Block r * parts + p scans x[r, p*slice : min(V, (p+1)*slice)) and writes its best to
// parts_out[r * parts + p] (or the index straight to out[r] when parts == 1). slice is a multiple
// of 4 when VEC.
template <bool VEC>
__global__ void __launch_bounds__(kThreads) argmax_pass1(const float* __restrict__ x, int64_t V, int64_t slice,
                                                         int parts, Cand* __restrict__ parts_out,
                                                         int32_t* __restrict__ out) {
  detail::pdl_enter();
  const int p = int(blockIdx.x % unsigned(parts));
  const int64_t r = blockIdx.x / unsigned(parts);
  const int64_t begin = int64_t(p) * slice;
  const int64_t end = begin + slice < V ? begin + slice : V;
  const float* row = x + r * V;
  Cand best{-INFINITY, INT32_MAX};
  if constexpr (VEC) {
    const float4* row4 = reinterpret_cast<const float4*>(row);
    for (int64_t j = begin / 4 + threadIdx.x; j < end / 4; j += kThreads) {
      float4 f = row4[j];
      int32_t i = int32_t(j * 4);
      take(best, f.x, i);
      take(best, f.y, i + 1);
      take(best, f.z, i + 2);
      take(best, f.w, i + 3);
    }
  } else {
    for (int64_t j = begin + threadIdx.x; j < end; j += kThreads) take(best, row[j], int32_t(j));
  }
  best = block_best(best);
  if (threadIdx.x == 0) {
    if (parts == 1)
      out[r] = best.i;
    else
      parts_out[r * parts + p] = best;
  }
}

// One warp per row reduces its `parts` candidates.
__global__ void argmax_pass2(const Cand* __restrict__ parts_in, int parts, int32_t* __restrict__ out) {
  detail::pdl_enter();
  const int64_t r = blockIdx.x;
  Cand best{-INFINITY, INT32_MAX};
  for (int p = threadIdx.x; p < parts; p += SPECD_WARP) {
    Cand c = parts_in[r * parts + p];
    take(best, c.v, c.i);
  }
  best = warp_best(best);
  if (threadIdx.x == 0) out[r] = best.i;
}

}  // namespace

Tensor argmax(const Tensor& x) {
  const char* op = "argmax";
  detail::check_gpu(x, op, "x");
  check_dtype(x, DType::F32, op, "x");
  check_contiguous(x, op, "x");
  SPECD_CHECK(x.ndim() >= 1, op, ": x must have at least 1 dimension");
  const int64_t V = x.cols();
  SPECD_CHECK(V >= 1, op, ": rows must not be empty");
  SPECD_CHECK(V <= INT32_MAX, op, ": rows longer than 2^31 - 1 elements are not supported");
  const int64_t rows = x.numel() / V;
  std::vector<int64_t> shape(x.shape.begin(), x.shape.end() - 1);
  Tensor out = Tensor::empty(shape, DType::I32, Device::GPU);
  if (rows == 0) return out;

  const bool vec = V % 4 == 0 && detail::aligned16(x.data);
  // Slices: enough blocks for ~2 per multiprocessor over all rows, each at least 1024 elements.
  const int64_t want_blocks = 2 * int64_t(detail::sm_count());
  int64_t parts = std::max<int64_t>(1, std::min<int64_t>((want_blocks + rows - 1) / rows, (V + 1023) / 1024));
  int64_t slice = (V + parts - 1) / parts;
  if (vec) slice = (slice + 3) / 4 * 4;
  parts = (V + slice - 1) / slice;

  cudaStream_t s = detail::stream();
  std::shared_ptr<void> scratch;
  Cand* cand = nullptr;
  if (parts > 1) {
    scratch = alloc(size_t(rows * parts) * sizeof(Cand));  // freed stream-ordered after pass 2
    cand = static_cast<Cand*>(scratch.get());
  }
  SPECD_CHECK(rows * parts <= 0x7fffffff, op, ": too many rows for one launch (", rows, ")");
  const unsigned grid = unsigned(rows * parts);
  if (vec)
    detail::launch_kernel<argmax_pass1<true>>("argmax_pass1", grid, kThreads, 0, s, x.ptr<float>(), V, slice,
                                              int(parts), cand, out.ptr<int32_t>());
  else
    detail::launch_kernel<argmax_pass1<false>>("argmax_pass1", grid, kThreads, 0, s, x.ptr<float>(), V, slice,
                                               int(parts), cand, out.ptr<int32_t>());
  if (parts > 1) {
    detail::launch_kernel<argmax_pass2>("argmax_pass2", unsigned(rows), SPECD_WARP, 0, s, cand, int(parts),
                                        out.ptr<int32_t>());
  }
  return out;
}

}  // namespace specd::gpu
