// Host emulation of DFlash 2's grouped dynamic conv kernel (native/src/gpu/dynamic_conv.cuh):
// grouped_dynamic_conv_kernel runs on the CPU with dynamic_conv.cu's grid (the [L, H] outputs flattened over
// blocks of kThreads) and its arguments (dyn offset to `side`, row pitch S * taps * G). The output is poisoned
// (NaN) first. Driven by tests/gpu/test_gpu_dynamic_conv_host.py.
//
// usage: dynamic_conv_emu L H taps G S side y.bin dyn.bin base.bin out.bin
//   y: F32 [L, H]; dyn: F32 [L, S, taps, G]; base: F32 [taps, H]; out: F32 [L, H] (written).
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <vector>

#include "warp_emu.h"
#include "dynamic_conv.cuh"

using namespace specd::gpu::detail::dynamic_conv;

int main(int argc, char** argv) {
  if (argc != 11) {
    std::fprintf(stderr, "usage: %s L H taps G S side y dyn base out\n", argv[0]);
    return 2;
  }
  const int L = std::atoi(argv[1]), H = std::atoi(argv[2]), taps = std::atoi(argv[3]), G = std::atoi(argv[4]),
            S = std::atoi(argv[5]), side = std::atoi(argv[6]);
  if (L < 0 || H < 1 || taps < 1 || G < 1 || H % G || S < 1 || side < 0 || side >= S) return 2;
  std::vector<float> y(size_t(L) * H), dyn(size_t(L) * S * taps * G), base(size_t(taps) * H);
  if (!read_file(argv[7], y) || !read_file(argv[8], dyn) || !read_file(argv[9], base)) {
    std::fprintf(stderr, "short input file\n");
    return 2;
  }
  std::vector<float> out(y.size(), std::numeric_limits<float>::quiet_NaN());
  const int64_t n = int64_t(L) * H, blocks = (n + kThreads - 1) / kThreads;
  emulate(blocks, kThreads, [&] {
    grouped_dynamic_conv_kernel(y.data(), dyn.data() + side * taps * G, base.data(), out.data(), L, H, taps, G,
                                H / G, S * taps * G);
  });
  std::ofstream(argv[10], std::ios::binary)
      .write(reinterpret_cast<const char*>(out.data()), std::streamsize(out.size() * sizeof(float)));
  std::printf("blocks=%lld\n", (long long)blocks);
  return 0;
}
