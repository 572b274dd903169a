// Standalone check and timing of the GPU top-k kernels (native/src/gpu/topk.cuh) on the GPU machine, no
// Python build needed: the launch of topk.cu (plan, chunk_max_kernel + select_kernel, or rounds_kernel)
// through the library's launch_kernel (PDL), outputs compared bit for bit with a host sort by the ranking
// (values and indices), then the time per call (CUDA events, median of 5 x 50 back-to-back calls, and the
// median of 50 calls each followed by a synchronize, wall clock) for the drafter's shapes.
//
// Build and run (repository root):
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90,code=sm_90 -I native/include -I native/src \
//     -o /tmp/topk_check tools/device/topk_check.cu && /tmp/topk_check
// Exit status 0 when every case matched.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "bench_util.cuh"
#include "gpu/topk.cuh"

namespace specd::gpu::detail {
// runtime.cu's, for launch_kernel (this harness links no library)
void throw_runtime_error(cudaError_t err, const char* call, const char* file, int line) {
  std::fprintf(stderr, "%s failed at %s:%d: %s\n", call, file, line, cudaGetErrorString(err));
  std::exit(2);
}
}  // namespace specd::gpu::detail

namespace tk = specd::gpu::detail::topk;

static bool host_better(float a, int ia, float b, int ib) {
  const bool na = std::isnan(a), nb = std::isnan(b);
  if (na || nb) return na && (!nb || ia < ib);
  return a > b || (a == b && ia < ib);
}

struct Buffers {
  float* x = nullptr;
  float* vals = nullptr;
  int32_t* idx = nullptr;
  uint64_t* maxk = nullptr;
};

// topk.cu's launch (force_rounds: rounds_kernel whatever the plan).
static void launch(const Buffers& b, int64_t n, int64_t V, int64_t k, bool force_rounds) {
  const tk::Plan p = tk::plan(V, k);
  if (!p.split || force_rounds) {
    specd::gpu::detail::launch_kernel<tk::rounds_kernel>("rounds_kernel", unsigned(n), tk::kRoundThreads, 0, 0, b.x, V,
                                                         k, b.vals, b.idx);
    return;
  }
  specd::gpu::detail::launch_kernel<tk::chunk_max_kernel>("chunk_max_kernel", unsigned(n * p.chunks), tk::kMaxThreads,
                                                          0, 0, b.x, V, p.chunks, p.lg, b.maxk);
  specd::gpu::detail::launch_kernel<tk::select_kernel>("select_kernel", unsigned(n), tk::kSelThreads, 0, 0, b.x, V, k,
                                                       p.chunks, p.lg, static_cast<const uint64_t*>(b.maxk), b.vals,
                                                       b.idx);
}

static Buffers alloc_buffers(int64_t n, int64_t V, int64_t k) {
  Buffers b;
  CK(cudaMalloc(&b.x, size_t(n * V) * 4));
  CK(cudaMalloc(&b.vals, size_t(n * k) * 4));
  CK(cudaMalloc(&b.idx, size_t(n * k) * 4));
  CK(cudaMalloc(&b.maxk, size_t(n * tk::kMaxChunks) * 8));
  return b;
}
static void free_buffers(Buffers& b) {
  CK(cudaFree(b.x));
  CK(cudaFree(b.vals));
  CK(cudaFree(b.idx));
  CK(cudaFree(b.maxk));
}

// kind 0: normal; 1: specials (NaN, inf, -0.0, ties); 2: mostly -inf; 3: all equal.
static std::vector<float> make_input(std::mt19937& g, int64_t n, int64_t V, int kind) {
  std::normal_distribution<float> nd;
  std::vector<float> x(size_t(n * V));
  for (auto& v : x) v = nd(g);
  std::uniform_int_distribution<int64_t> pos(0, V - 1);
  for (int64_t r = 0; r < n; ++r) {
    float* row = x.data() + r * V;
    if (kind == 1) {
      for (int i = 0; i < 3; ++i) row[pos(g)] = NAN;
      row[pos(g)] = INFINITY;
      row[pos(g)] = -INFINITY;
      const float top = *std::max_element(row, row + V);
      for (int i = 0; i < 20; ++i) row[pos(g)] = top;
    } else if (kind == 2) {
      for (int64_t j = 0; j < V; ++j) row[j] = -INFINITY;
      for (int i = 0; i < 5; ++i) row[pos(g)] = nd(g);
    } else if (kind == 3) {
      for (int64_t j = 0; j < V; ++j) row[j] = (r % 2) ? -0.0f : 0.0f;
      row[pos(g)] = 0.0f;
    }
  }
  return x;
}

