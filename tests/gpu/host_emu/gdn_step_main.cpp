// Host emulation of gdn_step_kernel (native/src/gpu/gdn_step.cuh): the GDN step's q / k L2 norms, gates and
// token-by-token recurrence run on the CPU, one std::thread per thread of a block (warp_emu.h: shuffles,
// __syncthreads, the dynamic shared memory a poisoned buffer), with ssm.cu's launch (gdn_kernel's blocks:
// rows = 32 when dv % 32 == 0, else dv; L = max(4, DK / 16) lanes per row), in place on the state when
// INPLACE is 1. Outputs are poisoned (NaN) first, so a value the kernel should have written and did not
// shows. Then gdn_kernel (gated_delta_net's) runs on the step's q, k, v, g, beta from the same state:
// its o and state (o_ref, state_ref) must be the step's bit for bit. Then gdn_layers_kernel (gated_delta_net_states')
// runs two layers in one launch (layers0: the step's inputs from state; layers1: other inputs, from state_ref), each of
// which must end where gdn_kernel does (state_ref; state_ref2, gdn_kernel's run of layer 1). Driven by
// tests/gpu/test_gpu_gdn_step_host.py.
//
// usage: gdn_step_emu DK T hk hv dv eps scale INPLACE cv.bin a.bin b.bin dt.bin ssm_a.bin state.bin
//                     o.bin q.bin k.bin v.bin g.bin beta.bin state_out.bin o_ref.bin state_ref.bin
//                     layers0.bin layers1.bin state_ref2.bin
//   cv: F32 [T, 2 hk DK + hv dv]; a, b: F32 [T, hv]; dt, ssm_a: F32 [hv]; state: F32 [hv, dv, DK];
//   o, v: F32 [T, hv, dv], q, k: F32 [T, hk, DK], g, beta: F32 [T, hv], state_out: F32 [hv, dv, DK] (written;
//   o_ref, state_ref, layers0, layers1 and state_ref2 likewise).
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "warp_emu.h"
#include "gdn_step.cuh"

using namespace specd::gpu::detail::gdn_step;

template <class T>
void write_file(const char* path, const std::vector<T>& v) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(v.data()),
                                              std::streamsize(v.size() * sizeof(T)));
}

