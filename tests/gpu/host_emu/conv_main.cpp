// Host emulation of the GDN conv kernels (native/src/gpu/conv.cuh): conv1d_kernel (any K) and
// conv1d_taps_kernel<4> (the register window) run on the CPU with ssm.cu's grid (blocks of kConvThreads
// channels x chunks of `chunk` tokens), each on its own copy of the state: in place (chunk >= K - 1, as the host
// asks it), or out of place into a state_out poisoned with NaN, the copy read then checked unchanged (exit 3).
// Outputs are poisoned (NaN) first. Driven by tests/gpu/test_gpu_conv_host.py.
//
// Then conv_states_kernel (conv1d_causal_states) updates two layers' states in one launch.
//
// usage: conv_emu T C K chunk silu inplace x.bin w.bin state.bin y_generic.bin state_generic.bin y_taps.bin state_taps.bin
//                 states0.bin states1.bin
//   x: F32 [T, C]; w: F32 [K, C]; state: F32 [K-1, C]; y_*: F32 [T, C], state_*: F32 [K-1, C] (written; the
//   taps kernel only runs for K = 4); states0 / states1: F32 [K-1, C], conv_states_kernel's layer 0 (x, state) and
//   layer 1 (-x, -state).
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
  if (argc != 16) {
    std::fprintf(stderr, "usage: %s T C K chunk silu inplace x w state y_generic state_generic y_taps state_taps "
                 "states0 states1\n", argv[0]);
    return 2;
  }
  const int64_t T = std::atoll(argv[1]), C = std::atoll(argv[2]), K = std::atoll(argv[3]), chunk = std::atoll(argv[4]);
  const bool silu = std::atoi(argv[5]) != 0, in_place = std::atoi(argv[6]) != 0;
  if (T < 0 || C < 1 || K < 1 || chunk < 1 || (in_place && chunk < K - 1)) return 2;
  std::vector<float> x(size_t(T * C)), w(size_t(K * C)), state(size_t((K - 1) * C));
  if (!read_file(argv[7], x) || !read_file(argv[8], w) || !read_file(argv[9], state)) {
    std::fprintf(stderr, "short input file\n");
    return 2;
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const int64_t blocks = (C + kConvThreads - 1) / kConvThreads, chunks = T > 0 ? (T + chunk - 1) / chunk : 1;
  // One kernel's run: blockIdx.y = chunk, the grid flattened chunk-major within a channel block, on its own copy of
  // the state (in place), or from a copy into a poisoned state_out, the copy checked unchanged. Writes y and the
  // state written to the two files.
  const auto run = [&](const auto& kernel, const char* y_path, const char* state_path) {
    std::vector<float> y(x.size(), nan), read = state, out = in_place ? std::vector<float>() : std::vector<float>(state.size(), nan);
    float* written = in_place ? read.data() : out.data();
    emulate(blocks * chunks, kConvThreads, [&] {
      const unsigned b = blockIdx.x;
      blockIdx.x = unsigned(b % blocks), blockIdx.y = unsigned(b / blocks);
      kernel(read.data(), written, y.data());
    });
    if (!in_place && read != state) {
      std::fprintf(stderr, "out of place: the state read was written\n");
      std::exit(3);
    }
    write_file(y_path, y), write_file(state_path, in_place ? read : out);
  };
  run([&](const float* st, float* so, float* y) { conv1d_kernel(x.data(), w.data(), st, so, y, T, C, K, chunk, silu); },
      argv[10], argv[11]);
  if (K == 4)
    run([&](const float* st, float* so, float* y) {
      conv1d_taps_kernel<4>(x.data(), w.data(), st, so, y, T, C, chunk, silu);
    }, argv[12], argv[13]);
  else
    write_file(argv[12], std::vector<float>(x.size(), nan)), write_file(argv[13], std::vector<float>(state.size(), nan));
  // conv_states_kernel (conv1d_causal_states) on two layers in one launch, in place: layer 0 (x, state), layer 1
  // (-x, -state), so its new state is layer 0's negated.
  std::vector<float> nx(x.size()), s0 = state, s1(state.size());
  for (size_t i = 0; i < x.size(); ++i) nx[i] = -x[i];
  for (size_t i = 0; i < state.size(); ++i) s1[i] = -state[i];
  ConvStates S{};
  S.x[0] = x.data(), S.x[1] = nx.data(), S.state[0] = s0.data(), S.state[1] = s1.data();
  S.T = T, S.C = C, S.km1 = K - 1, S.blocks_per_layer = blocks;
  emulate(2 * blocks, kConvThreads, [&] { conv_states_kernel(S); });
  write_file(argv[14], s0), write_file(argv[15], s1);
  std::printf("blocks=%lld chunks=%lld\n", (long long)blocks, (long long)chunks);
  return 0;
}
