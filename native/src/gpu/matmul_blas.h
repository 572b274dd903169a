// The wide-matmul path of gpu::matmul (matmul_blas.cu): internal to the GPU backend.
#pragma once
#include <vector>

#include "specd/tensor.h"

namespace specd::gpu::detail {

// ys[i][n, out_i] = x[n, in] @ ws[i][out_i, in]^T through the vendor GEMM (cuBLAS / hipBLAS): x is
// rounded to BF16 once; each w is dequantized to BF16 on the device in row panels of whole 16-row
// tiles, at most kPanelBytes unless one tile is more (BF16 weights, 16-byte aligned with in % 8 == 0,
// are read as they are), and the GEMM accumulates and writes F32. Used for inexact calls of n > 16 rows (prefill). Inputs are already
// validated by gpu::matmul / matmul_group; ys are F32 on the GPU. Not batch invariant across n (the
// library picks its algorithm per shape); the error is that of BF16 inputs (see ops.h).
void matmul_blas(const Tensor& x, const std::vector<Tensor>& ws, std::vector<Tensor>& ys);
// The same with x = swiglu(gate, up) (F32 [n, in] each, contiguous), each value computed in F32 and rounded
// to BF16 in one pass: within one BF16 ulp of matmul_blas(swiglu(gate, up), ...)'s x (the swiglu op evaluates
// in double), so inside the same error bound.
void matmul_blas_swiglu(const Tensor& gate, const Tensor& up, const std::vector<Tensor>& ws, std::vector<Tensor>& ys);

}  // namespace specd::gpu::detail
