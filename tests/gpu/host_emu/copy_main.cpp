// Host emulation of copy_many_kernel (native/src/gpu/copy_many.cuh: specd.native copy_tensors on the GPU) with
// copy.cu's launches: copies of the given word counts (16-byte words), kMaxCopies a launch, each launch
// blocks_per_copy(largest copy's bytes) blocks a copy. Every source word holds its own index and copy number; every
// destination is poisoned and followed by a guard word. Checks that each destination equals its source and no
// guard changed; prints "blocks_per_copy=N launches=L" and exits 0, or names the first wrong word and exits 1.
// Driven by tests/gpu/test_gpu_glue.py.
//
// usage: copy_emu WORDS [WORDS ...]   (each copy's size in 16-byte words)
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "warp_emu.h"
#include "copy_many.cuh"

using namespace specd::gpu::detail::copy;

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s WORDS [WORDS ...]\n", argv[0]);
    return 2;
  }
  const size_t count = size_t(argc - 1);
  std::vector<std::vector<uint4>> src(count), dst(count);
  size_t most = 0;
  for (size_t i = 0; i < count; ++i) {
    const int64_t words = std::atoll(argv[i + 1]);
    if (words < 0) return 2;
    for (int64_t e = 0; e < words; ++e) src[i].push_back(uint4{uint32_t(e), uint32_t(i), 0x5eedu, ~uint32_t(e)});
    dst[i].assign(size_t(words) + 1, uint4{0xdeadbeefu, 0xdeadbeefu, 0xdeadbeefu, 0xdeadbeefu});  // + guard word
    most = std::max(most, size_t(words) * 16);
  }
  const int64_t per_copy = blocks_per_copy(most);
  int launches = 0;
  for (size_t c0 = 0; c0 < count; c0 += kMaxCopies, ++launches) {  // copy.cu's copy_many
    const size_t n = std::min(count - c0, size_t(kMaxCopies));
    Copies C{};
    for (size_t i = 0; i < n; ++i)
      C.dst[i] = dst[c0 + i].data(), C.src[i] = src[c0 + i].data(), C.words[i] = int64_t(src[c0 + i].size());
    C.blocks_per_copy = per_copy;
    emulate(per_copy * int64_t(n), kCopyThreads, [&] { copy_many_kernel(C); });
  }
  for (size_t i = 0; i < count; ++i)
    for (size_t e = 0; e < dst[i].size(); ++e) {
      const uint4 want = e < src[i].size() ? src[i][e] : uint4{0xdeadbeefu, 0xdeadbeefu, 0xdeadbeefu, 0xdeadbeefu};
      const uint4 got = dst[i][e];
      if (got.x != want.x || got.y != want.y || got.z != want.z || got.w != want.w) {
        std::printf("copy %zu word %zu: %08x %08x, want %08x %08x\n", i, e, got.x, got.y, want.x, want.y);
        return 1;
      }
    }
  std::printf("blocks_per_copy=%lld launches=%d\n", (long long)per_copy, launches);
  return 0;
}
