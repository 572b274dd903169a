// Elementwise activations and arithmetic on the GPU: silu, sigmoid, softplus, swiglu, mul, add,
// and the fused Gated DeltaNet gates (gdn_gates) and attention output gate (mul_sigmoid).
//
// Same formulas as cpu/activations.h, evaluated in double and rounded to F32 once (sigmoid split at
// 0 so it never overflows, softplus = x above 20 else log1p(exp(x))). Tolerance vs the CPU op:
// mul and add are exact (one F32 rounding, no contraction possible); silu, sigmoid, softplus and
// swiglu agree bit for bit except when the double exp/log1p of the device library (<= 1 ulp of
// double) and of the host libm straddle an F32 rounding boundary, i.e. <= 1 F32 ulp, practically
// never. Every element is computed independently, so results are batch invariant. mul / add
// broadcast a b of shape [H] or [1, H] over the rows of a [..., H] (same single rounding).
// gdn_gates runs the per-element functions of add, softplus, mul and sigmoid (activations.cuh) in
// one launch, so it is bit-identical to their composition on the GPU; likewise mul_sigmoid (sigmoid,
// then mul).
// GPU inputs must be contiguous (GPU tensors always are unless reshaped views of other layouts),
// except mul_sigmoid's gate: rows evenly spaced (qk_norm_rope's gate, a view inside qg).
#include <algorithm>
#include <cmath>

#include "../cpu/activations.h"
#include "activations.cuh"
#include "op_util.cuh"
#include "ops.h"

namespace specd::gpu {

namespace {

constexpr int kThreads = 256;

using detail::apply;
using detail::Op;

template <Op OP>
__global__ void __launch_bounds__(kThreads) elementwise_kernel(const float* __restrict__ a, const float* __restrict__ b,
                                                               float* __restrict__ y, int64_t n, int64_t b_period) {
  detail::pdl_enter();
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += int64_t(gridDim.x) * kThreads)
    y[i] = apply<OP>(a[i], b ? b[b_period ? i % b_period : i] : 0.0f);
}

// Grid-stride launches: at most 16 blocks of kThreads per SM.
int64_t grid_for(int64_t n) {
  return std::min<int64_t>((n + kThreads - 1) / kThreads, int64_t(detail::sm_count()) * 16);
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
  detail::launch_kernel<elementwise_kernel<OP>>("elementwise_kernel", unsigned(grid_for(n)), kThreads, 0,
                                                detail::stream(), a.ptr<float>(), b ? b->ptr<float>() : nullptr,
                                                y.ptr<float>(), n, b_period);
  return y;
}

// g = ssm_a * softplus(a + dt), beta = sigmoid(b) over a, b [T, H]; dt, ssm_a [H].
__global__ void __launch_bounds__(kThreads) gdn_gates_kernel(const float* __restrict__ a, const float* __restrict__ b,
                                                             const float* __restrict__ dt,
                                                             const float* __restrict__ ssm_a, float* __restrict__ g,
                                                             float* __restrict__ beta, int64_t n, int64_t h) {
  detail::pdl_enter();
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += int64_t(gridDim.x) * kThreads) {
    const int64_t c = i % h;
    g[i] = detail::gdn_g(a[i], dt[c], ssm_a[c]);
    beta[i] = detail::gdn_beta(b[i]);
  }
}

// y = a * sigmoid(gate) over [rows, d]; gate's row r starts at gate + r * pitch.
__global__ void __launch_bounds__(kThreads) mul_sigmoid_kernel(const float* __restrict__ a,
                                                               const float* __restrict__ gate, float* __restrict__ y,
                                                               int64_t n, int64_t d, int64_t pitch) {
  detail::pdl_enter();
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += int64_t(gridDim.x) * kThreads)
    y[i] = detail::mul_sigmoid_at(a, gate, i, d, pitch);
}

}  // namespace

Tensor silu(const Tensor& x) { return run<Op::Silu>(x, nullptr, "silu", "x", ""); }
Tensor sigmoid(const Tensor& x) { return run<Op::Sigmoid>(x, nullptr, "sigmoid", "x", ""); }
Tensor softplus(const Tensor& x) { return run<Op::Softplus>(x, nullptr, "softplus", "x", ""); }
Tensor swiglu(const Tensor& gate, const Tensor& up) { return run<Op::Swiglu>(gate, &up, "swiglu", "gate", "up"); }
Tensor mul(const Tensor& a, const Tensor& b) { return run<Op::Mul>(a, &b, "mul", "a", "b"); }
Tensor add(const Tensor& a, const Tensor& b) { return run<Op::Add>(a, &b, "add", "a", "b"); }

Tensor mul_sigmoid(const Tensor& a, const Tensor& gate) {
  const int64_t pitch = detail::check_mul_sigmoid(a, gate, "mul_sigmoid"), n = a.numel();
  Tensor y = Tensor::empty(a.shape, DType::F32, Device::GPU);
  if (n == 0) return y;
  detail::launch_kernel<mul_sigmoid_kernel>("mul_sigmoid_kernel", unsigned(grid_for(n)), kThreads, 0, detail::stream(),
                                            a.ptr<float>(), gate.ptr<float>(), y.ptr<float>(), n, a.cols(), pitch);
  return y;
}

std::pair<Tensor, Tensor> gdn_gates(const Tensor& a, const Tensor& b, const Tensor& dt, const Tensor& ssm_a) {
  detail::check_gpu_tensor(a, DType::F32, 2, "gdn_gates", "a");
  detail::check_gpu_tensor(b, DType::F32, 2, "gdn_gates", "b");
  detail::check_gpu_tensor(dt, DType::F32, -1, "gdn_gates", "dt");
  detail::check_gpu_tensor(ssm_a, DType::F32, -1, "gdn_gates", "ssm_a");
  const int64_t h = cpu::check_gdn_gates_shapes(a, b, dt, ssm_a), n = a.numel();
  Tensor g = Tensor::empty(a.shape, DType::F32, Device::GPU), beta = Tensor::empty(a.shape, DType::F32, Device::GPU);
  if (n == 0) return {g, beta};
  detail::launch_kernel<gdn_gates_kernel>("gdn_gates_kernel", unsigned(grid_for(n)), kThreads, 0, detail::stream(),
                                          a.ptr<float>(), b.ptr<float>(), dt.ptr<float>(), ssm_a.ptr<float>(),
                                          g.ptr<float>(), beta.ptr<float>(), n, h);
  return {g, beta};
}

}  // namespace specd::gpu
