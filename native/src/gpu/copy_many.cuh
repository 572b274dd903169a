// copy_many's kernel (copy.cu: specd.native copy_tensors on the GPU) and its launch plan; a header so that the
// emulation harness tests/gpu/host_emu/copy_main.cpp compiles and runs both on the CPU.
#pragma once

#ifndef SPECD_HOST_EMU
#include "common.cuh"
#endif

#include <cstddef>
#include <cstdint>

#include "pdl.cuh"

namespace specd::gpu::detail::copy {
namespace {  // internal linkage: copy_many_kernel is not a template, and only copy.cu launches it

// Up to kMaxCopies copies of whole 16-byte words a launch (the 27B's commit: 96, its 48 GDN states and 48 conv
// states), each over its own blocks: copy i owns blocks [first[i], first[i + 1]), about 4 words a thread. Pointers
// and counts in the kernel parameters (3 KiB): a captured graph keeps them, nothing is uploaded.
constexpr int kMaxCopies = 128, kCopyThreads = 256, kWordsPerBlock = 4 * kCopyThreads;
struct Copies {
  uint4* dst[kMaxCopies];
  const uint4* src[kMaxCopies];
  int32_t words[kMaxCopies];
  int32_t first[kMaxCopies + 1];  // first[count]: the launch's blocks
  int32_t count;
};
static_assert(sizeof(Copies) <= 4096, "Copies: kernel parameters within 4 KiB (HIP's limit)");

// Block b: of the last copy whose first block is <= b (an empty copy owns no block), its words strided over that
// copy's blocks' threads.
__global__ void __launch_bounds__(kCopyThreads) copy_many_kernel(const Copies C) {
  pdl_enter();
  const int32_t b = int32_t(blockIdx.x);
  int lo = 0, hi = C.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (C.first[mid] <= b) lo = mid;
    else hi = mid - 1;
  }
  const int64_t blocks = C.first[lo + 1] - C.first[lo];
  const uint4* __restrict__ src = C.src[lo];
  uint4* __restrict__ dst = C.dst[lo];
  for (int64_t e = int64_t(b - C.first[lo]) * kCopyThreads + threadIdx.x; e < C.words[lo]; e += blocks * kCopyThreads)
    dst[e] = src[e];
}

// Copy i's blocks (none for an empty copy).
inline int64_t copy_blocks(int64_t words) { return (words + kWordsPerBlock - 1) / kWordsPerBlock; }

// Whether copies of these word counts fit the launches (each under 2^31 words, each launch under 2^31 blocks):
// checked before anything is enqueued.
inline bool copies_fit(const int64_t* words, size_t count) {
  for (size_t c0 = 0; c0 < count; c0 += kMaxCopies) {
    int64_t blocks = 0;
    for (size_t i = c0; i < count && i < c0 + kMaxCopies; ++i) {
      if (words[i] < 0 || words[i] > 0x7fffffff) return false;
      blocks += copy_blocks(words[i]);
    }
    if (blocks > 0x7fffffff) return false;
  }
  return true;
}

// copy.cu's launches of copies [0, count) (words[i] 16-byte words from src[i] to dst[i], copies_fit): up to
// kMaxCopies a launch, launch(C, blocks) for each one with blocks.
template <class Launch>
void plan_copies(uint4* const* dst, const uint4* const* src, const int64_t* words, size_t count, const Launch& launch) {
  for (size_t c0 = 0; c0 < count; c0 += kMaxCopies) {
    Copies C{};
    C.count = int32_t(count - c0 < size_t(kMaxCopies) ? count - c0 : size_t(kMaxCopies));
    for (int i = 0; i < C.count; ++i) {
      C.dst[i] = dst[c0 + i], C.src[i] = src[c0 + i], C.words[i] = int32_t(words[c0 + i]);
      C.first[i + 1] = C.first[i] + int32_t(copy_blocks(words[c0 + i]));
    }
    if (C.first[C.count] > 0) launch(C, C.first[C.count]);
  }
}

}  // namespace
}  // namespace specd::gpu::detail::copy
