// Variant sweep of the tensor-core GEMV (issue 7). tools/device/gemv_sweep.sh compiles this file once
// per variant, with -D overrides of the tuning constants at the top of native/src/gpu/matmul_mma.cuh,
// and runs each binary on the GPU: it times one GEMV call (split_x_kernel + mma_gemv_kernel +
// sum_splits_kernel, exactly the launches of detail::mma::gemv) per format, weight shape and width,
// rotating over enough weight copies that every call streams its weights from HBM (SWEEP_HOT=1: one copy, which
// stays in L2 when it fits), and prints one
// tab-separated line per case with the microseconds per call, the weight bytes per second and their
// ratio to the device-to-device copy bandwidth measured at start-up, plus a checksum of the outputs
// (variants with the same split sizing must agree bit for bit).
//
// Usage: gemv_sweep VARIANT_NAME [calls_ms]      (prints "variant format out in group n us GBps ratio checksum")
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common.cuh"
#include "specd/gpu.h"
#include "weight_formats.cuh"
#include "matmul_mma.cuh"
#include "bench_util.cuh"

namespace specd::gpu::detail {
[[noreturn]] void throw_runtime_error(cudaError_t err, const char* call, const char* file, int line) {
  std::fprintf(stderr, "%s failed at %s:%d: %s\n", call, file, line, cudaGetErrorString(err));
  std::exit(2);
}
}  // namespace specd::gpu::detail

namespace mma = specd::gpu::detail::mma;

namespace {

constexpr size_t kScratchBytes = size_t(64) << 20;  // split partials of one call
constexpr int64_t kMaxShapeIn = 17408;                // x holds 16 rows of this many inputs (SWEEP_SHAPES' bound)
constexpr int64_t kMaxShapeOut = 262144;              // (the partials' scratch bounds it further, checked per call)

struct Format {
  const char* name;
  int block_bytes, block_elems;
  std::vector<int> d_offsets;  // fp16 scale fields of a block, set to a small value (no inf / NaN)
  bool tiled;  // uploaded in the GEMV's tiled layout (IQ4_XS_T, Q4_K_T, Q5_K_T, Q6_K_T: mma::IQ4T / Q4T / Q5T / Q6T)
};

// IQ4_XS_T / Q4_K_T / Q5_K_T / Q6_K_T get the bytes IQ4_XS / Q4_K / Q5_K / Q6_K get (the weights of a shape depend on the block size
// only), so their checksums must agree bit for bit; their buffers hold the tiled layout
// (kTileUnitBytes per 16 rows x 256 inputs, the bytes its GB/s count: the header under test decides them).
const Format kFormats[] = {
    {"IQ4_XS", 136, 256, {0}, false}, {"IQ4_XS_T", 136, 256, {0}, true}, {"Q4_K", 144, 256, {0, 2}, false},
    {"Q4_K_T", 144, 256, {0, 2}, true}, {"Q5_K", 176, 256, {0, 2}, false}, {"Q5_K_T", 176, 256, {0, 2}, true},
    {"Q6_K", 210, 256, {208}, false},
    {"Q6_K_T", 210, 256, {208}, true},
    {"Q8_0", 34, 32, {0}, false},
};

// Each buffer (a row-major format [out, in] in its first wbytes, out % 16 == 0, room for the tiled bytes)
// regrouped in place into the library's tiled layout by its own kernel (tile_for_gemv's).
void tile(const Format& f, const std::vector<uint8_t*>& bufs, int64_t out, int64_t in, int64_t wbytes) {
  uint8_t* tmp;
  CK(cudaMalloc(&tmp, size_t(wbytes)));
  for (uint8_t* p : bufs) {
    CK(cudaMemcpy(tmp, p, size_t(wbytes), cudaMemcpyDeviceToDevice));
    const std::string nm = f.name;
    if (nm == "Q6_K_T")
      mma::launch_tile_q6_k(tmp, out, in, p, nullptr);
    else if (nm == "Q4_K_T")
      mma::launch_tile_q4_k(tmp, out, in, p, nullptr);
    else if (nm == "Q5_K_T")
      mma::launch_tile_q5_k(tmp, out, in, p, nullptr);
    else
      mma::launch_tile_iq4_xs(tmp, out, in, p, nullptr);
  }
  CK(cudaDeviceSynchronize());
  CK(cudaFree(tmp));
}

// One GEMV call: the launches of detail::mma::gemv (split x, the grouped kernel, the split sums),
// the split partials in `scratch`.
template <class F, int NT>
void call(const std::vector<mma::GroupWeight>& ws, int64_t in, const float* x, int n, uint8_t* xbuf,
          uint8_t* scratch) {
  static const int sms = [] {  // once, not in the timed loop
    int v = 0;
    CK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, 0));
    return v;
  }();
  mma::launch_split_x(mma::PlainInput{x, in}, in, n, xbuf, nullptr);
  size_t used = 0;
  mma::SplitSums sums;
  mma::launch<F, NT>(ws.data(), int(ws.size()), in, mma::x_view(xbuf, in, n), n, sms, [&](size_t bytes) {
    float* p = reinterpret_cast<float*>(scratch + used);
    used += (bytes + 255) / 256 * 256;
    if (used > kScratchBytes) {
      std::fprintf(stderr, "gemv_sweep: split partials need more than the %zu scratch bytes\n", kScratchBytes);
      std::exit(2);
    }
    return p;
  }, sums, nullptr);
  mma::launch_sums(sums, nullptr);
}

