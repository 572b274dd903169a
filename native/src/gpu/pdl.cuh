// Programmatic dependent launch (PDL, sm_90): a kernel launched with launch_kernel<K>() may have its blocks
// scheduled while the kernel before it in the stream drains, so launch latency and the ramp of one
// kernel overlap the tail of the last (a decode step is ~1100 mostly latency-bound launches).
//
// The contract that keeps the stream's order of memory effects: every kernel of the backend calls
// pdl_wait() before its first access to memory another kernel writes or reads (tests/gpu/
// test_gpu_pdl_lint.py checks that each __global__ function starts with pdl_enter(), pdl_enter_prefetch()
// or pdl_wait(), or with pdl_launch_dependents() and a pdl_wait() before any return). griddepcontrol.wait returns when
// the kernels it depends on have completed and their writes are visible; since each of those waited
// for its own predecessor, the order is transitive. Two exceptions load weights before waiting: the
// tensor-core GEMV (mma_gemv_kernel and mma_gemv_pair_kernel, their first weight units, in gemv_block) and the RMSNorm fused with its x split
// (norm_split_kernel and norm_split_partials_kernel, their norm weights). Weights are written only by uploads (copies, which order fully)
// and by the weight-tiling kernels (tile_q4_kernel, tile_q6_k_kernel), which therefore start with
// pdl_wait() alone: they never let the next kernel launch early, so a GEMV launched after one (two
// launches later) starts after it completed.
// A weight some other kernel writes (e.g. a KV tensor passed to matmul, a norm weight computed on the
// device passed to rms_norm_matmul) must be complete before the op is queued (the bindings document
// it); nothing in specd does that. test_gpu_pdl_lint.py allows the early loads in these kernels only.
//
// pdl_launch_dependents() lets the next kernel launch once every block of this one has called it
// (or exited). On HIP, in the host emulation and for code compiled for PTX older than sm_90 both are
// no-ops, and launch_kernel<K>() launches plainly (a kernel without the wait must never run early).
#pragma once

#include <cstdint>

#if !defined(SPECD_HOST_EMU)
#include "common.cuh"
#endif

namespace specd::gpu::detail {

__device__ __forceinline__ void pdl_launch_dependents() {
#if !defined(SPECD_HOST_EMU) && !SPECD_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if !defined(SPECD_HOST_EMU) && !SPECD_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// The start of a kernel: let the next kernel launch, then wait for the ones before.
__device__ __forceinline__ void pdl_enter() {
  pdl_launch_dependents();
  pdl_wait();
}
// pdl_enter() that first asks L2 for the bytes [p, p + bytes), the block's threads a 128-byte line each in
// turn: an input read right after the wait that misses L2 (a recurrent state) then comes from L2 while
// the kernels before this one drain. Safe for any memory, whoever writes it: a prefetch returns nothing
// to the thread and L2 is the GPU's point of coherence, so no value read after the wait can be stale.
__device__ __forceinline__ void pdl_enter_prefetch(const void* p, size_t bytes) {
  pdl_launch_dependents();
#if !defined(SPECD_HOST_EMU) && !SPECD_HIP && defined(__CUDA_ARCH__)
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~uintptr_t(127);  // the first line, 128-byte aligned
  const size_t span = reinterpret_cast<uintptr_t>(p) + bytes - first;
  for (size_t off = size_t(threadIdx.x) * 128; bytes > 0 && off < span; off += size_t(blockDim.x) * 128)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(first + off));
#else
  (void)p, (void)bytes;
#endif
  pdl_wait();
}

#if !defined(SPECD_HOST_EMU)
#if !SPECD_HIP
// Whether the binary running K is sm_90 code compiled from sm_90 PTX, so that it has the griddepcontrol
// instructions and the thread-block cluster code (a binary JIT-compiled for the device from older PTX has
// binaryVersion 90 but neither). Asked of K once, which also loads a lazily loaded kernel as its first launch
// would, inside a graph capture too. Throws std::runtime_error when the attributes cannot be read.
template <auto K>
bool sm90_binary(const char* name) {
  static const bool ok = [name] {
    cudaFuncAttributes a{};
    const cudaError_t e = cudaFuncGetAttributes(&a, K);
    if (e != cudaSuccess)
      throw_runtime_error(e, (std::string("cudaFuncGetAttributes of ") + name).c_str(), __FILE__, __LINE__);
    return a.ptxVersion >= 90 && a.binaryVersion >= 90;
  }();
  return ok;
}

// Whether one cluster of `blocks` blocks of K (`threads` threads and `smem` bytes of dynamic shared memory each)
// fits this device (cudaOccupancyMaxActiveClusters: a small MIG instance may fit none). A failed query counts as
// no and its error is cleared (not a failure of the next call). A driver query per call: callers keep the answer.
template <auto K>
bool cluster_fits(unsigned blocks, unsigned threads, size_t smem) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim = {blocks, 1, 1};
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  int clusters = 0;
  const cudaError_t e = cudaOccupancyMaxActiveClusters(&clusters, K, &cfg);
  if (e != cudaSuccess) (void)cudaGetLastError();
  return e == cudaSuccess && clusters > 0;
}
#endif

// K<<<grid, block, smem, s>>>(args...) in clusters of `cluster` blocks along x (1: none; more only for a K
// with sm90_binary, grid.x a multiple of it, at most the portable 8), as a programmatic dependent of the work
// before it when K's binary has the griddepcontrol instructions (sm90_binary).
// Throws std::runtime_error "... call `launch of <name>` failed ..." when the launch is refused, and
// std::invalid_argument for a cluster it may not ask for.
template <auto K, class... Args>
void launch_kernel_clustered(const char* name, dim3 grid, dim3 block, unsigned cluster, size_t smem, cudaStream_t s,
                             Args... args) {
#if SPECD_HIP
  SPECD_CHECK(cluster == 1, "launch of ", name, ": no thread-block clusters on HIP");
  K<<<grid, block, smem, s>>>(args...);
  const cudaError_t err = cudaGetLastError();
#else
  cudaLaunchAttribute attrs[2] = {};
  unsigned count = 0;
  const bool sm90 = sm90_binary<K>(name);
  if (sm90) {
    attrs[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[count++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster > 1) {
    SPECD_CHECK(sm90 && cluster <= 8 && grid.x % cluster == 0, "launch of ", name, ": a cluster of ", cluster,
                " blocks needs sm_90 code, at most 8 blocks and a grid of whole clusters (", grid.x, " blocks)");
    attrs[count].id = cudaLaunchAttributeClusterDimension;
    attrs[count++].val.clusterDim = {cluster, 1, 1};
  }
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cfg.attrs = attrs;
  cfg.numAttrs = count;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, K, args...);
  if (err != cudaSuccess) (void)cudaGetLastError();  // reported here, not by the next launch's check
#endif
  if (err != cudaSuccess) throw_runtime_error(err, (std::string("launch of ") + name).c_str(), __FILE__, __LINE__);
}

// launch_kernel_clustered without clusters: every kernel's launch.
template <auto K, class... Args>
void launch_kernel(const char* name, dim3 grid, dim3 block, size_t smem, cudaStream_t s, Args... args) {
  launch_kernel_clustered<K>(name, grid, block, 1, smem, s, args...);
}
#endif

}  // namespace specd::gpu::detail
