// Host emulation of norm_split_kernel (native/src/gpu/norm_split.cuh: RMSNorm fused with the tensor-core
// GEMV's x split, rms_norm_matmul's kernel), of norm_split_partials_kernel (the same on x given as split-K
// partials, one thread-block cluster per row: warp_emu.h's emulate_clusters) and of the composition they replace
// on the GPU: x summed from its partials in order (partials.cuh), the standalone norm kernel's row code (norm.cuh:
// norm_row, with its block size threads_for(d / 4)) writing u = rms_norm(h), then split_x_kernel (matmul_mma.cuh)
// of u, as mma::launch_split_x launches it. Every output buffer and every block's shared memory starts poisoned
// (split bytes 0xA5, floats NaN), so a value one side writes and the other does not shows. Driven by
// tests/gpu/test_gpu_norm_split_host.py.
//
// usage: norm_split_emu n d RESID WEIGHTED STAGED SPLITS eps x.bin r.bin w.bin h.bin split.bin h_ref.bin
//        split_ref.bin recon.bin
//   SPLITS: 0: x.bin is x, F32 [n, d], for norm_split_kernel; STAGED: that kernel keeps the row in (poisoned)
//   dynamic shared memory (d <= kMaxStagedFloats, as matmul.cu launches it) or re-reads it from global memory.
//   S >= 1: x.bin is x's S partials, F32 [S, n, d], for the cluster kernel (norm_cluster_blocks(d) blocks a row,
//   cluster_smem_bytes of dynamic shared memory each; STAGED ignored), which writes h = x (+ r) always.
//   r: F32 [n, d] (read when RESID); w: F32 [d] (read when WEIGHTED); h, h_ref: F32 [n, d] (x + r, written
//   only with RESID, or by the cluster kernel); split, split_ref: the mma::XSizes(d) bytes of the fused kernel
//   and of the composition; recon: F32 [n, d], the values the fused split encodes (the sum of each input's terms
//   times their column scales, in double). Prints the block size (threads=) and, for the cluster kernel, the
//   blocks of a cluster (blocks=).
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

// The composition on x [n, d]: norm_kernel's row code (norm_row, one block a row) into u, then split_x of u.
template <bool RESID>
void composition(const std::vector<float>& x, const std::vector<float>& r, const float* wp, int n, int64_t d,
                 float eps, std::vector<float>& h_ref, std::vector<uint8_t>& split_ref) {
  std::vector<float> u(x.size(), std::numeric_limits<float>::quiet_NaN());
  emulate(n, norm::threads_for(d / 4), [&] {
    const int64_t off = int64_t(blockIdx.x) * d;
    norm::norm_row<norm::Mode::RMS, true, RESID, false>(x.data() + off, RESID ? r.data() + off : nullptr, wp,
                                                        RESID ? h_ref.data() + off : nullptr, nullptr,
                                                        u.data() + off, d, eps);
  });
  const int64_t groups = (d + mma::kGroup - 1) / mma::kGroup, lanes = int64_t(n) * groups * 32;
  const mma::XSizes::Parts rp = mma::XSizes(d).at(split_ref.data());
  emulate((lanes + 127) / 128, 128, [&] {
    mma::split_x_kernel(mma::PlainInput{u.data(), d}, d, n, groups, rp.xb, rp.xs, rp.xm);
  });
}

