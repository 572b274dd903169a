// GPU implementations of native ops (CUDA source, HIP through portability.h). Same contracts as
// the CPU ops of the same name (native/src/cpu/*.h); inputs are GPU tensors, outputs are new GPU
// tensors enqueued on the library stream (read them with Tensor.numpy(), which synchronises).
// Only included by builds with SPECD_WITH_GPU=1. Every op checks devices, dtypes and shapes and
// throws std::invalid_argument (Python ValueError) naming the op and argument, like the CPU ops;
// runtime failures throw std::runtime_error naming the failing call.
#pragma once
#include <optional>
#include <utility>

#include "specd/tensor.h"

namespace specd::gpu {

// RMSNorm over the last dimension: y = x / sqrt(mean(x^2) + eps) * weight (norm.cu).
// x: F32 [..., d] contiguous; weight: F32 [d] or none; eps finite, >= 0. With `residual` (F32, same
// shape as x) h = x + residual is normalised and returned as the second element; without it the
// second element is x itself. Agrees with cpu::rms_norm to ~1 ulp (double sum of squares).
std::pair<Tensor, Tensor> rms_norm(const Tensor& x, const std::optional<Tensor>& weight, float eps,
                                   const std::optional<Tensor>& residual);

// L2 normalisation over the last dimension: y = x / sqrt(sum(x^2) + eps). F32 [..., d] (norm.cu).
Tensor l2_norm(const Tensor& x, float eps);

// y[n, out] = x[n, in] @ w[out, in]^T (matmul.cu). x: F32 [..., in] contiguous (output shape is
// x's with the last dimension replaced by out); w: F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K or IQ4_XS
// [out, in] contiguous, in a multiple of the format's block size (32 / 256).
// n <= 16 rows: a GEMV-style kernel that reads each weight byte once per call, decodes the weights
// in registers to exactly cpu::dequantize's values and accumulates in F32; batch invariant: row i
// of y is bit-identical whatever n (1..16). n > 16: w dequantized to BF16 and x rounded to BF16 on
// the device, then cuBLAS / hipBLAS with F32 accumulation (matmul_blas.cu); error within
// (2^-8 + 1e-5) * (|x| @ |w|^T) elementwise, not batch invariant across n.
Tensor matmul(const Tensor& x, const Tensor& w);

// Index of the first maximum of each row (argmax.cu); x F32 [..., V] contiguous, V >= 1 ->
// I32 [...] (x's shape without the last dimension). NaN counts as larger than every number
// (numpy.argmax semantics: the first NaN wins); -0.0 == +0.0 (the first wins).
Tensor argmax(const Tensor& x);

}  // namespace specd::gpu
