// Device -> device strided copies for the tensor glue ops of specd.native (slice, concat, copy,
// copy_rows in bindings/copy.cpp): one cudaMemcpy2DAsync (hipMemcpy2DAsync through portability.h)
// on the library stream, so they are ordered with the kernels and never synchronise the host.
// Exact (bytes are moved, nothing is computed), hence batch invariant. Other threads' copies wait
// while a graph capture runs (detail::EnqueueGuard). copy_many (copy_tensors): many copies in one kernel.
#include <algorithm>

#include "common.cuh"
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

// copy_many's kernel: up to kMaxCopies copies of whole 16-byte words, blocks_per_copy blocks each (block b: copy
// b / blocks_per_copy), their words strided over those blocks' threads. Pointers in the kernel parameters
// (1.5 KiB): a captured graph keeps them, nothing is uploaded.
constexpr int kMaxCopies = 64, kCopyThreads = 256;
struct Copies {
  uint4* dst[kMaxCopies];
  const uint4* src[kMaxCopies];
  int64_t words[kMaxCopies];
  int64_t blocks_per_copy;
};

__global__ void __launch_bounds__(kCopyThreads) copy_many_kernel(const Copies C) {
  detail::pdl_enter();
  const int64_t i = int64_t(blockIdx.x) / C.blocks_per_copy, b = int64_t(blockIdx.x) % C.blocks_per_copy;
  const uint4* __restrict__ src = C.src[i];
  uint4* __restrict__ dst = C.dst[i];
  for (int64_t e = b * kCopyThreads + threadIdx.x; e < C.words[i]; e += C.blocks_per_copy * kCopyThreads)
    dst[e] = src[e];
}

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
  // Each copy's words over enough blocks that a thread moves ~4 of them (the 27B's 3 MiB GDN states: 192 blocks).
  const int64_t per_copy = std::max<int64_t>(1, int64_t(most / 16 + 4 * kCopyThreads - 1) / (4 * kCopyThreads));
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
    detail::launch_kernel<copy_many_kernel>("copy_many_kernel", unsigned(per_copy * int64_t(n)), kCopyThreads, 0,
                                            detail::stream(), C);
  }
}

}  // namespace specd::gpu
