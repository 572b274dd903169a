// copy_many's kernel (copy.cu: specd.native copy_tensors on the GPU) and its launch plan; a header so that the
// emulation harness tests/gpu/host_emu/copy_main.cpp compiles them for the CPU.
#pragma once

#ifndef SPECD_HOST_EMU
#include "common.cuh"
#endif

#include <cstddef>
#include <cstdint>

#include "pdl.cuh"

namespace specd::gpu::detail::copy {
namespace {  // internal linkage: copy_many_kernel is not a template, and only copy.cu launches it

// Up to kMaxCopies copies of whole 16-byte words a launch, blocks_per_copy blocks each. Pointers in the kernel
// parameters (1.5 KiB): a captured graph keeps them, nothing is uploaded.
constexpr int kMaxCopies = 64, kCopyThreads = 256;
struct Copies {
  uint4* dst[kMaxCopies];
  const uint4* src[kMaxCopies];
  int64_t words[kMaxCopies];
  int64_t blocks_per_copy;
};
static_assert(sizeof(Copies) <= 4096, "Copies: kernel parameters within 4 KiB (HIP's limit)");

// Blocks a copy for copies of at most `most` bytes: enough that a thread moves ~4 words of the largest (the 27B's
// 3 MiB GDN states: 192 blocks each).
inline int64_t blocks_per_copy(size_t most) {
  const int64_t words = int64_t(most / 16), per_block = 4 * kCopyThreads;
  return words > per_block ? (words + per_block - 1) / per_block : 1;
}

// Block b: copy b / blocks_per_copy, its words strided over that copy's blocks' threads.
__global__ void __launch_bounds__(kCopyThreads) copy_many_kernel(const Copies C) {
  pdl_enter();
  const int64_t i = int64_t(blockIdx.x) / C.blocks_per_copy, b = int64_t(blockIdx.x) % C.blocks_per_copy;
  const uint4* __restrict__ src = C.src[i];
  uint4* __restrict__ dst = C.dst[i];
  for (int64_t e = b * kCopyThreads + threadIdx.x; e < C.words[i]; e += C.blocks_per_copy * kCopyThreads)
    dst[e] = src[e];
}

}  // namespace
}  // namespace specd::gpu::detail::copy
