// Internal helpers shared by the GPU backend's .cu files (not part of the library interface).
#pragma once
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>

#include "portability.h"
#include "warp_reduce.cuh"  // warp_sum, warp_max, warp_min
#include "specd/error.h"
#include "specd/tensor.h"

namespace specd::gpu::detail {

// Throws std::runtime_error "<backend> call `<call>` failed at <file>:<line>: <error string>".
[[noreturn]] void throw_runtime_error(cudaError_t err, const char* call, const char* file, int line);

// The library's stream: one non-blocking stream on the device current at first use. Every kernel
// and copy of the backend is enqueued on it, so work is ordered without extra synchronisation.
// Throws std::runtime_error when no device is available.
cudaStream_t stream();

// Multiprocessor count of the library's device (cached).
int sm_count();

// Most dynamic shared memory one block of the library's device may use once its kernel raised the
// limit (cudaFuncAttributeMaxDynamicSharedMemorySize; sharedMemPerBlockOptin, cached).
int max_smem_optin();

// Compute capability major of the library's device (cached; 8+ has mma.sync f16, ldmatrix, cp.async).
int compute_major();

// The graph-capture lock (runtime.cu; recursive, never destroyed).
std::recursive_mutex& capture_mu();

// Held while a non-allocating op enqueues in-place work on the library stream (copy_2d,
// memset_zero, kv_write): waits while another thread captures a graph (its work would be recorded
// into that graph) and keeps capture_mu() held until the destructor, so no capture can begin before
// the work is enqueued. The capturing thread passes at once (its work is recorded, as intended).
class EnqueueGuard {
 public:
  EnqueueGuard();
  ~EnqueueGuard();
  EnqueueGuard(const EnqueueGuard&) = delete;
  EnqueueGuard& operator=(const EnqueueGuard&) = delete;

 private:
  std::unique_lock<std::recursive_mutex> lock_;
};

}  // namespace specd::gpu::detail

// Checks a runtime call; on failure throws std::runtime_error naming the call, file:line and the
// runtime's error string.
#define SPECD_GPU_CHECK(call)                                                             \
  do {                                                                                    \
    cudaError_t specd_err_ = (call);                                                      \
    if (specd_err_ != cudaSuccess)                                                        \
      ::specd::gpu::detail::throw_runtime_error(specd_err_, #call, __FILE__, __LINE__);   \
  } while (0)

namespace specd::gpu::detail {

// Input checks shared by the ops (std::invalid_argument, like the CPU ops).
inline void check_gpu(const Tensor& t, const char* op, const char* arg) {
  SPECD_CHECK(t.device == Device::GPU, op, ": ", arg, " must be on the GPU");
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace specd::gpu::detail

#include "pdl.cuh"  // launch_kernel and the kernels' pdl_enter (after the helpers above, which it uses)