template <class F>
void dispatch(const std::vector<mma::GroupWeight>& ws, int64_t in, const float* x, int n, uint8_t* xbuf,
              uint8_t* scratch) {
  mma::with_tiles(n, [&](auto nt) { call<F, decltype(nt)::value>(ws, in, x, n, xbuf, scratch); });
}

void run(const Format& f, const std::vector<mma::GroupWeight>& ws, int64_t in, const float* x, int n, uint8_t* xbuf,
         uint8_t* scratch) {
  const std::string nm = f.name;
  if (nm == "IQ4_XS") return dispatch<mma::IQ4U>(ws, in, x, n, xbuf, scratch);
  if (nm == "IQ4_XS_T") return dispatch<mma::IQ4T>(ws, in, x, n, xbuf, scratch);
  if (nm == "Q4_K") return dispatch<mma::QK45U<false>>(ws, in, x, n, xbuf, scratch);
  if (nm == "Q5_K") return dispatch<mma::QK45U<true>>(ws, in, x, n, xbuf, scratch);
  if (nm == "Q6_K") return dispatch<mma::Q6U>(ws, in, x, n, xbuf, scratch);
  if (nm == "Q6_K_T") return dispatch<mma::Q6T>(ws, in, x, n, xbuf, scratch);
  if (nm == "Q4_K_T") return dispatch<mma::Q4T>(ws, in, x, n, xbuf, scratch);
  if (nm == "Q5_K_T") return dispatch<mma::Q5T>(ws, in, x, n, xbuf, scratch);
  return dispatch<mma::Q8U>(ws, in, x, n, xbuf, scratch);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string variant = argc > 1 ? argv[1] : "default";
  const double target_ms = argc > 2 ? std::atof(argv[2]) : 20.0;  // per timed repetition
  const char* only = std::getenv("SWEEP_FORMAT");                  // formats "A,B" (for ncu: one), else all
  std::mt19937_64 rng(1234);
  // (out, in, weights in the group): the 27B's FFN gate (one), gate + up (one grouped launch), down.
  struct Shape { int64_t out, in; int group; };
  std::vector<Shape> shapes = {{17408, 5120, 1}, {17408, 5120, 2}, {5120, 17408, 1}};
  if (const char* sp = std::getenv("SWEEP_SHAPES")) {  // "OUTxIN[xGROUP],...": these shapes instead
    shapes.clear();
    const auto bad = [sp] {
      std::fprintf(stderr, "SWEEP_SHAPES: OUTxIN[xGROUP],... (OUT a multiple of 16 up to %lld, IN a multiple of 256 up "
                   "to %lld, GROUP 1..%d), got \"%s\"\n", (long long)kMaxShapeOut, (long long)kMaxShapeIn,
                   mma::kMaxGroup, sp);
      return 2;
    };
    for (const char* p = sp; *p;) {
      char* end;
      const long long out = std::strtoll(p, &end, 10);
      if (end == p || *end != 'x') return bad();
      p = end + 1;
      const long long in = std::strtoll(p, &end, 10);
      long long group = 1;
      if (end == p) return bad();
      p = end;
      if (*p == 'x') {
        group = std::strtoll(p + 1, &end, 10);
        if (end == p + 1) return bad();
        p = end;
      }
      if (out < 16 || out % 16 || out > kMaxShapeOut || in < 256 || in % 256 || in > kMaxShapeIn || group < 1 ||
          group > mma::kMaxGroup || (*p && *p != ','))
        return bad();
      shapes.push_back({out, in, int(group)});
      p += *p == ',';
    }
    if (shapes.empty()) return bad();
  }
  // SWEEP_HOT=1: one copy of the weights, so a call's weights stay in L2 when they fit (50 MB): the GEMV's time
  // without HBM, against the rotated copies' (the default) with it.
  const char* hot_env = std::getenv("SWEEP_HOT");
  const bool hot = hot_env && std::string(hot_env) == "1";
  std::vector<int> widths = {1, 2, 4, 8, 10, 12, 16};  // 1, 1, 2, 3, 4, 5, 6 tiles
  if (const char* w = std::getenv("SWEEP_WIDTHS")) {   // e.g. "8" or "1,8" (for ncu: the first launches' width)
    widths.clear();
    for (const char* p = w; *p;) {
      char* end;
      const long n = std::strtol(p, &end, 10);
      if (end == p || n < 1 || n > 16) {
        std::fprintf(stderr, "SWEEP_WIDTHS: widths 1..16 separated by commas, got \"%s\"\n", w);
        return 2;
      }
      widths.push_back(int(n));
      p = *end == ',' ? end + 1 : end;
    }
  }
  const double copy = copy_gbps();  // (after the settings are checked: a bad one costs no GPU time)
  std::printf("# variant %s copy_GBps %.1f\n", variant.c_str(), copy);
  uint8_t *xbuf, *scratch;
  float* x;
  CK(cudaMalloc(&xbuf, 16 << 20));
  CK(cudaMalloc(&scratch, kScratchBytes));
  CK(cudaMalloc(&x, 16 * kMaxShapeIn * sizeof(float)));
  {
    std::vector<float> hx(16 * kMaxShapeIn);
    std::normal_distribution<float> nd;
    for (float& v : hx) v = nd(rng);
    CK(cudaMemcpy(x, hx.data(), hx.size() * sizeof(float), cudaMemcpyHostToDevice));
  }
  for (const Format& f : kFormats) {
    if (only && (std::string(",") + only + ",").find(std::string(",") + f.name + ",") == std::string::npos) continue;
    for (const Shape& sh : shapes) {
      const int64_t row_bytes = sh.in / f.block_elems * f.block_bytes, wbytes = sh.out * row_bytes;
      const int64_t tile_unit = 16 * f.block_bytes;  // every tiled layout keeps the bytes of its 16 rows
      const int64_t dev_bytes = f.tiled ? sh.out / 16 * (sh.in / 256) * tile_unit : wbytes;
      const int64_t call_bytes = dev_bytes * sh.group;
      const int copies = hot ? 1 : int(std::max<int64_t>(1, (240ll << 20) / call_bytes + 1));  // > 4x the 50 MB L2
      std::vector<uint8_t> host(static_cast<size_t>(wbytes));
      std::mt19937_64 wrng(uint64_t(sh.out) * 1000003u + uint64_t(sh.in) * 31u + uint64_t(f.block_bytes));
      for (size_t i = 0; i < host.size(); i += 8) {
        const uint64_t r = wrng();
        std::memcpy(host.data() + i, &r, std::min<size_t>(8, host.size() - i));
      }
      for (int64_t b = 0; b < wbytes / f.block_bytes; ++b)
        for (int off : f.d_offsets) host[size_t(b * f.block_bytes + off)] = 0x00, host[size_t(b * f.block_bytes + off + 1)] = 0x20;
      std::vector<uint8_t*> bufs(static_cast<size_t>(copies * sh.group));
      for (auto& p : bufs) {
        CK(cudaMalloc(&p, size_t(std::max(wbytes, dev_bytes))));  // the row-major bytes first, then tiled in place
        CK(cudaMemcpy(p, host.data(), size_t(wbytes), cudaMemcpyHostToDevice));
      }
      if (f.tiled) tile(f, bufs, sh.out, sh.in, wbytes);  // 17408 and 5120 rows are whole tiles
      float* y;
      CK(cudaMalloc(&y, size_t(16 * sh.out * sh.group) * sizeof(float)));
      for (int n : widths) {
        std::vector<std::vector<mma::GroupWeight>> calls(static_cast<size_t>(copies));
        for (int c = 0; c < copies; ++c)
          for (int i = 0; i < sh.group; ++i)
            calls[size_t(c)].push_back({bufs[size_t(c * sh.group + i)], row_bytes, sh.out, y + int64_t(i) * 16 * sh.out});
        const int ncalls = std::max(10, int(target_ms * 1e-3 / (double(call_bytes) / 3e12)));
        const float us = median_us([&](int i) { run(f, calls[size_t(i % copies)], sh.in, x, n, xbuf, scratch); }, ncalls);
        run(f, calls[0], sh.in, x, n, xbuf, scratch);
        std::vector<float> hy(static_cast<size_t>(n * sh.out));
        CK(cudaMemcpy(hy.data(), y, hy.size() * sizeof(float), cudaMemcpyDeviceToHost));
        double sum = 0;
        for (float v : hy) sum += v;
        const double gbps = double(call_bytes) / (double(us) * 1e-6) / 1e9;
        std::printf("%s\t%s\t%lld\t%lld\t%d\t%d\t%.2f\t%.1f\t%.3f\t%.9g\n", variant.c_str(), f.name, (long long)sh.out,
                    (long long)sh.in, sh.group, n, us, gbps, gbps / copy, sum);
        std::fflush(stdout);
      }
      CK(cudaFree(y));
      for (auto p : bufs) CK(cudaFree(p));
    }
  }
  return 0;
}
