// Host emulation of the FP32-FMA GEMV (native/src/gpu/gemv_fma.cuh: gemv_kernel, the only GEMV of the HIP build
// and CUDA's for F32 / F16 and BF16 off the tensor cores), for test_gpu_gemv_fma_host.py: y[n, out] = x[n, in] @
// w[out, in]^T with matmul.cu's grid (one block of kThreads threads per R output rows) and chunk counts (chunks_per_row),
// the instance for n rows of x chosen as matmul.cu's launch() does (with_rows_instance), and R given (matmul.cu's
// launch_n picks it from the device's size). y is poisoned with NaN first.
//
// usage: gemv_fma FORMAT OUT IN ROW_BYTES N R w.bin x.bin y.bin
//   FORMAT: F32 (4-float chunks), F32x1, F16 (8-value chunks), F16x1, BF16, BF16x1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS
//   w.bin: OUT rows of ROW_BYTES bytes of the format; x.bin: F32 [N, IN]; y.bin: F32 [N, OUT] (written). R: 1, 2 or 4.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "warp_emu.h"
#include "gemv_fma.cuh"

using namespace specd::gpu::detail;

struct Case {
  int64_t out, in, row_bytes;
  int n;
  const uint8_t* w;
  const float* x;
  float* y;
};

template <class W, int NMAX, int R>
static void run(const Case& c) {
  const int64_t nchunks = fma_gemv::chunks_per_row<W>(c.in);
  emulate((c.out + R - 1) / R, fma_gemv::kThreads,
          [&] { fma_gemv::gemv_kernel<W, NMAX, R>(c.w, c.row_bytes, nchunks, c.x, c.in, c.y, c.n, c.out); });
}

// Policy W at r output rows a block (1, 2 or 4), in the instance for n rows of x that matmul.cu's launch() takes;
// false for an r or an input count (not a multiple of W's chunk) that matmul.cu never launches.
template <class W>
static bool run_policy(const Case& c, int r) {
  if (c.in % W::kElems != 0 || (r != 1 && r != 2 && r != 4)) return false;
  fma_gemv::with_rows_instance(c.n, [&](auto rows) {
    constexpr int NMAX = decltype(rows)::value;
    if (r == 1) run<W, NMAX, 1>(c);
    else if (r == 2) run<W, NMAX, 2>(c);
    else run<W, NMAX, 4>(c);
  });
  return true;
}

using Runner = bool (*)(const Case&, int);

// The policy matmul.cu's gemv() takes for each format (F32 / F16 / BF16: vector chunks, and "x1" the scalar ones).
static Runner runner(const std::string& f) {
  if (f == "F32") return run_policy<F32W<4>>;
  if (f == "F32x1") return run_policy<F32W<1>>;
  if (f == "F16") return run_policy<Half16W<8, false>>;
  if (f == "F16x1") return run_policy<Half16W<1, false>>;
  if (f == "BF16") return run_policy<Half16W<8, true>>;
  if (f == "BF16x1") return run_policy<Half16W<1, true>>;
  if (f == "Q8_0") return run_policy<Q8_0Quarter>;
  if (f == "Q4_K") return run_policy<Q4KW>;
  if (f == "Q5_K") return run_policy<Q5KW>;
  if (f == "Q6_K") return run_policy<Q6KW>;
  if (f == "IQ4_XS") return run_policy<IQ4XSW>;
  return nullptr;
}

int main(int argc, char** argv) {
  if (argc != 10) {
    std::fprintf(stderr, "usage: %s FORMAT OUT IN ROW_BYTES N R w.bin x.bin y.bin\n", argv[0]);
    return 2;
  }
  const Runner run_format = runner(argv[1]);
  const int64_t out = std::atoll(argv[2]), in = std::atoll(argv[3]), row_bytes = std::atoll(argv[4]);
  const int n = std::atoi(argv[5]), r = std::atoi(argv[6]);
  if (!run_format || out < 1 || in < 1 || row_bytes < 1 || n < 1 || n > fma_gemv::kNMax) {
    std::fprintf(stderr, "unknown format %s, or a size out of range\n", argv[1]);
    return 2;
  }
  // The weights in 16-byte words: aligned rows for the vector loads (the GPU's allocations are 256-byte aligned).
  std::vector<uint8_t> wbytes(size_t(out * row_bytes));
  std::vector<float> x(size_t(n * in)), y(size_t(n * out), std::numeric_limits<float>::quiet_NaN());
  if (!read_file(argv[7], wbytes) || !read_file(argv[8], x)) {
    std::fprintf(stderr, "input files of the wrong size\n");
    return 2;
  }
  std::vector<uint4> w((wbytes.size() + 15) / 16);
  std::memcpy(w.data(), wbytes.data(), wbytes.size());
  if (!run_format({out, in, row_bytes, n, reinterpret_cast<const uint8_t*>(w.data()), x.data(), y.data()}, r)) {
    std::fprintf(stderr, "format %s with %lld inputs or R %d is not launched by matmul.cu\n", argv[1], (long long)in, r);
    return 2;
  }
  std::ofstream(argv[9], std::ios::binary)
      .write(reinterpret_cast<const char*>(y.data()), std::streamsize(y.size() * sizeof(float)));
  return 0;
}
