// Device -> device strided copies for the tensor glue ops of specd.native (slice, concat, copy,
// copy_rows in bindings/copy.cpp): one cudaMemcpy2DAsync (hipMemcpy2DAsync through portability.h)
// on the library stream, so they are ordered with the kernels and never synchronise the host.
// Exact (bytes are moved, nothing is computed), hence batch invariant. Other threads' copies wait
// while a graph capture runs (detail::EnqueueGuard). copy_many (copy_tensors): many copies in one kernel.
#include <algorithm>

#include "common.cuh"
#include "copy_many.cuh"
#include "specd/error.h"
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

namespace {

using detail::copy::blocks_per_copy;
using detail::copy::copy_many_kernel;
using detail::copy::Copies;
using detail::copy::kMaxCopies;

bool whole_words(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % 16 == 0 && bytes % 16 == 0; }

}  // namespace

void copy_many(void* const* dst, const void* const* src, const size_t* bytes, size_t count) {
  bool words = true;
  size_t most = 0;
  for (size_t i = 0; i < count; ++i) {
    words = words && whole_words(dst[i], bytes[i]) && whole_words(src[i], bytes[i]);
    most = std::max(most, bytes[i]);
  }
  detail::EnqueueGuard guard;  // as copy_2d (in place, nothing allocated): waits while another thread captures a graph
  if (!words) {  // a copy engine's copy each
    for (size_t i = 0; i < count; ++i) copy_2d(dst[i], bytes[i], src[i], bytes[i], bytes[i], 1);
    return;
  }
  if (most == 0) return;
  const int64_t per_copy = blocks_per_copy(most);
  SPECD_CHECK(per_copy * std::min<int64_t>(int64_t(count), kMaxCopies) <= 0x7fffffff,
              "copy_many: too many blocks for one launch");
  for (size_t c0 = 0; c0 < count; c0 += kMaxCopies) {
    const size_t n = std::min(count - c0, size_t(kMaxCopies));
    Copies C{};
    for (size_t i = 0; i < n; ++i) {
      C.dst[i] = static_cast<uint4*>(dst[c0 + i]), C.src[i] = static_cast<const uint4*>(src[c0 + i]);
      C.words[i] = int64_t(bytes[c0 + i] / 16);
    }
    C.blocks_per_copy = per_copy;
    detail::launch_kernel<copy_many_kernel>("copy_many_kernel", unsigned(per_copy * int64_t(n)),
                                            detail::copy::kCopyThreads, 0, detail::stream(), C);
  }
}

}  // namespace specd::gpu
