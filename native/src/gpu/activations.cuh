// Device forms of the elementwise functions of cpu/activations.h, shared by elementwise.cu and the
// fused ops (gdn_gates, the gated RMSNorm in norm.cu, gdn_step in ssm.cu, the x splits of swiglu_matmul and
// mul_sigmoid_matmul in matmul.cu): a fused op that calls apply<OP> computes each element with literally the
// code of the standalone op, so it is bit-identical to it.
#pragma once
#include <cmath>
#include <cstdint>

#ifndef SPECD_HOST_EMU
#include "common.cuh"
#else
#include "warp_reduce.cuh"  // the emulation harnesses (tests/gpu/host_emu) have no runtime header
#endif

namespace specd::gpu::detail {

__device__ __forceinline__ double sigmoid_f64(double x) {
  if (x >= 0.0) return 1.0 / (1.0 + exp(-x));
  double e = exp(x);
  return e / (1.0 + e);
}

enum class Op { Silu, Sigmoid, Softplus, Swiglu, Mul, Add };

// Evaluated in double and rounded to F32 once; mul / add are single F32 roundings (the _rn
// intrinsics also keep the compiler from contracting them into an FMA with a neighbouring op).
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

// Element i of mul_sigmoid(a, gate) over rows of d: a[i] * sigmoid(gate), gate's rows `pitch` floats apart
// (mul_sigmoid_kernel and mul_sigmoid_matmul's split).
__device__ __forceinline__ float mul_sigmoid_at(const float* a, const float* gate, int64_t i, int64_t d,
                                                int64_t pitch) {
  return apply<Op::Mul>(a[i], apply<Op::Sigmoid>(gate[i / d * pitch + i % d], 0.0f));
}

// One element of gdn_gates: g = ssm_a * softplus(a + dt) and beta = sigmoid(b), with the add, softplus,
// mul and sigmoid ops' code (shared by gdn_gates_kernel and gdn_step_kernel).
__device__ __forceinline__ float gdn_g(float a, float dt, float ssm_a) {
  return apply<Op::Mul>(apply<Op::Softplus>(apply<Op::Add>(a, dt), 0.0f), ssm_a);
}
__device__ __forceinline__ float gdn_beta(float b) { return apply<Op::Sigmoid>(b, 0.0f); }

}  // namespace specd::gpu::detail
