// Host emulation of the GDN conv kernels (native/src/gpu/conv.cuh): conv1d_kernel (any K) and
// conv1d_taps_kernel<4> (the register window) run on the CPU with ssm.cu's grid (blocks of kConvThreads
// channels x chunks of `chunk` tokens), each on its own copy of the state: in place, or with chunk < K - 1 (which the
// host asks only out of place) from the state into a state_out poisoned with NaN. Outputs are poisoned (NaN) first.
// Driven by tests/gpu/test_gpu_conv_host.py.
//
// usage: conv_emu T C K chunk silu x.bin w.bin state.bin y_generic.bin state_generic.bin y_taps.bin state_taps.bin
//   (chunk < K - 1: out of place)
//   x: F32 [T, C]; w: F32 [K, C]; state: F32 [K-1, C]; y_*: F32 [T, C], state_*: F32 [K-1, C] (written; the
//   taps kernel only runs for K = 4).
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <vector>

#include "warp_emu.h"
#include "conv.cuh"

using namespace specd::gpu::detail::conv;

static void write_file(const char* path, const std::vector<float>& v) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(v.data()),
                                              std::streamsize(v.size() * sizeof(float)));
}

int main(int argc, char** argv) {
  if (argc != 13) {
    std::fprintf(stderr, "usage: %s T C K chunk silu x w state y_generic state_generic y_taps state_taps\n", argv[0]);
    return 2;
  }
  const int64_t T = std::atoll(argv[1]), C = std::atoll(argv[2]), K = std::atoll(argv[3]), chunk = std::atoll(argv[4]);
  const bool silu = std::atoi(argv[5]) != 0;
  if (T < 0 || C < 1 || K < 1 || chunk < 1) return 2;
  const bool in_place = chunk >= K - 1;
  std::vector<float> x(size_t(T * C)), w(size_t(K * C)), state(size_t((K - 1) * C));
  if (!read_file(argv[6], x) || !read_file(argv[7], w) || !read_file(argv[8], state)) {
    std::fprintf(stderr, "short input file\n");
    return 2;
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const int64_t blocks = (C + kConvThreads - 1) / kConvThreads, chunks = T > 0 ? (T + chunk - 1) / chunk : 1;
  // blockIdx.y = chunk: the grid flattened, chunk-major within a channel block, blockIdx.x the channel block
  const auto grid = [&](const auto& kernel) {
    emulate(blocks * chunks, kConvThreads, [&] {
      const unsigned b = blockIdx.x;
      blockIdx.x = unsigned(b % blocks), blockIdx.y = unsigned(b / blocks);
      kernel();
    });
  };
  // The state each kernel reads (its own copy) and the one it writes (that copy in place, else a poisoned buffer).
  std::vector<float> y1(x.size(), nan), r1 = state, s1 = in_place ? state : std::vector<float>(state.size(), nan);
  float* o1 = in_place ? r1.data() : s1.data();
  grid([&] { conv1d_kernel(x.data(), w.data(), r1.data(), o1, y1.data(), T, C, K, chunk, silu); });
  write_file(argv[9], y1), write_file(argv[10], in_place ? r1 : s1);
  std::vector<float> y2(x.size(), nan), r2 = state, s2 = in_place ? state : std::vector<float>(state.size(), nan);
  float* o2 = in_place ? r2.data() : s2.data();
  if (K == 4)
    grid([&] { conv1d_taps_kernel<4>(x.data(), w.data(), r2.data(), o2, y2.data(), T, C, chunk, silu); });
  write_file(argv[11], y2), write_file(argv[12], in_place ? r2 : s2);
  std::printf("blocks=%lld chunks=%lld\n", (long long)blocks, (long long)chunks);
  return 0;
}
