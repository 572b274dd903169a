// Device forms of the elementwise functions of cpu/activations.h, shared by elementwise.cu and the
// fused ops (gdn_gates, the gated RMSNorm in norm.cu, gdn_step in ssm.cu): a fused op that calls apply<OP> computes
// each element with literally the code of the standalone op, so it is bit-identical to it.
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

// A float that rounds to BF16 (round to nearest even) exactly as apply<Op::Swiglu>(a, b) does, mostly
// without apply's double arithmetic (the prefill's BF16 GEMM input, matmul_blas.cu: in double it was
// 0.4 of the copy bandwidth). y = a / (1 + expf(-a)) * b in F32 is within 3.5 * 2^-23 |swiglu(a, b)|
// of the exact value (expf: 2 ulp, CUDA C Programming Guide, "Mathematical Functions"; three IEEE
// roundings) and apply's result within 2^-24 of it: under 8 units in y's last place apart. Their BF16
// roundings can differ only if a rounding midpoint (low 16 bits 0x8000) lies between them, so y is
// returned when its low bits are more than kSwigluMargin units from 0x8000 and it is a normal float
// below the top binade (no subnormal, zero, overflow or NaN case); otherwise (about 1 in 500 random
// inputs) apply decides.
constexpr uint32_t kSwigluMargin = 64;
__device__ __forceinline__ float swiglu_for_bf16(float a, float b) {
  const float y = __fmul_rn(__fdiv_rn(a, __fadd_rn(1.0f, expf(-a))), b);
  const uint32_t u = __float_as_uint(y), e = (u >> 23) & 0xffu;
  const bool clear = e >= 2 && e <= 253 && (u & 0xffffu) + kSwigluMargin - 0x8000u > 2 * kSwigluMargin;
  return clear ? y : apply<Op::Swiglu>(a, b);
}

// One element of gdn_gates: g = ssm_a * softplus(a + dt) and beta = sigmoid(b), with the add, softplus,
// mul and sigmoid ops' code (shared by gdn_gates_kernel and gdn_step_kernel).
__device__ __forceinline__ float gdn_g(float a, float dt, float ssm_a) {
  return apply<Op::Mul>(apply<Op::Softplus>(apply<Op::Add>(a, dt), 0.0f), ssm_a);
}
__device__ __forceinline__ float gdn_beta(float b) { return apply<Op::Sigmoid>(b, 0.0f); }

}  // namespace specd::gpu::detail
