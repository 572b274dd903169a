#pragma once
#include <cmath>
#include <utility>

#include "specd/tensor.h"

namespace specd::cpu {

// Scalar forms, evaluated in double and rounded to F32 once (so results are correctly rounded
// in practice, down to the denormal range: silu(-100) = -3.7e-42 keeps its digits).
// sigmoid(x) = 1 / (1 + e^-x) for x >= 0 and e^x / (1 + e^x) for x < 0: no overflow on either
// side. silu(x) = x * sigmoid(x) (Elfwing et al. 2017; the SwiGLU and GDN conv activation,
// qwen35-target.md §6). softplus(x) = log(1 + e^x): x itself for x > kSoftplusThreshold (= 20:
// there log1p(e^-x) < 2.1e-9 is below half an F32 ulp of x, so x is the correctly rounded result;
// same threshold as torch.nn.Softplus), log1p(e^x) otherwise (no overflow, no cancellation for
// very negative x: softplus(-100) = 3.7e-44).
constexpr float kSoftplusThreshold = 20.0f;

inline double sigmoid_f64(double x) {
  if (x >= 0.0) return 1.0 / (1.0 + std::exp(-x));
  double e = std::exp(x);
  return e / (1.0 + e);
}
inline float sigmoid(float x) { return float(sigmoid_f64(x)); }
inline float silu(float x) { return float(double(x) * sigmoid_f64(x)); }
inline float softplus(float x) { return x > kSoftplusThreshold ? x : float(std::log1p(std::exp(double(x)))); }

// Elementwise ops over F32 tensors of any shape whose last dimension is contiguous (outer strides
// free, so numpy slices such as gate_up[:, :I] work without a copy). Binary ops need equal shapes,
// except that mul and add also take b of shape [H] or [1, H] for a of shape [..., H] and broadcast
// it over a's rows (exact F32, as numpy's a * b / a + b). Each returns a new contiguous F32 tensor of
// a's shape.
Tensor silu(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor softplus(const Tensor& x);
Tensor swiglu(const Tensor& gate, const Tensor& up);  // silu(gate) * up, in double, rounded once
Tensor mul(const Tensor& a, const Tensor& b);
Tensor add(const Tensor& a, const Tensor& b);
// The gated attention's output gate (qwen35-target.md §6.3 step 6): a * sigmoid(gate), a and gate of
// one shape (gate may be a row-strided view, e.g. qk_norm_rope's gate inside qg). Each element is
// the F32 sigmoid times a, one F32 rounding: bit-identical to mul(a, sigmoid(gate)).
Tensor mul_sigmoid(const Tensor& a, const Tensor& gate);

// Split-K partials, as the matmul ops hand their outputs over with `partials` (a GEMV's per-split sums,
// gpu/matmul_mma.cuh) and take them with `in_partials`: p F32 [S, ...] contiguous with S >= 1 on `device`;
// the value they stand for is p[0] + p[1] + ... + p[S - 1], added in that order with each add rounded once
// in F32 (the order of every backend's sum: gpu/partials.cuh). check_partials throws std::invalid_argument
// naming `op` and `arg` otherwise; first_part is part 0 as a view of shape p.shape[1:] (the value itself
// when S = 1); sum_partials (CPU) a new contiguous F32 tensor of that shape (part 0 itself when S = 1), its
// errors naming `op` and `arg`.
void check_partials(const Tensor& p, Device device, const char* op, const char* arg);
Tensor first_part(const Tensor& p);
Tensor sum_partials(const Tensor& p, const char* op = "sum_partials", const char* arg = "p");

// The Gated DeltaNet gates in one pass (qwen35-target.md §6.5 step 4): returns (g, beta) with
// g = ssm_a * softplus(a + dt) and beta = sigmoid(b), elementwise. a, b: F32 [T, H] (contiguous last
// dimension); dt, ssm_a: F32 [H] or [1, H], broadcast over the rows. Each element is computed by
// the scalar functions above with one F32 rounding per add / mul, so g and beta are bit-identical
// to mul(softplus(add(a, dt)), ssm_a) and sigmoid(b) (and to numpy's float32 a + dt, x * ssm_a).
// Throws std::invalid_argument naming the argument on a bad dtype, ndim or shape.
std::pair<Tensor, Tensor> gdn_gates(const Tensor& a, const Tensor& b, const Tensor& dt, const Tensor& ssm_a);

// The shape contract of gdn_gates, shared by the CPU and GPU backends (each checks its own devices,
// dtypes and layouts first): a [T, H], b of a's shape, dt and ssm_a [H] or [1, H]. Returns H.
int64_t check_gdn_gates_shapes(const Tensor& a, const Tensor& b, const Tensor& dt, const Tensor& ssm_a);

}  // namespace specd::cpu
