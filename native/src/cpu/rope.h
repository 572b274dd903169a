#pragma once
#include <optional>
#include <tuple>
#include <vector>

#include "specd/tensor.h"

namespace specd::cpu {

// YaRN settings in transformers' `rope_parameters` terms (rope_type "yarn"). factor == 1 means
// plain RoPE; original_context is `original_max_position_embeddings`.
struct Yarn {
  double factor = 1.0;
  int64_t original_context = 0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  std::optional<double> attention_factor;  // None: 0.1 * ln(factor) + 1 (1 when factor == 1)
};

// Per-frequency inverse frequencies (n_rot / 2 values) and the cos/sin multiplier, in double.
// Plain RoPE: inv_freq[i] = theta^(-2i / n_rot), multiplier 1. YaRN (factor > 1): transformers
// `modeling_rope_utils._compute_yarn_parameters` with truncate=True: correction dims
//   d(r) = n_rot * ln(orig / (2*pi*r)) / (2 ln theta), low = max(floor(d(beta_fast)), 0),
//   high = min(ceil(d(beta_slow)), n_rot - 1) (high += 0.001 if equal),
//   ramp[i] = clamp((i - low) / (high - low), 0, 1),
//   inv_freq[i] = inv[i] / factor * ramp[i] + inv[i] * (1 - ramp[i]),
// multiplier = attention_factor or 0.1 * ln(factor) + 1. Validates its arguments (errors name `op`).
struct RopeFreqs {
  std::vector<double> inv_freq;
  double mscale = 1.0;
};
RopeFreqs rope_freqs(int64_t n_rot, double theta, const Yarn& yarn, const char* op);

// Partial NeoX ("rotate half") RoPE on the first n_rot dims of every head (qwen35-target.md §6.4,
// drafters.md §3.4). x: F32 [n, heads, head_dim] (last dim contiguous, outer strides free);
// positions: I32 [n], each >= 0. For i < n_rot / 2 the pair (x[i], x[i + n_rot/2]) is rotated by
// angle a = pos * inv_freq[i]:
//   y[i] = m * (x[i] cos a - x[i + h] sin a),  y[i + h] = m * (x[i + h] cos a + x[i] sin a),
// with m the YaRN multiplier (1 for plain RoPE); dims >= n_rot are copied. Angles, cos/sin and the
// rotation are computed in double and rounded to F32 once. Requires theta finite > 0, n_rot even
// with 0 <= n_rot <= head_dim, factor >= 1 and original_context > 0 when factor > 1.
// Returns a new contiguous F32 tensor of x's shape.
Tensor rope_neox(const Tensor& x, const Tensor& positions, int64_t n_rot, double theta, const Yarn& yarn);

// qk_norm_rope's optional KV cache write (the attention layer's two kv_write calls): k_cache and v_cache
// KV caches as kv_write's (cpu/attention.h; the same shape [capacity, n_kv_heads, head_dim], dtypes may
// differ), v F32 [w, n_kv_heads, head_dim] (contiguous), rows I32 [w].
struct QkCacheWrite {
  Tensor k_cache, v_cache, v, rows;
};

// The gated attention's q / k preparation in one pass (qwen35-target.md §6.3 steps 1-3):
// qg F32 [w, nh, 2 hd] (per head [q | gate], contiguous), k F32 [w, nkv, hd] (contiguous),
// q_norm_w / k_norm_w F32 [hd], positions I32 [w] (each >= 0). Returns (q, gate, k):
//   q = rope_neox(rms_norm(qg[..., :hd], q_norm_w, eps), positions, n_rot, theta)  F32 [w, nh, hd]
//   gate = qg[..., hd:], a view of qg's memory (no copy; rows 2 hd floats apart)      F32 [w, nh, hd]
//   k = rope_neox(rms_norm(k, k_norm_w, eps), positions, n_rot, theta)              F32 [w, nkv, hd]
// Plain RoPE (no YaRN). Each head row goes through rms_norm_row and the rotation of rope_neox, so q
// and k are bit-identical to that composition. With `cache`, then also kv_write(k_cache, k, rows) and
// kv_write(v_cache, v, rows) (the returned k; the same bytes), every argument checked before anything is
// written (the rows in range and distinct; the caches overlapping neither each other nor an input).
// Throws std::invalid_argument naming the argument.
std::tuple<Tensor, Tensor, Tensor> qk_norm_rope(const Tensor& qg, const Tensor& k, const Tensor& q_norm_w,
                                                const Tensor& k_norm_w, const Tensor& positions, int64_t n_rot,
                                                double theta, float eps,
                                                const std::optional<QkCacheWrite>& cache = std::nullopt);

// qk_norm_rope's checks shared by the CPU and GPU backends (positions: count only, each backend
// checks its dtype, device and values), and its gate view of qg.
void check_qk_norm_rope_args(const Tensor& qg, const Tensor& k, const Tensor& q_norm_w, const Tensor& k_norm_w,
                             const Tensor& positions, int64_t n_rot, float eps, Device dev);
Tensor qk_gate_view(const Tensor& qg);
// The same for its cache write, after check_qk_norm_rope_args (rows: dtype, rank and count; each backend
// checks their device, layout and values, as kv_write's).
void check_qk_cache_write(const QkCacheWrite& c, const Tensor& qg, const Tensor& k, const Tensor& q_norm_w,
                          const Tensor& k_norm_w, const Tensor& positions, Device dev);

}  // namespace specd::cpu
