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
// x's with the last dimension replaced by out); w: Q8_0 or F32 [out, in] contiguous (Q8_0: in a
// multiple of 32). F32 accumulation. A GEMV-style kernel that reads each weight byte once per 16
// rows of x (so once per call for n <= 16); batch invariant: row i of y is bit-identical whatever
// the number of rows in the call.
Tensor matmul(const Tensor& x, const Tensor& w);

// Index of the first maximum of each row (argmax.cu); x F32 [..., V] contiguous, V >= 1 ->
// I32 [...] (x's shape without the last dimension). NaN counts as larger than every number
// (numpy.argmax semantics: the first NaN wins); -0.0 == +0.0 (the first wins).
Tensor argmax(const Tensor& x);

}  // namespace specd::gpu
