// RMSNorm fused with the tensor-core GEMV's x split (gpu::rms_norm_matmul, matmul.cu): the norm kernel
// writes the split of its output that the GEMV reads (matmul_mma.cuh: split_group), and the normed rows
// are never stored. A header, so that the emulation harness (tests/gpu/host_emu/norm_split_main.cpp)
// compiles the kernel for the CPU and checks it bit for bit against the composition it replaces (the
// standalone norm's norm_row, then split_x_kernel).
#pragma once

#include "dyn_smem.cuh"
#include "matmul_mma.cuh"
#include "norm.cuh"
#include "pdl.cuh"

#if SPECD_MMA_GEMV
namespace specd::gpu::detail {

// Rows of up to this many floats are staged in the block's dynamic shared memory (32 KiB, under the
// 48 KiB a launch may take without opting in): the split then reads no global memory after the norm's sum.
constexpr int64_t kMaxStagedFloats = 8192;

// Lane `lane`'s norm weights for 256-input group grp: the inputs 4t.. and 16 + 4t.. (t = lane % 4) of
// the group's 32-input sub-block lane / 4, as split_group asks NormInput for them; zeros for a
// sub-block past d (a ragged last group) or without a weight.
__device__ __forceinline__ void group_weights(const float* __restrict__ w, int64_t grp, int64_t d, int lane,
                                              float4 (&wv)[2]) {
  const int64_t blk = grp * (mma::kGroup / 32) + (lane >> 2);
  wv[0] = wv[1] = float4{};
  if (w && 32 * blk < d) {
    const float4* w4 = reinterpret_cast<const float4*>(w + 32 * blk);
    wv[0] = w4[lane & 3], wv[1] = w4[4 + (lane & 3)];
  }
}

// rms_norm's output values (norm.cuh: normed, the standalone kernel's second pass) as split inputs:
// the row being split (x, or h = x + residual; in shared memory when staged, else global memory; one
// block per row) times the row's scale and the lane's weights wv of the group being split (or none):
// wv holds one group's weights, so the input is given to split_group for that group only (the kernel
// reloads wv for each group).
struct NormInput {
  const float4* row;  // the row's first 4 inputs (16-byte aligned)
  bool weighted;
  float4 wv[2];  // group_weights of the group split_group is given with this input
  float scale;
  __device__ __forceinline__ void load(int /*r: the block's row, `row`*/, int64_t blk, int t, float (&v)[8]) const {
    const float4* s4 = row + 8 * blk;
#pragma unroll
    // inputs 4t.. (k = 0) and 16 + 4t.. (k = 1): norm::normed's arithmetic (checked bit for bit against it by
    // the emulation), written out on the values: normed's weight pointer to wv[k] gave the kernel a stack.
    for (int k = 0; k < 2; ++k) {
      const float4 a = s4[t + 4 * k];
      mma::put4(v, k, weighted ? norm::scale_mul(a, scale, wv[k]) : norm::scale_only(a, scale));
    }
  }
};

// x, residual, h: [n, d] (d % 32 == 0, rows 16-byte aligned); w: [d] or null. One block per row of
// norm::threads_for(d / 4) threads (the standalone norm's block size): the norm's first pass (norm.cuh,
// the standalone vector kernel's arithmetic: the same scale), then the block's warps split the row's
// 256-input groups from the values the norm's second pass would store (NormInput), so the split (xb /
// xs / xm, the mma::XSizes(d) layout) equals split_x of rms_norm's output bit for bit; with a
// residual, h = x + residual is stored.
// Latency (a decode step runs 128 of these, each a chain of dependent memory round trips):
// - each warp loads the norm weights of its first group before the programmatic-dependent-launch wait
//   (pdl.cuh's second exception: norm weights are uploads no kernel writes), so that HBM round trip
//   overlaps the kernel before;
// - STAGED (d <= kMaxStagedFloats, dynamic shared memory of d floats): the first pass keeps the row in
//   shared memory, and the split reads it there instead of re-reading global memory.
template <bool RESID, bool STAGED>
__global__ void __launch_bounds__(norm::kMaxThreads)
    norm_split_kernel(const float* __restrict__ x, const float* __restrict__ residual, const float* __restrict__ w,
                      float* h, int64_t d, float eps, int n, uint2* __restrict__ xb, float* __restrict__ xs,
                      uint32_t* __restrict__ xm) {
  pdl_launch_dependents();  // the next kernel may launch; this one waits below, after its weight loads
  using namespace norm;
  const int lane = int(threadIdx.x & 31), warp = int(threadIdx.x / 32), warps = int(blockDim.x / 32);
  const int64_t groups = (d + mma::kGroup - 1) / mma::kGroup;
  float4 wv[2];
  group_weights(w, warp, d, lane, wv);  // zeros for a warp past the last group (d <= 4096)
  pdl_wait();
  const int r = int(blockIdx.x);
  const int64_t off = int64_t(r) * d;
  const float4* rr = RESID ? reinterpret_cast<const float4*>(residual + off) : nullptr;
  float4* hr = RESID ? reinterpret_cast<float4*>(h + off) : nullptr;
  float4* stage = STAGED ? reinterpret_cast<float4*>(dyn_smem()) : nullptr;
  const double ss = block_sum(row_squares<RESID>(reinterpret_cast<const float4*>(x + off), rr, hr, d / 4, stage));
  // block_sum ended with a block barrier: every warp sees the whole stored row (h, stage).
  const float4* row = STAGED ? stage : reinterpret_cast<const float4*>((RESID ? h : x) + off);
  NormInput src{row, w != nullptr, {wv[0], wv[1]}, rms_scale(ss, d, eps)};
  for (int64_t grp = warp; grp < groups; grp += warps) {
    if (grp != warp) group_weights(w, grp, d, lane, src.wv);
    mma::split_group(src, r, n, grp, d, lane, xb, xs, xm);
  }
}

}  // namespace specd::gpu::detail
#endif
