#pragma once
#include <optional>
#include <tuple>
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

// Gated RMSNorm (the GDN output norm, qwen35-target.md §6.5): y = rms_norm(x, weight, eps) * silu(z)
// elementwise, z F32 of x's shape (contiguous). Each element is the F32 rms_norm value times the F32
// silu(z) value (cpu/activations.h), one F32 rounding: bit-identical to mul(rms_norm(x, weight, eps),
// silu(z)). Throws std::invalid_argument naming the argument as rms_norm does.
Tensor rms_norm_gated(const Tensor& x, const std::optional<Tensor>& weight, float eps, const Tensor& z);

// One row of rms_norm (no residual): y[i] = x[i] * scale * weight[i] (weight null: x[i] * scale), the
// scale from a fixed-order double sum of squares. Fused ops that normalise rows (rope.h's
// qk_norm_rope) call it, so they are bit-identical to rms_norm. y may not alias x.
void rms_norm_row(const float* x, const float* weight, int64_t d, float eps, float* y);

// Checks shared by the CPU and GPU norms (std::invalid_argument naming `op` and the argument):
// x F32 [..., d] contiguous on `dev`, weight F32 with d elements, eps finite and >= 0 ...
void check_rms_args(const Tensor& x, const std::optional<Tensor>& weight, float eps, Device dev, const char* op);
// ... and an F32 contiguous tensor of x's shape on `dev` (residual, z).
void check_like_x(const Tensor& t, const Tensor& x, Device dev, const char* op, const char* arg);

// L2 normalisation over the last dimension: y = x / sqrt(sum(x^2) + eps). F32 [..., d].
// This is the GDN q/k norm (eps inside the square root of the sum; qwen35-target.md §6.2).
Tensor l2_norm(const Tensor& x, float eps);

// The Gated DeltaNet q / k / v of the conv output (qwen35-target.md §6.5 steps 3 and 6) in one pass:
// cv F32 [w, C] contiguous, C = 2 Hk dk + Hv dv, columns [q heads | k heads | v heads]. Returns
// q, k = l2_norm of each dk-head (F32 [w, Hk, dk]) and v (F32 [w, Hv, dv], a copy). Each head is
// normalised by l2_norm's row arithmetic, so the result is bit-identical to l2_norm of the column
// slices. Throws std::invalid_argument (check_gdn_qkv_args) on a bad cv, dimension or eps.
std::tuple<Tensor, Tensor, Tensor> gdn_qkv(const Tensor& cv, int64_t n_k_heads, int64_t head_k_dim,
                                           int64_t n_v_heads, int64_t head_v_dim, float eps);
// gdn_qkv's checks, shared with the GPU backend: cv F32 2-D contiguous on `dev`, the four dimensions
// > 0 with C = 2 Hk dk + Hv dv, eps finite and >= 0.
void check_gdn_qkv_args(const Tensor& cv, int64_t n_k_heads, int64_t head_k_dim, int64_t n_v_heads,
                        int64_t head_v_dim, float eps, Device dev);

}  // namespace specd::cpu
