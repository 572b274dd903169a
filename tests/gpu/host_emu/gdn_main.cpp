// Host emulation of the chunked Gated DeltaNet recurrence (native/src/gpu/gdn_chunked.cuh):
// gdn_chunk_prep_kernel and gdn_chunk_state_kernel run on the CPU, one std::thread per thread of a block
// (warp_emu.h: __syncthreads a block barrier, the dynamic shared memory a poisoned buffer), with ssm.cu's
// launch (prep: one block per (value head, chunk of 64 tokens); state: one block per (value head, 16 state
// rows)). The scratch and the output are poisoned (NaN) first, so a value the kernels should have written
// and did not shows. Built with -DSPECD_HIP=1 it runs the HIP build's state kernel (FP32 FMAs) instead of the
// CUDA build's (tensor cores). Driven by tests/gpu/test_gpu_gdn_chunked_host.py.
//
// usage: gdn_emu DK T hk hv dv scale q.bin k.bin v.bin g.bin beta.bin state.bin out.bin state_out.bin
//   q, k: F32 [T, hk, DK]; v: F32 [T, hv, dv]; g, beta: F32 [T, hv]; state: F32 [hv, dv, DK];
//   out: F32 [T, hv, dv] and state_out: F32 [hv, dv, DK] (written).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "warp_emu.h"
#include "gdn_chunked.cuh"

using namespace specd::gpu::detail::gdn;

template <int DK>
int run(int argc, char** argv) {
  const int64_t T = std::atoll(argv[2]);
  const int hk = std::atoi(argv[3]), hv = std::atoi(argv[4]), dv = std::atoi(argv[5]);
  if (T < 1 || hk < 1 || hv % hk != 0 || dv % kGdnChunkRows != 0) return 2;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> q(size_t(T * hk * DK)), k(q.size()), v(size_t(T * hv * dv)), g(size_t(T * hv)), beta(g.size()),
      state(size_t(hv) * dv * DK), out(v.size(), nan), state_out(state.size(), nan);
  if (!read_file(argv[7], q) || !read_file(argv[8], k) || !read_file(argv[9], v) || !read_file(argv[10], g) ||
      !read_file(argv[11], beta) || !read_file(argv[12], state)) {
    std::fprintf(stderr, "short input file\n");
    return 2;
  }
  Params P{q.data(), k.data(), v.data(), g.data(), beta.data(), state.data(), state_out.data(), nullptr,
           std::strtof(argv[6], nullptr), T, hk, hv, DK, dv, out.data()};
  const int chunks = int((T + kGdnChunk - 1) / kGdnChunk);
  std::vector<float> scratch(size_t(hv) * (T * (dv + DK + 1) + int64_t(chunks) * kGdnChunk * kGdnChunk), nan);
  GdnChunkScratch X{};
  X.U = scratch.data();
  X.W = X.U + int64_t(hv) * T * dv;
  X.P = X.W + int64_t(hv) * T * DK;  // ssm.cu's order: G (any length) last
  X.G = X.P + int64_t(hv) * chunks * kGdnChunk * kGdnChunk;
  X.chunks = chunks;
  std::vector<float> smem;
  auto poison = [&](size_t bytes) {
    smem.assign(bytes / sizeof(float), nan);
    specd_emu_dyn_smem = reinterpret_cast<uint8_t*>(smem.data());
  };
  const size_t prep = gdn_prep_smem(DK, dv), st = gdn_state_smem(DK);
  emulate(int64_t(chunks) * hv, kGdnChunkThreads, [&] { gdn_chunk_prep_kernel<DK>(P, X); },
          [&](int64_t) { poison(prep); });
  emulate(int64_t(hv) * (dv / kGdnChunkRows), kGdnChunkThreads, [&] { gdn_chunk_state_kernel<DK>(P, X); },
          [&](int64_t) { poison(st); });
  std::ofstream(argv[13], std::ios::binary).write(reinterpret_cast<const char*>(out.data()),
                                                   std::streamsize(out.size() * sizeof(float)));
  std::ofstream(argv[14], std::ios::binary).write(reinterpret_cast<const char*>(state_out.data()),
                                                   std::streamsize(state_out.size() * sizeof(float)));
  std::printf("chunks=%d prep_blocks=%lld state_blocks=%d\n", chunks, (long long)chunks * hv,
              hv * (dv / kGdnChunkRows));
  return 0;
}

int main(int argc, char** argv) {
  if (argc != 15) {
    std::fprintf(stderr, "usage: %s DK T hk hv dv scale q k v g beta state out state_out\n", argv[0]);
    return 2;
  }
  switch (std::atoi(argv[1])) {
    case 32: return run<32>(argc, argv);
    case 64: return run<64>(argc, argv);
    case 128: return run<128>(argc, argv);
    default: return 2;
  }
}
