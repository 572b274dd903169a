// Host emulation of copy_many_kernel (native/src/gpu/copy_many.cuh: specd.native copy_tensors on the GPU) with
// copy.cu's launch plan (plan_copies: kMaxCopies a launch, each copy over its own blocks). Every source word holds
// its own index and copy number; every destination is poisoned and followed by a guard word. Checks that each
// destination equals its source and that no guard changed; prints "launches=L blocks=B" (B of all launches) and
// exits 0, or names the first wrong word and exits 1. Driven by tests/gpu/test_gpu_glue.py.
//
// usage: copy_emu WORDS [WORDS ...]   (each copy's size in 16-byte words)
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
  const uint4 poison{0xdeadbeefu, 0xdeadbeefu, 0xdeadbeefu, 0xdeadbeefu};
  std::vector<std::vector<uint4>> src(count), dst(count);
  std::vector<uint4*> d(count);
  std::vector<const uint4*> s(count);
  std::vector<int64_t> words(count);
  for (size_t i = 0; i < count; ++i) {
    words[i] = std::atoll(argv[i + 1]);
    if (words[i] < 0) return 2;
    for (int64_t e = 0; e < words[i]; ++e) src[i].push_back(uint4{uint32_t(e), uint32_t(i), 0x5eedu, ~uint32_t(e)});
    dst[i].assign(size_t(words[i]) + 1, poison);  // + a guard word
    d[i] = dst[i].data(), s[i] = src[i].data();
  }
  if (!copies_fit(words.data(), count)) return 2;
  int launches = 0;
  int64_t total = 0;
  plan_copies(d.data(), s.data(), words.data(), count, [&](const Copies& C, int32_t blocks) {
    emulate(blocks, kCopyThreads, [&] { copy_many_kernel(C); });
    ++launches, total += blocks;
  });
  for (size_t i = 0; i < count; ++i)
    for (size_t e = 0; e < dst[i].size(); ++e) {
      const uint4 want = e < src[i].size() ? src[i][e] : poison, got = dst[i][e];
      if (got.x != want.x || got.y != want.y || got.z != want.z || got.w != want.w) {
        std::printf("copy %zu word %zu: %08x %08x, want %08x %08x\n", i, e, got.x, got.y, want.x, want.y);
        return 1;
      }
    }
  std::printf("launches=%d blocks=%lld\n", launches, (long long)total);
  return 0;
}
