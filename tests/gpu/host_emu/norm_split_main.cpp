// Host emulation of norm_split_kernel (native/src/gpu/norm_split.cuh: RMSNorm fused with the tensor-core
// GEMV's x split, rms_norm_matmul's kernel) and of the composition it replaces on the GPU: the
// standalone norm kernel's row code (norm.cuh: norm_row, with its block size threads_for(d / 4)) writing
// u = rms_norm(h), then split_x_kernel (matmul_mma.cuh) of u, as mma::launch_split_x launches it. Every
// output buffer starts poisoned (split bytes 0xA5, floats NaN), so a value one side writes and the other
// does not shows. Driven by tests/gpu/test_gpu_norm_split_host.py.
//
// usage: norm_split_emu n d RESID WEIGHTED STAGED eps x.bin r.bin w.bin h.bin split.bin h_ref.bin split_ref.bin
//        recon.bin
//   STAGED: the kernel keeps the row in (poisoned) dynamic shared memory (d <= kMaxStagedFloats, as
//   matmul.cu launches it) or re-reads it from global memory; x, r: F32 [n, d] (r read when RESID);
//   w: F32 [d] (read when WEIGHTED); h, h_ref: F32 [n, d] (x + r,
//   written only with RESID); split, split_ref: the mma::XSizes(d) bytes of the fused kernel and of the
//   composition; recon: F32 [n, d], the values the fused split encodes (the sum of each input's terms
//   times their column scales, in double).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <vector>

#include "warp_emu.h"
#include "norm_split.cuh"

using namespace specd::gpu::detail;

template <class T>
void write_file(const char* path, const std::vector<T>& v) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(v.data()),
                                              std::streamsize(v.size() * sizeof(T)));
}

// The inputs of rows 0 .. n - 1 that the split at `base` encodes (matmul_mma.cuh, split_group's layout:
// row r's term tau is column 3 r + tau of n8 tile c / 8; lane 4 (c % 8) + t of sub-block blk holds the
// bytes of inputs 4t, 16 + 4t, 4t + 1, 16 + 4t + 1 | 4t + 2, 16 + 4t + 2, 4t + 3, 16 + 4t + 3).
std::vector<float> decode(const uint8_t* base, int n, int64_t d) {
  using namespace mma;
  const XSizes sz(d);
  const XSizes::Parts p = sz.at(const_cast<uint8_t*>(base));
  std::vector<float> out(size_t(n * d));
  static const int order[8] = {0, 16, 1, 17, 2, 18, 3, 19};  // input offsets (from 4t) of the 8 bytes
  for (int r = 0; r < n; ++r)
    for (int64_t blk = 0; 32 * blk < d; ++blk) {
      const int64_t grp = blk / (kGroup / 32);
      double acc[32] = {};
      for (int tau = 0; tau < kTerms; ++tau) {
        const int c = 3 * r + tau, nt = c >> 3, col = c & 7;
        const double s = p.xs[grp * kMaxCols + c];
        for (int t = 0; t < 4; ++t) {
          const uint2 w = p.xb[(blk * kMaxTiles + nt) * 32 + 4 * col + t];
          const uint32_t words[2] = {w.x, w.y};
          for (int b = 0; b < 8; ++b)
            acc[4 * t + order[b]] += double(int8_t(uint8_t(words[b / 4] >> (8 * (b % 4))))) * s;
        }
      }
      for (int i = 0; i < 32; ++i) out[size_t(r * d + 32 * blk + i)] = float(acc[i]);
    }
  return out;
}

template <bool RESID, bool STAGED>
int run(int n, int64_t d, bool weighted, float eps, char** files) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> x(size_t(n * d)), r(x.size()), w(static_cast<size_t>(d));
  if (!read_file(files[0], x) || (RESID && !read_file(files[1], r)) || (weighted && !read_file(files[2], w))) {
    std::fprintf(stderr, "short input file\n");
    return 2;
  }
  const float* wp = weighted ? w.data() : nullptr;
  const mma::XSizes sz(d);
  std::vector<uint8_t> split(sz.total(), 0xA5), split_ref(sz.total(), 0xA5);
  std::vector<float> h(x.size(), nan), h_ref(x.size(), nan), u(x.size(), nan);
  const int threads = norm::threads_for(d / 4);

  const mma::XSizes::Parts xp = sz.at(split.data());
  std::vector<float> stage(STAGED ? size_t(d) : 0);  // exactly the launch's dynamic shared memory
  specd_emu_dyn_smem = STAGED ? reinterpret_cast<uint8_t*>(stage.data()) : nullptr;
  emulate(
      n, threads,
      [&] {
        norm_split_kernel<RESID, STAGED>(x.data(), RESID ? r.data() : nullptr, wp, RESID ? h.data() : nullptr, d, eps,
                                         n, xp.xb, xp.xs, xp.xm);
      },
      [&](int64_t) { std::fill(stage.begin(), stage.end(), nan); });
  specd_emu_dyn_smem = nullptr;

  // the composition: rms_norm's kernel (norm_kernel: norm_row per block) into u, then split_x of u
  emulate(n, threads, [&] {
    const int64_t off = int64_t(blockIdx.x) * d;
    norm::norm_row<norm::Mode::RMS, true, RESID, false>(x.data() + off, RESID ? r.data() + off : nullptr, wp,
                                                        RESID ? h_ref.data() + off : nullptr, nullptr,
                                                        u.data() + off, d, eps);
  });
  const int64_t groups = (d + mma::kGroup - 1) / mma::kGroup, lanes = int64_t(n) * groups * 32;
  const mma::XSizes::Parts rp = sz.at(split_ref.data());
  emulate((lanes + 127) / 128, 128, [&] {
    mma::split_x_kernel(mma::PlainInput{u.data(), d}, d, n, groups, rp.xb, rp.xs, rp.xm);
  });

  write_file(files[3], h), write_file(files[4], split), write_file(files[5], h_ref), write_file(files[6], split_ref);
  write_file(files[7], decode(split.data(), n, d));
  std::printf("threads=%d\n", threads);
  return 0;
}

int main(int argc, char** argv) {
  if (argc != 15) {
    std::fprintf(stderr, "usage: %s n d RESID WEIGHTED STAGED eps x r w h split h_ref split_ref recon\n", argv[0]);
    return 2;
  }
  const int n = std::atoi(argv[1]);
  const int64_t d = std::atoll(argv[2]);
  if (n < 1 || n > 16 || d < 32 || d % 32 != 0) return 2;  // rms_norm_matmul's fused case (split_fusable)
  const bool resid = std::atoi(argv[3]) != 0, weighted = std::atoi(argv[4]) != 0, staged = std::atoi(argv[5]) != 0;
  if (staged && d > kMaxStagedFloats) return 2;
  const float eps = std::strtof(argv[6], nullptr);
  char** files = argv + 7;
  if (staged)
    return resid ? run<true, true>(n, d, weighted, eps, files) : run<false, true>(n, d, weighted, eps, files);
  return resid ? run<true, false>(n, d, weighted, eps, files) : run<false, false>(n, d, weighted, eps, files);
}
