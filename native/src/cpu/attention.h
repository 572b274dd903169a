#pragma once
#include <optional>
#include <vector>

#include "specd/tensor.h"

namespace specd::cpu {

// KV cache layout: a contiguous CPU Tensor [capacity, n_kv_heads, head_dim] of dtype F32, F16 or
// Q8_0 (Q8_0 needs head_dim % 32 == 0: every head row is whole ggml blocks). Row p holds the key
// (or value) of cache slot p for all KV heads.

// Writes x[i] (F32 [n, n_kv_heads, head_dim], last dim contiguous) into cache row rows[i]
// (I32 [n]), converting with quantize_row to the cache dtype (bit-identical to
// gguf.quants.quantize). Requires 0 <= rows[i] < capacity and distinct rows. In place.
void kv_write(const Tensor& cache, const Tensor& x, const Tensor& rows);

// The format contract of a KV cache, shared by the CPU and GPU backends (each checks the device
// first): 3-D [capacity, n_kv_heads, head_dim], contiguous, F32 / F16 / Q8_0, head_dim a multiple of
// the dtype's block size. Throws std::invalid_argument naming `op` and `arg`.
void check_kv_cache_format(const Tensor& cache, const char* op, const char* arg);

// kv_write's checks shared by the CPU and GPU backends and qk_norm_rope's cache write, after each has
// checked the tensors' devices, dtypes and layouts. check_kv_write_shapes: `cache` (named cache_arg)
// writable, x [n, n_kv_heads, head_dim] of the cache's head shape (named x_arg), rows with n entries.
// check_kv_rows: the rows' values (on the host; or a CPU I32 [n] tensor's, any stride) in [0, capacity)
// and distinct. Throw std::invalid_argument naming `op` and the argument.
void check_kv_write_shapes(const Tensor& cache, const Tensor& x, const Tensor& rows, const char* op,
                           const char* cache_arg, const char* x_arg);
void check_kv_rows(std::vector<int32_t> rows, int64_t capacity, const char* op);
void check_kv_rows(const Tensor& rows, int64_t capacity, const char* op);

struct AttentionArgs {
  int64_t kv_len = 0;
  bool causal = true;
  int64_t window = 0;
  std::optional<Tensor> mask;  // I32 [n, kv_len], nonzero = visible
  std::optional<float> scale;  // None: 1 / sqrt(head_dim)
};

// Scaled dot-product attention of n queries against the first kv_len rows of a KV cache
// (softmax(q k^T * scale + M) v; Vaswani et al. 2017; GQA grouping as qwen35-target.md §6.3 step 5).
// q: F32 [n, Hq, d] (last dim contiguous); k_cache, v_cache: [capacity, Hkv, d] caches as above
// (their dtypes may differ); q_pos: I32 [n], each >= 0. Query head h reads KV head h / (Hq / Hkv)
// (Hq % Hkv == 0). Key j in [0, kv_len) is visible to query i iff
//   (no mask or mask[i, j] != 0) and (!causal or j <= q_pos[i]) and (window == 0 or j > q_pos[i] - window).
// Scores and the softmax are F32: dot products with fixed-order partial sums, a two-pass softmax
// (max over the visible scores, then exp-weights summed with the values in increasing key order),
// F32 accumulation. A query with no visible key gets zeros. The arithmetic of each (query, head)
// result depends only on the ordered sequence of its visible keys: not on n, the work split, the
// thread count, nor the cache rows the keys sit in (a tree node equals the chain verify of its
// path bitwise). Linear in kv_len per query.
// Returns F32 [n, Hq, d].
Tensor attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& q_pos,
                 const AttentionArgs& args);

}  // namespace specd::cpu
