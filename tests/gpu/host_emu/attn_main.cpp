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
#include "attn_case.h"

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
  AttnCase c;
  if (!c.parse(argv) || !flash::supported_dim(c.d)) return 2;
  if (!c.read(argv[10], argv[11], argv[12], argv[13])) return 2;
  const int d = c.d;
  const flash::Plan pl = flash::plan(c.n, c.hkv, c.hq / c.hkv, d);
  flash::Params P = flash::params(pl, c.n, c.hq, c.hkv, c.kv_len, c.window, c.causal != 0, c.scale);
  c.set_views(P);
  P.out = c.out.data();
  std::vector<uint4> smem((pl.smem + 15) / 16);
  if (d == 64) run<64>(P, pl, smem);
  else if (d == 128) run<128>(P, pl, smem);
  else run<256>(P, pl, smem);
  c.write_out(argv[14]);
  return 0;
}