template <int DK>
int run(char** argv) {
  constexpr int L = DK / 16 > 4 ? DK / 16 : 4, E = DK / L;
  const int64_t T = std::atoll(argv[2]);
  const int hk = std::atoi(argv[3]), hv = std::atoi(argv[4]), dv = std::atoi(argv[5]);
  const int rows = dv % kGdnRows == 0 ? kGdnRows : dv;
  if (T < 0 || hk < 1 || hv % hk != 0 || dv < 1 || rows * L > kMaxGdnThreads || (rows * L) % 32 != 0) return 2;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const int64_t cols = 2 * int64_t(hk) * DK + int64_t(hv) * dv;
  std::vector<float> cv(size_t(T * cols)), a(size_t(T * hv)), b(a.size()), dt(static_cast<size_t>(hv)),
      ssm_a(dt.size()), state(size_t(hv) * dv * DK);
  if (!read_file(argv[9], cv) || !read_file(argv[10], a) || !read_file(argv[11], b) || !read_file(argv[12], dt) ||
      !read_file(argv[13], ssm_a) || !read_file(argv[14], state)) {
    std::fprintf(stderr, "short input file\n");
    return 2;
  }
  const bool in_place = std::atoi(argv[8]) != 0;
  std::vector<float> o(size_t(T * hv * dv), nan), q(size_t(T * hk * DK), nan), k(q.size(), nan), v(o.size(), nan),
      g(a.size(), nan), beta(a.size(), nan), state_out(state.size(), nan), work = state;
  float* out_state = in_place ? work.data() : state_out.data();
  const float eps = std::strtof(argv[6], nullptr), scale = std::strtof(argv[7], nullptr);
  const GdnStepParams P{cv.data(), a.data(), b.data(), dt.data(), ssm_a.data(), work.data(), out_state, o.data(),
                        q.data(), k.data(), v.data(), g.data(), beta.data(), T, hk, hv, dv, eps, scale};
  std::vector<float> smem;
  const int64_t blocks = int64_t(hv) * (dv / rows);
  emulate(blocks, rows * L, [&] { gdn_step_kernel<E, L>(P); }, [&](int64_t) {
    smem.assign(gdn_step_smem<DK>(rows) / sizeof(float), nan);
    specd_emu_dyn_smem = reinterpret_cast<uint8_t*>(smem.data());
  });
  if (in_place) state_out = work;
  // gated_delta_net's register kernel on the step's pending q, k, v, g, beta, from the same state
  std::vector<float> o_ref(o.size(), nan), state_ref(state.size(), nan);
  const specd::gpu::detail::gdn::Params R{q.data(), k.data(), v.data(), g.data(), beta.data(), state.data(),
                                          state_ref.data(), nullptr, scale, T, hk, hv, DK, dv, o_ref.data()};
  emulate(blocks, rows * L, [&] { gdn_kernel<E, L>(R); });
  // gated_delta_net_states' kernel on two layers, in place: layer 0 the step's inputs from `state`, layer 1 other
  // inputs (each of q, k, v, g, beta changed) from state_ref; each must end where gdn_kernel does (layer 1's
  // reference: state_ref2).
  const auto scaled = [](const std::vector<float>& a, float f) {
    std::vector<float> b(a.size());
    for (size_t i = 0; i < a.size(); ++i) b[i] = a[i] * f;
    return b;
  };
  const std::vector<float> q1 = scaled(q, -1.0f), k1 = scaled(k, -1.0f), v1 = scaled(v, 0.5f), g1 = scaled(g, 0.5f),
                           beta1 = scaled(beta, 0.75f);
  std::vector<float> state_ref2(state.size(), nan), o_ref2(o.size()), layer0 = state, layer1 = state_ref;
  const specd::gpu::detail::gdn::Params R2{q1.data(), k1.data(), v1.data(), g1.data(), beta1.data(), state_ref.data(),
                                           state_ref2.data(), nullptr, scale, T, hk, hv, DK, dv, o_ref2.data()};
  emulate(blocks, rows * L, [&] { gdn_kernel<E, L>(R2); });
  GdnLayers Ls{};
  Ls.q[0] = q.data(), Ls.k[0] = k.data(), Ls.v[0] = v.data(), Ls.g[0] = g.data(), Ls.beta[0] = beta.data();
  Ls.q[1] = q1.data(), Ls.k[1] = k1.data(), Ls.v[1] = v1.data(), Ls.g[1] = g1.data(), Ls.beta[1] = beta1.data();
  Ls.state[0] = layer0.data(), Ls.state[1] = layer1.data();
  Ls.scale = scale, Ls.T = T, Ls.hk = hk, Ls.hv = hv, Ls.dk = DK, Ls.dv = dv, Ls.blocks_per_layer = blocks;
  emulate(2 * blocks, rows * L, [&] { gdn_layers_kernel<E, L>(Ls); });
  const char* const* out = argv + 15;
  write_file(out[0], o), write_file(out[1], q), write_file(out[2], k), write_file(out[3], v);
  write_file(out[4], g), write_file(out[5], beta), write_file(out[6], state_out);
  write_file(out[7], o_ref), write_file(out[8], state_ref);
  write_file(out[9], layer0), write_file(out[10], layer1), write_file(out[11], state_ref2);
  std::printf("blocks=%lld threads=%d\n", (long long)blocks, rows * L);
  return 0;
}

int main(int argc, char** argv) {
  if (argc != 27) {
    std::fprintf(stderr, "usage: %s DK T hk hv dv eps scale INPLACE cv a b dt ssm_a state o q k v g beta state_out "
                 "o_ref state_ref layers0 layers1 state_ref2\n", argv[0]);
    return 2;
  }
  switch (std::atoi(argv[1])) {
    case 32: return run<32>(argv);
    case 64: return run<64>(argv);
    case 128: return run<128>(argv);
    default: return 2;
  }
}
