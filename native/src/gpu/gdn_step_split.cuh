// gdn_step_kernel fused with its output's gated norm and the out projection's x split (gdn_step_split_kernel, the
// GPU's gdn_step_gated_matmul in matmul.cu). Its own header because it needs the tensor-core GEMV's split
// (norm_split.cuh, matmul_mma.cuh), which only matmul.cu may include (their non-template kernels are defined there);
// compiled for the host by the emulation harness tests/gpu/host_emu/gdn_split_main.cpp.
#pragma once

#include "gdn_step.cuh"
#include "norm_split.cuh"

#if SPECD_MMA_GEMV
namespace specd::gpu::detail::gdn_step {

// gdn_step_kernel followed by the output's gated norm and the out projection's x split (gated_norm_split_kernel's
// work, norm_split.cuh), in one launch: rms_norm_gated_matmul(o, norm_w, eps, z, [ssm_out]) without o's kernel
// boundary. The blocks run in clusters of kGdnSplitCluster, one per 256-input split group of o's rows (the launch
// asks rows = 32 state rows a block, 256 % dv == 0 and hv dv % 256 == 0, so block b holds the group's inputs
// 32 (b % 8) .. + 31). Each block stores its o as gdn_step_kernel does, then its state; the cluster barrier makes
// the group's o visible to the cluster's blocks (release / acquire at cluster scope), and block `rank` of the
// cluster norms and splits the group for tokens rank, rank + 8, ... with gated_norm_split_kernel's code (the
// same values bit for bit: gated_norm_group, split_group). T <= 16 (the GEMV's rows). (Staging the tokens' z and
// the norm weight in shared memory before the recurrence, so that their loads overlap it, measured 7 us a decode
// step slower on the H200: BENCHMARKS.md.)
constexpr int kGdnSplitCluster = mma::kGroup / kGdnRows;

// gdn_step_split_kernel's dynamic shared memory (bytes) at dk = DK: gdn_step_kernel's stage for kGdnRows rows, then
// the group being split (kGroup floats, 16-byte aligned: the stage is whole 32-byte rows).
template <int DK>
__host__ __device__ constexpr size_t gdn_split_smem() {
  return gdn_step_smem<DK>(kGdnRows) + mma::kGroup * sizeof(float);
}

// The launch bounds ask for at least one resident block a multiprocessor, which lifts ptxas's register target:
// without the minimum it gave the kernel 64 registers and 112 bytes of spills (dk 128), with it 107 and none.
template <int E, int L>
__global__ void __launch_bounds__(kGdnRows * L, 1) gdn_step_split_kernel(const GdnStepParams P, const GatedSplit S) {
  pdl_enter_prefetch(gdn_block_state<E * L>(P, blockDim.x / L), gdn_block_state_bytes<E, L>());
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // no clusters before sm_90: the host launches this only for an sm90_binary
#else
  gdn_step_block<E, L>(P);
  const cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  cluster.sync();  // the group's o, written by the cluster's blocks, visible to each of them
  const int64_t grp = blockIdx.x / kGdnSplitCluster, first = grp * mma::kGroup;
  float* v = dyn_smem() + gdn_step_smem<E * L>(blockDim.x / L) / sizeof(float);  // past the stage: [kGroup]
  const int lane = int(threadIdx.x % SPECD_WARP), warp = int(threadIdx.x / SPECD_WARP);
  for (int64_t t = cluster.block_rank(); t < P.T; t += kGdnSplitCluster) {
    gated_norm_group(P.o + t * S.in + first, S.z + t * S.in + first, S.w, P.dv, S.eps, mma::kGroup, v, warp,
                     int(blockDim.x / SPECD_WARP), lane);
    __syncthreads();
    if (warp == 0) mma::split_group(SharedGroupInput{v, grp}, int(t), int(P.T), grp, S.in, lane, S.xb, S.xs, S.xm);
    __syncthreads();  // v is the next token's
  }
#endif
}

}  // namespace specd::gpu::detail::gdn_step
#endif
