// Host emulation of gdn_step_split_kernel (native/src/gpu/gdn_step_split.cuh: the GDN step, then its output's gated
// norm and the out projection's x split, in clusters of kGdnSplitCluster blocks: warp_emu.h's emulate_clusters) and
// of the composition it replaces on the GPU: gdn_step_kernel, then gated_norm_split_kernel (norm_split.cuh) on its
// o, as ssm.cu and matmul.cu launch them. Every output, the split bytes and each block's shared memory start
// poisoned (floats NaN, split bytes 0xA5), so a value one side writes and the other does not shows. Driven by
// tests/gpu/test_gpu_gdn_step_host.py.
//
// usage: gdn_split_emu DK T hk hv dv eps scale INPLACE WEIGHTED cv.bin a.bin b.bin dt.bin ssm_a.bin state.bin z.bin
//                      w.bin split.bin split_ref.bin pend.bin pend_ref.bin
//   cv, a, b, dt, ssm_a, state as gdn_step_main.cpp; z: F32 [T, hv, dv]; w: F32 [dv] (read when WEIGHTED);
//   split, split_ref: the mma::XSizes(hv dv) bytes of the fused kernel and of the composition; pend, pend_ref:
//   q, k, v, g, beta and the state written (gdn_step's pending values), one after another as F32.
//   Prints the grid (blocks=, clusters=).
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <vector>

#include "warp_emu.h"
#include "gdn_step_split.cuh"

using namespace specd::gpu::detail;
using namespace specd::gpu::detail::gdn_step;

template <class T>
void write_file(const char* path, const std::vector<T>& v) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(v.data()),
                                              std::streamsize(v.size() * sizeof(T)));
}

// One side's outputs: the split x, the pending values and the state written.
struct Side {
  std::vector<uint8_t> split;
  std::vector<float> o, q, k, v, g, beta, state;
  std::vector<float> pending() const {
    std::vector<float> all;
    for (const std::vector<float>* p : {&q, &k, &v, &g, &beta, &state}) all.insert(all.end(), p->begin(), p->end());
    return all;
  }
};

template <int DK>
int run(char** argv) {
  constexpr int L = DK / 16 > 4 ? DK / 16 : 4, E = DK / L;
  const int64_t T = std::atoll(argv[2]);
  const int hk = std::atoi(argv[3]), hv = std::atoi(argv[4]), dv = std::atoi(argv[5]);
  const int64_t in = int64_t(hv) * dv;
  // the fused launch's shapes (matmul.cu: gdn_step_gated_matmul)
  if (T < 1 || T > 16 || hk < 1 || hv % hk != 0 || dv % kGdnRows != 0 || mma::kGroup % dv != 0 ||
      in % mma::kGroup != 0)
    return 2;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const int64_t cols = 2 * int64_t(hk) * DK + in;
  std::vector<float> cv(size_t(T * cols)), a(size_t(T * hv)), b(a.size()), dt(static_cast<size_t>(hv)),
      ssm_a(dt.size()), state(size_t(in) * DK), z(size_t(T * in)), w(static_cast<size_t>(dv));
  if (!read_file(argv[10], cv) || !read_file(argv[11], a) || !read_file(argv[12], b) || !read_file(argv[13], dt) ||
      !read_file(argv[14], ssm_a) || !read_file(argv[15], state) || !read_file(argv[16], z) ||
      !read_file(argv[17], w)) {
    std::fprintf(stderr, "short input file\n");
    return 2;
  }
  const bool in_place = std::atoi(argv[8]) != 0, weighted = std::atoi(argv[9]) != 0;
  const float eps = std::strtof(argv[6], nullptr), scale = std::strtof(argv[7], nullptr);
  const mma::XSizes sz(in);
  const int64_t blocks = in / kGdnRows;
  const auto side = [&](bool fused) {
    Side s{std::vector<uint8_t>(sz.total(), 0xA5), std::vector<float>(size_t(T * in), nan),
           std::vector<float>(size_t(T * hk * DK), nan), std::vector<float>(size_t(T * hk * DK), nan),
           std::vector<float>(size_t(T * in), nan), std::vector<float>(a.size(), nan),
           std::vector<float>(a.size(), nan), std::vector<float>(state.size(), nan)};
    std::vector<float> work = state;  // the state read (and written, in place)
    float* out_state = in_place ? work.data() : s.state.data();
    const GdnStepParams P{cv.data(), a.data(), b.data(), dt.data(), ssm_a.data(), work.data(), out_state,
                          s.o.data(), s.q.data(), s.k.data(), s.v.data(), s.g.data(), s.beta.data(), T, hk, hv, dv,
                          eps, scale};
    const mma::XSizes::Parts xp = sz.at(s.split.data());
    const GatedSplit S{z.data(), weighted ? w.data() : nullptr, eps, in, xp.xb, xp.xs, xp.xm};
    const size_t stage = gdn_step_smem<DK>(kGdnRows);
    if (fused) {
      emulate_clusters(blocks / kGdnSplitCluster, kGdnSplitCluster, kGdnRows * L, gdn_split_smem<DK>(), 0xFF,
                       [&] { gdn_step_split_kernel<E, L>(P, S); });
    } else {
      std::vector<float> smem;
      emulate(blocks, kGdnRows * L, [&] { gdn_step_kernel<E, L>(P); }, [&](int64_t) {
        smem.assign(stage / sizeof(float), nan);
        specd_emu_dyn_smem = reinterpret_cast<uint8_t*>(smem.data());
      });
      const int64_t groups = in / mma::kGroup;
      emulate(T * groups, gated_norm_split_warps(dv) * 32,
              [&] { gated_norm_split_kernel(s.o.data(), dv, int(T), groups, S); });
    }
    if (in_place) s.state = work;
    return s;
  };
  const Side got = side(true), ref = side(false);
  const char* const* out = argv + 18;
  write_file(out[0], got.split), write_file(out[1], ref.split);
  write_file(out[2], got.pending()), write_file(out[3], ref.pending());
  std::printf("blocks=%lld clusters=%lld\n", (long long)blocks, (long long)(blocks / kGdnSplitCluster));
  return 0;
}

int main(int argc, char** argv) {
  if (argc != 22) {
    std::fprintf(stderr, "usage: %s DK T hk hv dv eps scale INPLACE WEIGHTED cv a b dt ssm_a state z w split "
                 "split_ref pend pend_ref\n", argv[0]);
    return 2;
  }
  switch (std::atoi(argv[1])) {
    case 32: return run<32>(argv);
    case 64: return run<64>(argv);
    case 128: return run<128>(argv);
    default: return 2;
  }
}