// The fused kernel under test into h / split: norm_split_kernel<RESID, STAGED> on x (splits == 0), or
// norm_split_partials_kernel<RESID> on x's `splits` partials xin [splits, n, d], whose in-order sum is x.
template <bool RESID, bool STAGED>
void fused(const std::vector<float>& xin, int splits, const std::vector<float>& r, const float* wp, int n, int64_t d,
           float eps, std::vector<float>& h, std::vector<uint8_t>& split) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const mma::XSizes::Parts xp = mma::XSizes(d).at(split.data());
  float* hp = RESID || splits > 0 ? h.data() : nullptr;
  if (splits > 0) {
    const int blocks = norm_cluster_blocks(d);
    const size_t smem = cluster_smem_bytes(d, int64_t(blocks) * kClusterThreads);
    emulate_clusters(n, blocks, kClusterThreads, smem, 0xFF, [&] {  // 0xFF..: NaN floats and doubles
      norm_split_partials_kernel<RESID>(xin.data(), splits, RESID ? r.data() : nullptr, wp, hp, d, eps, n, xp.xb,
                                        xp.xs, xp.xm);
    });
    std::printf("blocks=%d\n", blocks);
    return;
  }
  std::vector<float> stage(STAGED ? size_t(d) : 0);  // exactly the launch's dynamic shared memory
  specd_emu_dyn_smem = STAGED ? reinterpret_cast<uint8_t*>(stage.data()) : nullptr;
  emulate(
      n, norm::threads_for(d / 4),
      [&] { norm_split_kernel<RESID, STAGED>(xin.data(), RESID ? r.data() : nullptr, wp, hp, d, eps, n, xp.xb, xp.xs, xp.xm); },
      [&](int64_t) { std::fill(stage.begin(), stage.end(), nan); });
  specd_emu_dyn_smem = nullptr;
}

template <bool RESID, bool STAGED>
int run(int n, int64_t d, int splits, bool weighted, float eps, char** files) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const size_t count = size_t(n * d);
  std::vector<float> xin(count * size_t(std::max(splits, 1))), r(count), w(static_cast<size_t>(d));
  if (!read_file(files[0], xin) || (RESID && !read_file(files[1], r)) || (weighted && !read_file(files[2], w))) {
    std::fprintf(stderr, "short input file\n");
    return 2;
  }
  const float* wp = weighted ? w.data() : nullptr;
  std::vector<float> x(xin.begin(), xin.begin() + std::ptrdiff_t(count));  // the partials' sum, in part order
  for (int k = 1; k < splits; ++k)
    for (size_t j = 0; j < count; ++j) x[j] += xin[size_t(k) * count + j];
  const mma::XSizes sz(d);
  std::vector<uint8_t> split(sz.total(), 0xA5), split_ref(sz.total(), 0xA5);
  std::vector<float> h(count, nan), h_ref(count, nan);
  fused<RESID, STAGED>(xin, splits, r, wp, n, d, eps, h, split);
  composition<RESID>(x, r, wp, n, d, eps, h_ref, split_ref);
  write_file(files[3], h), write_file(files[4], split), write_file(files[5], h_ref), write_file(files[6], split_ref);
  write_file(files[7], decode(split.data(), n, d));
  std::printf("threads=%d\n", norm::threads_for(d / 4));
  return 0;
}

int main(int argc, char** argv) {
  if (argc != 16) {
    std::fprintf(stderr, "usage: %s n d RESID WEIGHTED STAGED SPLITS eps x r w h split h_ref split_ref recon\n",
                 argv[0]);
    return 2;
  }
  const int n = std::atoi(argv[1]);
  const int64_t d = std::atoll(argv[2]);
  if (n < 1 || n > 16 || d < 32 || d % 32 != 0) return 2;  // rms_norm_matmul's fused case (split_fusable)
  const bool resid = std::atoi(argv[3]) != 0, weighted = std::atoi(argv[4]) != 0, staged = std::atoi(argv[5]) != 0;
  const int splits = std::atoi(argv[6]);
  if (splits < 0 || (splits > 0 && norm_cluster_blocks(d) == 0) || (splits == 0 && staged && d > kMaxStagedFloats))
    return 2;
  const float eps = std::strtof(argv[7], nullptr);
  char** files = argv + 8;
  if (staged && splits == 0)
    return resid ? run<true, true>(n, d, 0, weighted, eps, files) : run<false, true>(n, d, 0, weighted, eps, files);
  return resid ? run<true, false>(n, d, splits, weighted, eps, files)
               : run<false, false>(n, d, splits, weighted, eps, files);
}
