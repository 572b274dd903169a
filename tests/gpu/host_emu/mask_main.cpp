// Host emulation of the mask compaction (native/src/gpu/attention_mask.cuh): attn_mask_count_kernel and
// attn_mask_compact_kernel run on the CPU, one std::thread per lane (warp_emu.h), with attention.cu's
// launch (one block per (row, segment); pass 1 only when a row has more than one segment). idx and the
// segment counts are poisoned first, so an entry written past a row's count, or a count pass 2 reads
// and pass 1 did not write, shows. Driven by tests/gpu/test_gpu_mask_compact_host.py.
//
// usage: mask_emu n kv_len window causal pos.bin mask.bin idx.bin cnt.bin
//   pos: I32 [n]; mask: I32 [n, kv_len]; idx: I32 [n, kv_len] and cnt: I32 [n] (written).
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <vector>

#include "warp_emu.h"
#include "attention_mask.cuh"

using namespace specd::gpu::detail;

int main(int argc, char** argv) {
  if (argc != 9) {
    std::fprintf(stderr, "usage: %s n kv_len window causal pos mask idx cnt\n", argv[0]);
    return 2;
  }
  const int64_t n = std::atoll(argv[1]), kv_len = std::atoll(argv[2]), window = std::atoll(argv[3]);
  if (n < 1 || kv_len < 1) return 2;
  std::vector<int32_t> pos(static_cast<size_t>(n)), m(size_t(n * kv_len));
  if (!read_file(argv[5], pos) || !read_file(argv[6], m)) {
    std::fprintf(stderr, "short input file\n");
    return 2;
  }
  constexpr int32_t kPoison = -7;
  mask::Params P{};
  P.nseg = mask::segments(kv_len);
  std::vector<int32_t> idx(size_t(n * kv_len), kPoison), cnt(size_t(n), kPoison), seg(size_t(n * P.nseg), kPoison);
  P.mask = m.data();
  P.q_pos = pos.data();
  P.kv_len = kv_len;
  P.window = window;
  P.causal = std::atoi(argv[4]);
  P.idx = idx.data();
  P.cnt = cnt.data();
  const int64_t blocks = n * P.nseg;
  if (P.nseg > 1) {
    P.seg = seg.data();
    emulate(blocks, mask::kThreads, [&] { mask::attn_mask_count_kernel(P); });
  }
  emulate(blocks, mask::kThreads, [&] { mask::attn_mask_compact_kernel(P); });
  std::printf("nseg=%d blocks=%lld\n", P.nseg, (long long)blocks);
  std::ofstream(argv[7], std::ios::binary).write(reinterpret_cast<const char*>(idx.data()),
                                                 std::streamsize(idx.size() * sizeof(int32_t)));
  std::ofstream(argv[8], std::ios::binary).write(reinterpret_cast<const char*>(cnt.data()),
                                                 std::streamsize(cnt.size() * sizeof(int32_t)));
  return 0;
}
