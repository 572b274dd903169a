// The wide-matmul path of gpu::matmul (matmul_blas.cu): internal to the GPU backend.
#pragma once
#include "specd/tensor.h"

namespace specd::gpu::detail {

// y[n, out] = x[n, in] @ w[out, in]^T through the vendor GEMM (cuBLAS / hipBLAS): w is dequantized
// to BF16 on the device, in row panels of at most kPanelBytes, x is rounded to BF16, and the
// GEMM accumulates and writes F32. Used for inexact calls of n > 16 rows (prefill). Inputs are already
// validated by gpu::matmul; y is F32 [n, out] on the GPU. Not batch invariant across n (the
// library picks its algorithm per shape); the error is that of BF16 inputs (see ops.h).
void matmul_blas(const Tensor& x, const Tensor& w, Tensor& y);

}  // namespace specd::gpu::detail
