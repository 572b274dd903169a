// Elementwise activations and arithmetic on the GPU: silu, sigmoid, softplus, swiglu, mul, add.
//
// Same formulas as cpu/activations.h, evaluated in double and rounded to F32 once (sigmoid split at
// 0 so it never overflows, softplus = x above 20 else log1p(exp(x))). Tolerance vs the CPU op:
// mul and add are exact (one F32 rounding, no contraction possible); silu, sigmoid, softplus and
// swiglu agree bit for bit except when the double exp/log1p of the device library (<= 1 ulp of
// double) and of the host libm straddle an F32 rounding boundary, i.e. <= 1 F32 ulp, practically
// never. Every element is computed independently, so results are batch invariant. mul / add
// broadcast a b of shape [H] or [1, H] over the rows of a [..., H] (same single rounding).
// GPU inputs must be contiguous (GPU tensors always are unless reshaped views of other layouts).
#include <algorithm>
#include <cmath>

#include "op_util.cuh"
#include "ops.h"

namespace specd::gpu {

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ double sigmoid_f64(double x) {
  if (x >= 0.0) return 1.0 / (1.0 + exp(-x));
  double e = exp(x);
  return e / (1.0 + e);
}

enum class Op { Silu, Sigmoid, Softplus, Swiglu, Mul, Add };

template <Op OP>
__device__ __forceinline__ float apply(float a, float b) {
  if constexpr (OP == Op::Silu) return float(double(a) * sigmoid_f64(a));
  if constexpr (OP == Op::Sigmoid) return float(sigmoid_f64(a));
  if constexpr (OP == Op::Softplus) return a > 20.0f ? a : float(log1p(exp(double(a))));
  if constexpr (OP == Op::Swiglu) return float(double(a) * sigmoid_f64(a) * double(b));
  if constexpr (OP == Op::Mul) return __fmul_rn(a, b);
  if constexpr (OP == Op::Add) return __fadd_rn(a, b);
  return 0.0f;
}

template <Op OP>
__global__ void __launch_bounds__(kThreads) elementwise_kernel(const float* __restrict__ a, const float* __restrict__ b,
                                                               float* __restrict__ y, int64_t n, int64_t b_period) {
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += int64_t(gridDim.x) * kThreads)
    y[i] = apply<OP>(a[i], b ? b[b_period ? i % b_period : i] : 0.0f);
}

// b of shape [H] or [1, H] with a of shape [..., H]: b is broadcast over a's rows (mul / add only).
bool broadcasts(const Tensor& a, const Tensor& b) {
  const int64_t h = a.ndim() >= 1 ? a.shape.back() : 1;
  return a.shape != b.shape && b.ndim() >= 1 && b.ndim() <= 2 && b.shape.back() == h && b.numel() == h;
}

template <Op OP>
Tensor run(const Tensor& a, const Tensor* b, const char* op, const char* an, const char* bn) {
  detail::check_gpu_tensor(a, DType::F32, -1, op, an);
  int64_t b_period = 0;  // 0: same shape; else b repeats every b_period elements of a
  if (b) {
    detail::check_gpu_tensor(*b, DType::F32, -1, op, bn);
    constexpr bool can_broadcast = OP == Op::Mul || OP == Op::Add;
    if (can_broadcast && broadcasts(a, *b)) {
      b_period = b->numel();
    } else {
      SPECD_CHECK(a.shape == b->shape, op, ": ", an, " and ", bn, " must have the same shape",
                  can_broadcast ? " (or b of shape [H] / [1, H] for a of shape [..., H])" : "");
    }
  }
  Tensor y = Tensor::empty(a.shape, DType::F32, Device::GPU);
  int64_t n = a.numel();
  if (n == 0) return y;
  int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, int64_t(detail::sm_count()) * 16);
  elementwise_kernel<OP><<<unsigned(blocks), kThreads, 0, detail::stream()>>>(
      a.ptr<float>(), b ? b->ptr<float>() : nullptr, y.ptr<float>(), n, b_period);
  SPECD_GPU_CHECK_LAUNCH("elementwise_kernel");
  return y;
}

}  // namespace

Tensor silu(const Tensor& x) { return run<Op::Silu>(x, nullptr, "silu", "x", ""); }
Tensor sigmoid(const Tensor& x) { return run<Op::Sigmoid>(x, nullptr, "sigmoid", "x", ""); }
Tensor softplus(const Tensor& x) { return run<Op::Softplus>(x, nullptr, "softplus", "x", ""); }
Tensor swiglu(const Tensor& gate, const Tensor& up) { return run<Op::Swiglu>(gate, &up, "swiglu", "gate", "up"); }
Tensor mul(const Tensor& a, const Tensor& b) { return run<Op::Mul>(a, &b, "mul", "a", "b"); }
Tensor add(const Tensor& a, const Tensor& b) { return run<Op::Add>(a, &b, "add", "a", "b"); }

}  // namespace specd::gpu
