// Row-wise top-k on the GPU, same contract as cpu::topk: the k best (value, index) pairs of each
// row under the argmax ranking (larger value first, NaN above every number, -0.0 == +0.0, ties by
// lower index), best first. Exact, hence bit-identical to the CPU op and batch invariant.
//
// One block per row, k selection rounds: round r finds the best entry ranked strictly below the
// entry chosen in round r - 1 (the ranking is a strict total order on (value, index), so this is
// exactly the r-th best). O(k V) reads per row, from L2 after the first round: meant for the small
// k of sampling and tree drafting (k <= ~64); a radix-select variant would serve large k.
#include <climits>
#include <cmath>

#include "op_util.cuh"
#include "ops.h"
#include "ranking.cuh"

namespace specd::gpu {

namespace {

constexpr int kThreads = 512;

using detail::better;
using detail::Cand;

__device__ __forceinline__ void take(Cand& best, float v, int32_t i) {
  if (i != INT32_MAX && (best.i == INT32_MAX || better(v, i, best.v, best.i))) best = {v, i};
}

__global__ void __launch_bounds__(kThreads) topk_kernel(const float* __restrict__ x, int64_t V, int64_t k,
                                                        float* __restrict__ vals, int32_t* __restrict__ idx) {
  detail::pdl_enter();
  __shared__ Cand part[kThreads / SPECD_WARP];
  __shared__ Cand prev;
  const int64_t r = blockIdx.x;
  const float* row = x + r * V;
  const int lane = threadIdx.x % SPECD_WARP, warp = threadIdx.x / SPECD_WARP;
  for (int64_t round = 0; round < k; ++round) {
    Cand best{0.0f, INT32_MAX};  // INT32_MAX: none yet
    Cand pv = round > 0 ? prev : Cand{0.0f, INT32_MAX};
    for (int64_t j = threadIdx.x; j < V; j += kThreads) {
      float v = row[j];
      if (pv.i != INT32_MAX && !better(pv.v, pv.i, v, int32_t(j))) continue;  // not below the previous pick
      take(best, v, int32_t(j));
    }
#pragma unroll
    for (int m = SPECD_WARP / 2; m > 0; m >>= 1) {
      float v = SPECD_SHFL_XOR(best.v, m);
      int32_t i = SPECD_SHFL_XOR(best.i, m);
      take(best, v, i);
    }
    if (lane == 0) part[warp] = best;
    __syncthreads();
    if (warp == 0) {
      Cand c = lane < kThreads / SPECD_WARP ? part[lane] : Cand{0.0f, INT32_MAX};
#pragma unroll
      for (int m = SPECD_WARP / 2; m > 0; m >>= 1) {
        float v = SPECD_SHFL_XOR(c.v, m);
        int32_t i = SPECD_SHFL_XOR(c.i, m);
        take(c, v, i);
      }
      if (lane == 0) {
        prev = c;
        vals[r * k + round] = c.v;
        idx[r * k + round] = c.i;
      }
    }
    __syncthreads();
  }
}

}  // namespace

std::pair<Tensor, Tensor> topk(const Tensor& x, int64_t k) {
  const char* op = "topk";
  detail::check_gpu_tensor(x, DType::F32, -1, op, "x");
  SPECD_CHECK(x.ndim() >= 1, op, ": x must have at least 1 dimension");
  SPECD_CHECK(x.cols() >= 1, op, ": x must have at least one column");
  SPECD_CHECK(x.cols() <= INT32_MAX, op, ": x has too many columns for I32 indices");
  int64_t V = x.cols(), n = x.rows();
  SPECD_CHECK(k >= 1 && k <= V, op, ": k must be in [1, V=", V, "], got ", k);
  detail::check_grid(n, op);
  std::vector<int64_t> shape(x.shape.begin(), x.shape.end() - 1);
  shape.push_back(k);
  Tensor vals = Tensor::empty(shape, DType::F32, Device::GPU), idx = Tensor::empty(shape, DType::I32, Device::GPU);
  if (n == 0) return {vals, idx};
  detail::launch_kernel<topk_kernel>("topk_kernel", unsigned(n), kThreads, 0, detail::stream(), x.ptr<float>(), V, k,
                                     vals.ptr<float>(), idx.ptr<int32_t>());
  return {vals, idx};
}

}  // namespace specd::gpu