static bool check_case(std::mt19937& g, int64_t n, int64_t V, int64_t k, int kind, bool force_rounds) {
  std::vector<float> x = make_input(g, n, V, kind);
  Buffers b = alloc_buffers(n, V, k);
  CK(cudaMemcpy(b.x, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(b.idx, 0xff, size_t(n * k) * 4));
  launch(b, n, V, k, force_rounds);
  CK(cudaDeviceSynchronize());
  std::vector<float> vals(size_t(n * k));
  std::vector<int32_t> idx(size_t(n * k));
  CK(cudaMemcpy(vals.data(), b.vals, vals.size() * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(idx.data(), b.idx, idx.size() * 4, cudaMemcpyDeviceToHost));
  free_buffers(b);
  std::vector<int> ord(static_cast<size_t>(V));
  for (int64_t r = 0; r < n; ++r) {
    const float* row = x.data() + r * V;
    for (int64_t j = 0; j < V; ++j) ord[size_t(j)] = int(j);
    std::partial_sort(ord.begin(), ord.begin() + k, ord.end(),
                      [&](int a, int c) { return host_better(row[a], a, row[c], c); });
    for (int64_t i = 0; i < k; ++i) {
      const int want = ord[size_t(i)];
      uint32_t gb, wb;
      std::memcpy(&gb, &vals[size_t(r * k + i)], 4);
      std::memcpy(&wb, &row[want], 4);
      if (idx[size_t(r * k + i)] != want || gb != wb) {
        std::printf("MISMATCH n=%lld V=%lld k=%lld kind=%d rounds=%d row %lld pos %lld: got (%d, %08x) want (%d, %08x)\n",
                    (long long)n, (long long)V, (long long)k, kind, int(force_rounds), (long long)r, (long long)i,
                    idx[size_t(r * k + i)], gb, want, wb);
        return false;
      }
    }
  }
  return true;
}

static void time_case(int64_t n, int64_t V, int64_t k, bool force_rounds) {
  std::mt19937 g(7);
  std::vector<float> x = make_input(g, n, V, 0);
  Buffers b = alloc_buffers(n, V, k);
  CK(cudaMemcpy(b.x, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
  const int calls = force_rounds ? 5 : 50;
  const float us = median_us([&](int) { launch(b, n, V, k, force_rounds); }, calls);
  std::vector<double> wall;
  for (int i = 0; i < calls; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    launch(b, n, V, k, force_rounds);
    CK(cudaDeviceSynchronize());
    wall.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(wall.begin(), wall.end());
  const tk::Plan p = tk::plan(V, k);
  std::printf("time n=%lld V=%lld k=%lld path=%s lg=%d chunks=%lld: %.2f us/call back-to-back, %.2f us launch+sync\n",
              (long long)n, (long long)V, (long long)k, (force_rounds || !p.split) ? "rounds" : "split", p.lg,
              (long long)p.chunks, us, wall[wall.size() / 2]);
  free_buffers(b);
}

int main() {
  std::mt19937 g(1234);
  int ok = 0, bad = 0;
  const int64_t rows[] = {1, 3, 8, 17};
  const int64_t Vs[] = {1, 7, 256, 257, 4096, 4097, 20000, 248320};
  const int64_t ks[] = {1, 16, 64, -1};
  for (int64_t n : rows)
    for (int64_t V : Vs)
      for (int64_t k0 : ks) {
        const int64_t k = k0 < 0 ? V : k0;
        if (k > V || (k == V && V > 4097) || (n == 17 && V == 248320)) continue;
        for (int kind = 0; kind < 4; ++kind) (check_case(g, n, V, k, kind, false) ? ok : bad)++;
        if (V <= 4097 && tk::plan(V, k).split) (check_case(g, n, V, k, 1, true) ? ok : bad)++;
      }
  std::printf("checks: %d ok, %d mismatched\n", ok, bad);
  time_case(8, 248320, 16, false);
  time_case(1, 248320, 16, false);
  time_case(1, 248320, 64, false);
  time_case(8, 248320, 1, false);
  time_case(8, 248320, 64, false);
  time_case(32, 248320, 16, false);
  time_case(8, 248320, 16, true);
  return bad == 0 ? 0 : 1;
}
