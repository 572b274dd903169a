// Host emulation of the tensor-core flash attention (native/src/gpu/attention_flash.cuh): its
// attn_flash_kernel runs on the CPU, one std::thread per lane (warp_emu.h: mma.sync m16n8k16 f16 -> f32,
// ldmatrix .x4 / .x4.trans, shuffles emulated from the PTX ISA layouts; cp.async an immediate copy;
// __syncthreads a block barrier), with the launch plan attention.cu uses (flash::plan). Checks the
// fragment layouts, the shared-memory swizzle, the tile walk, the causal / window masks, the online
// softmax and the GQA work split against a numpy reference (test_gpu_decoders_host.py) without a GPU;
// the device itself is covered by test_gpu_ops2.py.
//
// usage: attn_emu D n hq hkv capacity kv_len window causal scale q.bin pos.bin k.bin v.bin out.bin
//   q: F32 [n, hq, D]; pos: I32 [n]; k, v: F16 [capacity, hkv, D]; out: F32 [n, hq, D] (written).
// Dynamic shared memory is poisoned (0xFF bytes: F16 NaN) before every block and the output before the
// launch (F32 NaN), so a read of unwritten shared memory or an unwritten output element shows as NaN.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "warp_emu.h"
#include "attention_flash.cuh"

using namespace specd::gpu::detail;

template <int D>
static void run(flash::Params P, const flash::Plan& pl, std::vector<uint4>& smem) {
  specd_emu_dyn_smem = reinterpret_cast<uint8_t*>(smem.data());
  emulate(pl.blocks, pl.warps * 32, [&] { flash::attn_flash_kernel<D>(P); },
          [&](int64_t) { std::memset(smem.data(), 0xFF, smem.size() * sizeof(uint4)); });
}

int main(int argc, char** argv) {
  if (argc != 15) {
    std::fprintf(stderr, "usage: %s D n hq hkv capacity kv_len window causal scale q.bin pos.bin k.bin v.bin out.bin\n",
                 argv[0]);
    return 2;
  }
  const int d = std::atoi(argv[1]);
  const int64_t n = std::atoll(argv[2]), hq = std::atoll(argv[3]), hkv = std::atoll(argv[4]);
  const int64_t cap = std::atoll(argv[5]), kv_len = std::atoll(argv[6]), window = std::atoll(argv[7]);
  const int causal = std::atoi(argv[8]);
  const double scale = std::atof(argv[9]);
  if (!flash::supported_dim(d) || n < 1 || hkv < 1 || hq % hkv || kv_len < 0 || kv_len > cap) return 2;
  std::vector<float> q(size_t(n * hq * d)), out(size_t(n * hq * d), NAN);
  std::vector<int32_t> pos(static_cast<size_t>(n));
  std::vector<uint16_t> k(size_t(cap * hkv * d)), v(size_t(cap * hkv * d));
  if (!read_file(argv[10], q) || !read_file(argv[11], pos) || !read_file(argv[12], k) || !read_file(argv[13], v)) {
    std::fprintf(stderr, "short input file\n");
    return 2;
  }
  const flash::Plan pl = flash::plan(n, hkv, hq / hkv, d);
  flash::Params P = flash::params(pl, n, hq, hkv, kv_len, window, causal != 0, scale);
  P.q = q.data();
  P.kc = reinterpret_cast<const uint8_t*>(k.data());
  P.vc = reinterpret_cast<const uint8_t*>(v.data());
  P.k_row_stride = P.v_row_stride = hkv * d * 2;
  P.k_head_stride = P.v_head_stride = int64_t(d) * 2;
  P.q_pos = pos.data();
  P.out = out.data();
  std::vector<uint4> smem((pl.smem + 15) / 16);
  if (d == 64) run<64>(P, pl, smem);
  else if (d == 128) run<128>(P, pl, smem);
  else run<256>(P, pl, smem);
  std::ofstream(argv[14], std::ios::binary).write(reinterpret_cast<const char*>(out.data()),
                                                  std::streamsize(out.size() * sizeof(float)));
  return 0;
}
