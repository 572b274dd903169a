// RMSNorm fused with the tensor-core GEMV's x split (gpu::rms_norm_matmul, matmul.cu): the norm kernel
// writes the split of its output that the GEMV reads (matmul_mma.cuh: split_group), and the normed rows
// are never stored. A header, so that the emulation harness (tests/gpu/host_emu/norm_split_main.cpp)
// compiles the kernel for the CPU and checks it bit for bit against the composition it replaces (the
// standalone norm's norm_row, then split_x_kernel).
#pragma once

#include "matmul_mma.cuh"
#include "norm.cuh"
#include "pdl.cuh"

#if SPECD_MMA_GEMV
namespace specd::gpu::detail {

// rms_norm's output values (norm.cuh: normed, the standalone kernel's second pass) as split inputs:
// row r of src (x, or h = x + residual) times the row's scale and w (or none). Rows 16-byte aligned.
struct NormInput {
  const float* src;
  const float* __restrict__ w;
  float scale;  // of the row being split (one block per row)
  int64_t d;
  __device__ __forceinline__ void load(int r, int64_t blk, int t, float (&v)[8]) const {
    const float4* s4 = reinterpret_cast<const float4*>(src + int64_t(r) * d + 32 * blk);
    const float4* w4 = w ? reinterpret_cast<const float4*>(w + 32 * blk) : nullptr;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int i = t + 4 * k;  // inputs 4t.. (k = 0) and 16 + 4t.. (k = 1)
      mma::put4(v, k, norm::normed<false>(s4[i], scale, w4 ? w4 + i : nullptr, float4{}));
    }
  }
};

// x, residual, h: [n, d] (d % 32 == 0, rows 16-byte aligned); w: [d] or null. One block per row of
// norm::threads_for(d / 4) threads (the standalone norm's block size): the norm's first pass (norm.cuh,
// the standalone vector kernel's arithmetic: the same scale), then the block's warps split the row's
// 256-input groups from the values the norm's second pass would store (NormInput), so the split (xb /
// xs / xm, the mma::XSizes(d) layout) equals split_x of rms_norm's output bit for bit; with a
// residual, h = x + residual is stored.
template <bool RESID>
__global__ void __launch_bounds__(norm::kMaxThreads)
    norm_split_kernel(const float* __restrict__ x, const float* __restrict__ residual, const float* __restrict__ w,
                      float* h, int64_t d, float eps, int n, uint2* __restrict__ xb, float* __restrict__ xs,
                      uint32_t* __restrict__ xm) {
  pdl_enter();
  using namespace norm;
  const int r = int(blockIdx.x);
  const int64_t off = int64_t(r) * d;
  const float4* rr = RESID ? reinterpret_cast<const float4*>(residual + off) : nullptr;
  float4* hr = RESID ? reinterpret_cast<float4*>(h + off) : nullptr;
  const double ss = block_sum(row_squares<RESID>(reinterpret_cast<const float4*>(x + off), rr, hr, d / 4));
  // block_sum ended with a block barrier: every warp sees the whole stored h row.
  const NormInput src{RESID ? h : x, w, rms_scale(ss, d, eps), d};
  const int64_t groups = (d + mma::kGroup - 1) / mma::kGroup;
  for (int64_t grp = threadIdx.x / 32; grp < groups; grp += blockDim.x / 32)
    mma::split_group(src, r, n, grp, d, int(threadIdx.x & 31), xb, xs, xm);
}

}  // namespace specd::gpu::detail
#endif
