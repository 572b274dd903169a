// GPU implementations of native ops (CUDA source, HIP through portability.h). Same contracts as
// the CPU ops of the same name (native/src/cpu/*.h); inputs are GPU tensors, outputs are new GPU
// tensors enqueued on the library stream. Only included by builds with SPECD_WITH_GPU=1.
#pragma once
#include <optional>
#include <utility>

#include "specd/tensor.h"

namespace specd::gpu {

std::pair<Tensor, Tensor> rms_norm(const Tensor& x, const std::optional<Tensor>& weight, float eps,
                                   const std::optional<Tensor>& residual);
// y[n, out] = x[n, in] @ w[out, in]^T; x F32, w Q8_0 or F32.
Tensor matmul(const Tensor& x, const Tensor& w);
// Index of the first maximum of each row; x F32 [n, V] -> I32 [n].
Tensor argmax(const Tensor& x);

}  // namespace specd::gpu
