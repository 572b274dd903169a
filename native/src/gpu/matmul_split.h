// The tensor-core GEMV on an x that another op's kernel splits (matmul.cu): internal to the GPU backend, for the
// fused ops outside matmul.cu that end in a projection (ssm.cu: gdn_step_gated_matmul). CUDA only
// (SPECD_MMA_GEMV; on HIP those ops run their composition).
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "matmul_mma.cuh"
#include "specd/tensor.h"

namespace specd::gpu::detail {

// Checks the weights ws[i] [out_i, in] of a projection (GPU, 2-D, contiguous, a GEMV format of `in`), as every
// matmul op does first: std::invalid_argument naming `op`, "w" or "ws[i]" with i, and x_name.
void check_gemv_weights(int64_t in, const std::vector<Tensor>& ws, const char* op, const char* x_name = "x");

#if SPECD_MMA_GEMV

// Whether ws [out_i, in] run on the tensor-core GEMV against n rows of x split once by the op producing x:
// 1 <= n <= 16 and every weight in a tensor-core format (in % 4 == 0).
bool split_fusable(int64_t n, int64_t in, const std::vector<Tensor>& ws);

// Queues the kernel that writes the split x (the mma::XSizes(in) layout at `parts`; `groups` 256-input groups a row).
using SplitLauncher = std::function<void(const mma::XSizes::Parts& parts, int64_t groups)>;

// ys[i] = x @ ws[i]^T with x split by launch_split's kernel, then the GEMV (split_fusable(x.rows(), x.cols(), ws)):
// x is a tensor of the split values' shape [n, in] (it shapes the outputs; its data is not read). ws are checked
// against in before anything is queued (std::invalid_argument naming `op`); `partials`: each output as its
// split-K partials [S, n, out_i] (rms_norm_matmul's), else summed [n, out_i].
std::vector<Tensor> matmul_on_split(const Tensor& x, const std::vector<Tensor>& ws, const char* op, bool partials,
                                    const SplitLauncher& launch_split);

#endif

}  // namespace specd::gpu::detail
