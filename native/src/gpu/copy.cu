// Device -> device strided copies for the tensor glue ops of specd.native (slice, concat, copy,
// copy_rows in bindings/copy.cpp): one cudaMemcpy2DAsync (hipMemcpy2DAsync through portability.h)
// on the library stream, so they are ordered with the kernels and never synchronise the host.
// Exact (bytes are moved, nothing is computed), hence batch invariant. Other threads' copies wait
// while a graph capture runs (detail::EnqueueGuard). copy_many (copy_tensors): many copies in one kernel.
#include <vector>

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

void copy_many(void* const* dst, const void* const* src, const size_t* bytes, size_t count) {
  // Whole 16-byte words go to the kernel, any other copy to a copy engine (copy_2d).
  std::vector<uint4*> d;
  std::vector<const uint4*> s;
  std::vector<int64_t> words;
  std::vector<size_t> others;
  for (size_t i = 0; i < count; ++i) {
    if (!detail::aligned16(dst[i]) || !detail::aligned16(src[i]) || bytes[i] % 16 != 0) {
      others.push_back(i);
      continue;
    }
    d.push_back(static_cast<uint4*>(dst[i])), s.push_back(static_cast<const uint4*>(src[i]));
    words.push_back(int64_t(bytes[i] / 16));
  }
  SPECD_CHECK(detail::copy::copies_fit(words.data(), words.size()), "copy_many: too many words for one launch");
  detail::EnqueueGuard guard;  // as copy_2d (in place, nothing allocated): waits while another thread captures a graph
  for (size_t i : others) copy_2d(dst[i], bytes[i], src[i], bytes[i], bytes[i], 1);
  using detail::copy::Copies;
  detail::copy::plan_copies(d.data(), s.data(), words.data(), d.size(), [](const Copies& C, int32_t blocks) {
    detail::launch_kernel<detail::copy::copy_many_kernel>("copy_many_kernel", unsigned(blocks),
                                                          detail::copy::kCopyThreads, 0, detail::stream(), C);
  });
}

}  // namespace specd::gpu
