// Matrix multiplication against stored weights, and embedding lookup (CPU backend).
#pragma once
#include "specd/tensor.h"

namespace specd::cpu {

// y[n, out] = x[n, in] @ w[out, in]^T  (nn.Linear without bias; GGUF weight ne = [in, out]).
// x: F32 [n, in], contiguous. w: F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K or IQ4_XS [out, in],
// contiguous (in a multiple of the block size). Returns F32 [n, out].
// Each weight row is decoded once per call (dequantize_row, bit-exact with gguf.quants) and dotted
// with every row of x, so the weight bytes are read once whatever n. Each output element is a
// float32 dot product with 16 interleaved partial sums (lane l sums k = l mod 16 in increasing k,
// the last partial group zero-padded), combined by a fixed pairwise tree: the result of row i does
// not depend on n, on the other rows or on the thread count (batch invariance).
// Throws std::invalid_argument on dtype/shape mismatch.
Tensor matmul(const Tensor& x, const Tensor& w);

// y[i] = dequantize(w[ids[i]]): w any weight dtype [V, H] (contiguous), ids I32 [n] with
// 0 <= id < V. Returns F32 [n, H], bit-identical to the dequantized rows.
Tensor embedding(const Tensor& w, const Tensor& ids);

}  // namespace specd::cpu
