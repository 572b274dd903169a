#pragma once
#include <optional>
#include <utility>

#include "specd/tensor.h"

namespace specd::cpu {

// RMSNorm over the last dimension: y = x / sqrt(mean(x^2) + eps) * weight.
// x: F32 [..., d] (contiguous rows); weight: F32 [d] or none (then a plain RMS normalisation).
// With `residual` (F32, same shape) the input is h = x + residual and the result is (y, h): the
// fused "add the residual, then normalise" step of a pre-norm block. Source: Zhang & Sennrich 2019
// (RMSNorm); GGUF norms store the multiplier directly (qwen35-target.md §6.2).
std::pair<Tensor, Tensor> rms_norm(const Tensor& x, const std::optional<Tensor>& weight, float eps,
                                   const std::optional<Tensor>& residual);

// L2 normalisation over the last dimension: y = x / sqrt(sum(x^2) + eps). F32 [..., d].
// This is the GDN q/k norm (eps inside the square root of the sum; qwen35-target.md §6.2).
Tensor l2_norm(const Tensor& x, float eps);

}  // namespace specd::cpu
