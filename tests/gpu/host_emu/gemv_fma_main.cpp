// Host emulation of the FP32-FMA GEMV (native/src/gpu/gemv_fma.cuh: gemv_kernel, the only GEMV of the HIP build
// and CUDA's for F32 / F16 and BF16 off the tensor cores), for test_gpu_gemv_fma_host.py: y[n, out] = x[n, in] @
// w[out, in]^T with matmul.cu's grid (one block of kThreads threads per R output rows) and chunk counts (gemv()),
// the instance for n rows of x chosen as matmul.cu's launch() does (with_rows_instance), and R given (matmul.cu's
// launch_n picks it from the device's size). y is poisoned with NaN first.
//
// usage: gemv_fma FORMAT OUT IN N R w.bin x.bin y.bin
//   FORMAT: F32 (4-float chunks), F32x1, F16 (8-value chunks), F16x1, BF16, BF16x1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS
//   w.bin: OUT rows of the format's bytes; x.bin: F32 [N, IN]; y.bin: F32 [N, OUT] (written). R: 1, 2 or 4.
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
  const int64_t nchunks = c.in / W::kElems;
  emulate((c.out + R - 1) / R, fma_gemv::kThreads,
          [&] { fma_gemv::gemv_kernel<W, NMAX, R>(c.w, c.row_bytes, nchunks, c.x, c.in, c.y, c.n, c.out); });
}

// The instance for n rows of x, as matmul.cu's launch() chooses it.
template <class W, int R>
static void run_n(const Case& c) {
  fma_gemv::with_rows_instance(c.n, [&](auto rows) { run<W, decltype(rows)::value, R>(c); });
}

template <class W>
static bool run_r(const Case& c, int r) {
  if (r == 1) run_n<W, 1>(c);
  else if (r == 2) run_n<W, 2>(c);
  else if (r == 4) run_n<W, 4>(c);
  else return false;
  return true;
}

// (policy, bytes of a row of `in` weights) by name, matmul.cu's gemv() chunking.
static bool dispatch(const std::string& f, const Case& c0, int r) {
  Case c = c0;
  const auto blocks = [&](int64_t bs, int64_t ts) { return c.in % bs == 0 ? c.in / bs * ts : -1; };
  if (f == "F32") return c.in % 4 == 0 && (c.row_bytes = 4 * c.in, run_r<F32W<4>>(c, r));
  if (f == "F32x1") return (c.row_bytes = 4 * c.in, run_r<F32W<1>>(c, r));
  if (f == "F16") return c.in % 8 == 0 && (c.row_bytes = 2 * c.in, run_r<Half16W<8, false>>(c, r));
  if (f == "F16x1") return (c.row_bytes = 2 * c.in, run_r<Half16W<1, false>>(c, r));
  if (f == "BF16") return c.in % 8 == 0 && (c.row_bytes = 2 * c.in, run_r<Half16W<8, true>>(c, r));
  if (f == "BF16x1") return (c.row_bytes = 2 * c.in, run_r<Half16W<1, true>>(c, r));
  if (f == "Q8_0") return (c.row_bytes = blocks(32, 34)) > 0 && run_r<Q8_0Quarter>(c, r);
  if (f == "Q4_K") return (c.row_bytes = blocks(256, 144)) > 0 && run_r<Q4KW>(c, r);
  if (f == "Q5_K") return (c.row_bytes = blocks(256, 176)) > 0 && run_r<Q5KW>(c, r);
  if (f == "Q6_K") return (c.row_bytes = blocks(256, 210)) > 0 && run_r<Q6KW>(c, r);
  if (f == "IQ4_XS") return (c.row_bytes = blocks(256, 136)) > 0 && run_r<IQ4XSW>(c, r);
  return false;
}

static bool known(const std::string& f) {
  for (const char* k : {"F32", "F32x1", "F16", "F16x1", "BF16", "BF16x1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"})
    if (f == k) return true;
  return false;
}

static int64_t row_bytes(const std::string& f, int64_t in) {
  if (f == "F32" || f == "F32x1") return 4 * in;
  if (f.rfind("F16", 0) == 0 || f.rfind("BF16", 0) == 0) return 2 * in;
  const int64_t bs = f == "Q8_0" ? 32 : 256;
  const int64_t ts = f == "Q8_0" ? 34 : f == "Q4_K" ? 144 : f == "Q5_K" ? 176 : f == "Q6_K" ? 210 : 136;
  return in / bs * ts;
}

int main(int argc, char** argv) {
  if (argc != 9) {
    std::fprintf(stderr, "usage: %s FORMAT OUT IN N R w.bin x.bin y.bin\n", argv[0]);
    return 2;
  }
  const std::string f = argv[1];
  const int64_t out = std::atoll(argv[2]), in = std::atoll(argv[3]);
  const int n = std::atoi(argv[4]), r = std::atoi(argv[5]);
  if (!known(f) || out < 1 || in < 1 || n < 1 || n > fma_gemv::kNMax) {
    std::fprintf(stderr, "unknown format %s, or a size out of range\n", f.c_str());
    return 2;
  }
  // 16-byte aligned rows for the vector loads (the GPU's allocations are 256-byte aligned).
  std::vector<uint4> wbuf(size_t((out * row_bytes(f, in) + 15) / 16));
  std::vector<uint8_t> wbytes(size_t(out * row_bytes(f, in)));
  std::vector<float> x(size_t(n * in)), y(size_t(n * out), std::numeric_limits<float>::quiet_NaN());
  if (!read_file(argv[6], wbytes) || !read_file(argv[7], x)) {
    std::fprintf(stderr, "input files of the wrong size\n");
    return 2;
  }
  std::memcpy(wbuf.data(), wbytes.data(), wbytes.size());
  const Case c{out, in, 0, n, reinterpret_cast<const uint8_t*>(wbuf.data()), x.data(), y.data()};
  if (!dispatch(f, c, r)) {
    std::fprintf(stderr, "format %s, in %lld or R %d not served\n", f.c_str(), (long long)in, r);
    return 2;
  }
  std::ofstream(argv[8], std::ios::binary)
      .write(reinterpret_cast<const char*>(y.data()), std::streamsize(y.size() * sizeof(float)));
  return 0;
}
