// Device -> device strided copies for the tensor glue ops of specd.native (slice, concat, copy,
// copy_rows in bindings/copy.cpp): one cudaMemcpy2DAsync (hipMemcpy2DAsync through portability.h)
// on the library stream, so they are ordered with the kernels and never synchronise the host.
// Exact (bytes are moved, nothing is computed), hence batch invariant. Other threads' copies wait
// while a graph capture runs (detail::EnqueueGuard).
#include "common.cuh"
#include "specd/gpu.h"

namespace specd::gpu {

void copy_2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height) {
  if (width == 0 || height == 0) return;
  detail::EnqueueGuard guard;  // in place: waits while another thread captures a graph
  if (height == 1) {
    SPECD_GPU_CHECK(cudaMemcpyAsync(dst, src, width, cudaMemcpyDeviceToDevice, detail::stream()));
    return;
  }
  SPECD_GPU_CHECK(
      cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, cudaMemcpyDeviceToDevice, detail::stream()));
}

}  // namespace specd::gpu
