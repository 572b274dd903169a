// RMSNorm fused with the tensor-core GEMV's x split (gpu::rms_norm_matmul, matmul.cu): the norm kernel
// writes the split of its output that the GEMV reads (matmul_mma.cuh: split_group), and the normed rows
// are never stored. A header, so that the emulation harness (tests/gpu/host_emu/norm_split_main.cpp)
// compiles the kernel for the CPU and checks it bit for bit against the composition it replaces (the
// standalone norm's norm_row, then split_x_kernel).
#pragma once

#include "dyn_smem.cuh"
#include "matmul_mma.cuh"
#include "norm.cuh"
#include "partials.cuh"
#include "pdl.cuh"

#if SPECD_MMA_GEMV
#if !defined(SPECD_HOST_EMU)
#include <cooperative_groups.h>  // (CUDA only: SPECD_MMA_GEMV is 0 on HIP)
#endif

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
// reloads wv for each group). `row` holds the row from its 32-input block blk0 on (0: the whole row; the
// cluster kernel below: the group's first block).
struct NormInput {
  const float4* row;  // the inputs of 32-input block blk0 on (16-byte aligned)
  int64_t blk0;
  bool weighted;
  float4 wv[2];  // group_weights of the group split_group is given with this input
  float scale;
  __device__ __forceinline__ void load(int /*r: the block's row, `row`*/, int64_t blk, int t, float (&v)[8]) const {
    const float4* s4 = row + 8 * (blk - blk0);
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
  NormInput src{row, 0, w != nullptr, {wv[0], wv[1]}, rms_scale(ss, d, eps)};
  for (int64_t grp = warp; grp < groups; grp += warps) {
    if (grp != warp) group_weights(w, grp, d, lane, src.wv);
    mma::split_group(src, r, n, grp, d, lane, xb, xs, xm);
  }
}

// --- the same norm on split-K partials, over a thread-block cluster ---------------------------------------------
// (The host emulation runs a cluster's blocks together: host_emu/warp_emu.h, emulate_clusters.)

#ifndef SPECD_NORM_CLUSTER_THREADS
#define SPECD_NORM_CLUSTER_THREADS 128  // threads of each block of norm_split_partials_kernel's clusters
#endif
constexpr int kClusterThreads = SPECD_NORM_CLUSTER_THREADS;
constexpr int kGroupItems = mma::kGroup / 4;  // float4 items of a 256-input split group
static_assert(kClusterThreads % kGroupItems == 0, "a cluster block must hold whole split groups");
constexpr int kMaxClusterBlocks = 8;  // the portable cluster size
static_assert(norm::kMaxThreads / kClusterThreads <= kMaxClusterBlocks, "a row's cluster must be portable");
constexpr size_t kMaxClusterStage = 32 << 10;  // bytes of a block's stage (under the 48 KiB of a plain launch)
// Split groups of a cluster block's items per item of its threads (kClusterThreads consecutive float4s).
constexpr int kClusterGroups = kClusterThreads / kGroupItems;

// A cluster block's stage for rows of d floats cut over `threads` threads: per item of a thread,
// kClusterThreads float4s.
inline size_t cluster_stage_bytes(int64_t d, int64_t threads) {
  return size_t((d / 4 + threads - 1) / threads) * kClusterThreads * 16;
}
// The warp sums every block of a cluster receives (one double per warp of the one-block kernel), in dynamic
// shared memory after the stage: the memory other blocks write is then all dynamic, which the host emulation
// maps block to block as the hardware's distributed shared memory.
constexpr size_t kClusterSumsBytes = (norm::kMaxThreads / SPECD_WARP) * sizeof(double);
// A cluster block's dynamic shared memory: its stage, then the warp sums (16-byte aligned: the stage is in float4s).
inline size_t cluster_smem_bytes(int64_t d, int64_t threads) {
  return cluster_stage_bytes(d, threads) + kClusterSumsBytes;
}

// Blocks per cluster of norm_split_partials_kernel for rows of d floats, or 0 when it does not serve d: the
// one-block kernel's threads_for(d / 4) threads cut into 2 .. kMaxClusterBlocks blocks of kClusterThreads,
// each staging at most kMaxClusterStage bytes. (Whether the device can run such a cluster is the launcher's
// question: matmul.cu, norm_reads_partials.)
inline int norm_cluster_blocks(int64_t d) {
  if (d % 4 != 0 || d <= 0) return 0;
  const int t = norm::threads_for(d / 4);
  const int blocks = t / kClusterThreads;
  const bool fits = t % kClusterThreads == 0 && blocks >= 2 && blocks <= kMaxClusterBlocks;
  return fits && cluster_stage_bytes(d, t) <= kMaxClusterStage ? blocks : 0;
}

// The q-th split group that block `rank` of a cluster of `threads` threads holds: its items j threads + rank
// kClusterThreads + [0, kClusterThreads) for j = q / kClusterGroups hold kClusterGroups whole groups.
__device__ __forceinline__ int64_t cluster_group(int64_t q, int threads, int rank) {
  return ((q / kClusterGroups) * threads + int64_t(rank) * kClusterThreads) / kGroupItems + q % kClusterGroups;
}

// norm_split_kernel (RESID, STAGED) on x given as split-K partials (partials.cuh: parts [splits][n][d], x =
// their in-order sum), h = x (+ residual) always stored. One cluster of norm_cluster_blocks(d) blocks per row
// (blockIdx.x = row * blocks + rank), together the one-block kernel's threads: thread g = rank *
// kClusterThreads + threadIdx.x takes that kernel's thread g's items (g, g + T, ... of the row's d / 4
// float4s), so its sum of squares, each warp's sum and then the sum of the T / 32 warp sums (every block gets
// all of them through distributed shared memory) are the one-block kernel's, in its order: the same scale and
// split, bit for bit. A block's items are whole split groups (kClusterThreads % 64 == 0), staged in its
// dynamic shared memory (cluster_smem_bytes: [per][kClusterThreads] float4s, then the warp sums), which its warps
// split.
// Why: the partials of the 27B's FFN down projection (17 splits of 5120) are 348 KB; one block reads them at
// one SM's bandwidth, a cluster of 5 at five times that, and sum_splits_kernel's launch goes. The launch bounds ask
// for at least one resident block a multiprocessor, which lifts ptxas's register target: without the minimum it gave
// the kernel 64 registers (95 with it), and a 27B decode step spent 698 us in it against 640 (H200, BENCHMARKS.md).
template <bool RESID>
__global__ void __launch_bounds__(kClusterThreads, 1)
    norm_split_partials_kernel(const float* __restrict__ parts, int splits, const float* __restrict__ residual,
                               const float* __restrict__ w, float* __restrict__ h, int64_t d, float eps, int n,
                               uint2* __restrict__ xb, float* __restrict__ xs, uint32_t* __restrict__ xm) {
  pdl_launch_dependents();  // the next kernel may launch; this one waits below, after its weight loads
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // no clusters before sm_90: the host launches this only for an sm90_binary
#else
  namespace cg = cooperative_groups;
  using namespace norm;
  const cg::cluster_group cluster = cg::this_cluster();
  // Another block's shared memory may be written only once that block runs: this arrival, waited for before
  // the warp sums are exchanged, says so (its wait overlaps the loads below).
  cluster.barrier_arrive();
  const int blocks = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  const int lane = int(threadIdx.x & 31), warp = int(threadIdx.x / 32);
  const int threads = blocks * kClusterThreads;  // T, the one-block kernel's block size
  const int g = rank * kClusterThreads + int(threadIdx.x);
  const int64_t items = d / 4, per = (items + threads - 1) / threads;
  const int64_t owned = per * kClusterGroups, groups = (d + mma::kGroup - 1) / mma::kGroup;
  float4 wv[2];
  group_weights(w, cluster_group(warp, threads, rank), d, lane, wv);  // zeros past the last group
  pdl_wait();
  const int r = int(blockIdx.x) / blocks;
  const int64_t off = int64_t(r) * d;
  const float4* rr = RESID ? reinterpret_cast<const float4*>(residual + off) : nullptr;
  float4* hr = reinterpret_cast<float4*>(h + off);
  float4* stage = reinterpret_cast<float4*>(dyn_smem());
  double* partial = reinterpret_cast<double*>(stage + per * kClusterThreads);  // cluster_smem_bytes' warp sums
  double ss = 0.0;  // row_squares' sum for thread g: its items in order
  for (int64_t j = 0; j < per; ++j) {
    const int64_t i = j * threads + g;
    if (i >= items) break;
    float4 v = fold_partials4(parts + off, splits, int64_t(n) * d, i);
    if constexpr (RESID) v = add(v, rr[i]);
    hr[i] = v;
    stage[j * kClusterThreads + threadIdx.x] = v;
    ss += sq(v);
  }
  // block_sum over the cluster: warp g / 32's sum to slot g / 32 of every block, then each warp sums the slots.
  const double mine = warp_sum(ss);
  cluster.barrier_wait();  // every block of the cluster runs
  if (lane == 0)
    for (int b = 0; b < blocks; ++b) *cluster.map_shared_rank(&partial[g / SPECD_WARP], b) = mine;
  cluster.sync();  // every slot written (and the stage visible to the block's warps); no remote access after it
  const int nwarps = threads / SPECD_WARP;
  const double ssum = warp_sum(lane < nwarps ? partial[lane] : 0.0);
  NormInput src{nullptr, 0, w != nullptr, {wv[0], wv[1]}, rms_scale(ssum, d, eps)};
  for (int64_t q = warp; q < owned; q += kClusterThreads / SPECD_WARP) {
    const int64_t grp = cluster_group(q, threads, rank);
    if (grp >= groups) break;
    if (q != warp) group_weights(w, grp, d, lane, src.wv);
    src.blk0 = grp * (mma::kGroup / 32);
    src.row = stage + (q / kClusterGroups) * kClusterThreads + (q % kClusterGroups) * kGroupItems;
    mma::split_group(src, r, n, grp, d, lane, xb, xs, xm);
  }
#endif
}

// --- the gated norm of groups of a 256-input split group (rms_norm_gated_matmul's split) --------------------------

// One 256-input group's values as split inputs: v = kGroup floats in 16-byte aligned shared memory, v[k] =
// input 256 grp + k of the row (zeros past `in`); load() is asked only for blocks blk of group grp.
struct SharedGroupInput {
  const float* v;
  int64_t grp;
  __device__ __forceinline__ void load(int, int64_t blk, int t, float (&out)[8]) const {
    const float* p = v + 32 * (blk - grp * (mma::kGroup / 32));
    mma::put4(out, 0, *reinterpret_cast<const float4*>(p + 4 * t));
    mma::put4(out, 1, *reinterpret_cast<const float4*>(p + 16 + 4 * t));
  }
};

// A gated norm's other inputs (rms_norm_gated's gate z [n, in], norm weight w [d] or null, and eps), the row length
// `in`, and the split x it writes (xb / xs / xm: the XSizes(in) layout).
struct GatedSplit {
  const float* z;
  const float* w;
  float eps;
  int64_t in;
  uint2* xb;
  float* xs;
  uint32_t* xm;
};

// rms_norm_gated of one 256-input split group of a row into v (kGroup floats of shared memory): xg, zg its first
// inputs of x and z (count: the row's inputs from xg on, of which the group holds at most kGroup; norm groups of d
// inputs: d % 4 == 0, d dividing 256; 16-byte aligned, as w [d] when given), zeros past count. Warp `warp` of
// `warps` norms the group's norm groups warp, warp + warps, ... with warp_norm_row, which replays the standalone
// rms_norm_gated's block sums (its vector path, one item per thread) with one warp: the same values bit for bit.
// The caller synchronises the block before reading v.
__device__ __forceinline__ void gated_norm_group(const float* xg, const float* zg, const float* w, int64_t d, float eps,
                                                 int64_t count, float* v, int warp, int warps, int lane) {
  for (int h = warp; h * d < mma::kGroup; h += warps) {
    if (h * d < count)
      norm::warp_norm_row<norm::Mode::RMS, true, true>(xg + h * d, w, zg + h * d, v + h * d, d, eps, lane);
    else
      for (int64_t k = lane; k < d; k += SPECD_WARP) v[h * d + k] = 0.0f;
  }
}

// Warps of gated_norm_split_kernel for norm groups of d inputs: one per group of a 256-input split group,
// at most 8 (a warp then norms several groups in turn).
constexpr int gated_norm_split_warps(int64_t d) { return int(std::min<int64_t>(mma::kGroup / d, 8)); }

// rms_norm_gated of x [n, in] (gated_norm_group's shapes) split for the GEMV into S's xb / xs / xm: n * groups
// blocks of gated_norm_split_warps(d) warps, one per (row r, 256-input group grp): gated_norm_group into shared
// memory, then warp 0 splits the group (split_group: the same terms as split_x of rms_norm_gated's output).
__global__ void __launch_bounds__(8 * SPECD_WARP) gated_norm_split_kernel(const float* __restrict__ x, int64_t d,
                                                                          int n, int64_t groups, const GatedSplit S) {
  pdl_enter();
  __shared__ __align__(16) float v[mma::kGroup];
  const int r = int(blockIdx.x / groups), lane = int(threadIdx.x % SPECD_WARP);
  const int64_t grp = blockIdx.x % groups, first = r * S.in + grp * mma::kGroup;
  gated_norm_group(x + first, S.z + first, S.w, d, S.eps, S.in - grp * mma::kGroup, v, int(threadIdx.x / SPECD_WARP),
                   int(blockDim.x / SPECD_WARP), lane);
  __syncthreads();
  if (threadIdx.x < SPECD_WARP) mma::split_group(SharedGroupInput{v, grp}, r, n, grp, S.in, lane, S.xb, S.xs, S.xm);
}

}  // namespace specd::gpu::detail
#endif
