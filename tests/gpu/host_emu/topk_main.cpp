// Host emulation of the row-wise top-k (native/src/gpu/topk.cuh): chunk_max_kernel + select_kernel (the
// split path) or rounds_kernel run on the CPU, one std::thread per lane (warp_emu.h), with topk.cu's launch
// (the path and chunking from plan(V, k)). The outputs are poisoned first, so an entry never written shows.
// Driven by tests/gpu/test_gpu_topk_host.py.
//
// usage: topk_emu n V k mode x.bin vals.bin idx.bin
//   mode 0: topk.cu's path; mode 1: rounds_kernel whatever the plan says.
//   x: F32 [n, V]; vals: F32 [n, k] and idx: I32 [n, k] (written). Prints "split=S lg=L chunks=C".
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <vector>

#include "warp_emu.h"
#include "topk.cuh"

using namespace specd::gpu::detail;

int main(int argc, char** argv) {
  if (argc != 8) {
    std::fprintf(stderr, "usage: %s n V k mode x vals idx\n", argv[0]);
    return 2;
  }
  const int64_t n = std::atoll(argv[1]), V = std::atoll(argv[2]), k = std::atoll(argv[3]);
  const int mode = std::atoi(argv[4]);
  if (n < 1 || V < 1 || V > INT32_MAX || k < 1 || k > V) return 2;
  std::vector<float> x(size_t(n * V));
  if (!read_file(argv[5], x)) {
    std::fprintf(stderr, "short input file\n");
    return 2;
  }
  std::vector<float> vals(size_t(n * k), __uint_as_float(0x7fbad000u));  // a NaN no input holds
  std::vector<int32_t> idx(size_t(n * k), -7);
  const topk::Plan p = topk::plan(V, k);
  if (p.split && mode == 0) {
    std::vector<uint64_t> maxk(size_t(n * p.chunks), 0x5a5a5a5a5a5a5a5aull);
    emulate(n * p.chunks, topk::kMaxThreads, [&] { topk::chunk_max_kernel(x.data(), V, p.chunks, p.lg, maxk.data()); });
    emulate(n, topk::kSelThreads, [&] {
      topk::select_kernel(x.data(), V, k, p.chunks, p.lg, maxk.data(), vals.data(), idx.data());
    });
  } else {
    emulate(n, topk::kRoundThreads, [&] { topk::rounds_kernel(x.data(), V, k, vals.data(), idx.data()); });
  }
  std::printf("split=%d lg=%d chunks=%lld\n", int(p.split), p.lg, (long long)p.chunks);
  std::ofstream(argv[6], std::ios::binary).write(reinterpret_cast<const char*>(vals.data()),
                                                 std::streamsize(vals.size() * sizeof(float)));
  std::ofstream(argv[7], std::ios::binary).write(reinterpret_cast<const char*>(idx.data()),
                                                 std::streamsize(idx.size() * sizeof(int32_t)));
  return 0;
}
