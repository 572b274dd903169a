// Host harness for test_gpu_swiglu_bf16_host.py: swiglu_for_bf16 (native/src/gpu/activations.cuh), the
// prefill's F32 shortcut to the BF16 of swiglu, against apply<Op::Swiglu> (the swiglu op's double
// evaluation). Reads N, then N gate and N up values (float32) from stdin; writes per value the float32
// bits of swiglu_for_bf16 and of apply, then the two BF16 roundings (to_bf16, uint16).
#include <cstdint>
#include <cstdio>
#include <vector>

#include "warp_emu.h"
#include "activations.cuh"
#include "weight_formats.cuh"

using namespace specd::gpu::detail;

int main() {
  int64_t n = 0;
  if (std::fread(&n, 8, 1, stdin) != 1 || n < 0 || n > (int64_t(1) << 26)) return 2;
  std::vector<float> a(n), b(n);
  if (std::fread(a.data(), 4, n, stdin) != size_t(n) || std::fread(b.data(), 4, n, stdin) != size_t(n)) return 2;
  std::vector<float> fast(n), slow(n);
  std::vector<uint16_t> fast16(n), slow16(n);
  for (int64_t i = 0; i < n; ++i) {
    fast[i] = swiglu_for_bf16(a[i], b[i]);
    slow[i] = apply<Op::Swiglu>(a[i], b[i]);
    fast16[i] = to_bf16(fast[i]);
    slow16[i] = to_bf16(slow[i]);
  }
  std::fwrite(fast.data(), 4, n, stdout);
  std::fwrite(slow.data(), 4, n, stdout);
  std::fwrite(fast16.data(), 2, n, stdout);
  std::fwrite(slow16.data(), 2, n, stdout);
  return 0;
}
