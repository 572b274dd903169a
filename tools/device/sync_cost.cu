// What one dependency between two steps of GPU work costs on this GPU (issue 7). A decode step of
// the 27B is ~1100 dependent kernels, most of them latency-bound, so the price of a kernel boundary
// bounds what fusing kernels (a persistent per-layer decode kernel) could save per step.
//
// Times a chain of P dependent phases. A phase is a trivial cross-block exchange: every thread reads
// the value a thread of another block (of its own block in a grid of one) wrote in the phase before,
// adds 1 and writes its own. The
// phases are separated by:
//   launch      one kernel per phase, launched on a stream (<<<>>>)
//   launch+pdl  one kernel per phase, a programmatic dependent of the one before (cudaLaunchKernelEx
//               with programmatic stream serialization; griddepcontrol.launch_dependents, then
//               griddepcontrol.wait at the kernel's start, as native/src/gpu/pdl.cuh launches specd's)
//   graph       the P plain launches captured in one CUDA graph, replayed
//   graph+pdl   the P programmatic launches in one CUDA graph (how specd replays a decode step)
//   grid.sync   one cooperative kernel, cooperative_groups::this_grid().sync() between phases
//   barrier     one cooperative kernel, a hand-rolled grid barrier between phases: each block's thread
//               0 fences and adds 1 to a monotonic arrival counter, then spins with acquire loads until
//               every block of this phase arrived
// at grids of 1 block, one block per SM, and 2 and 4 blocks per SM (256 threads a block).
//
// Every run is checked: after P phases every element must equal P (a phase that read a value before
// the phase before it had written it would leave a smaller one), so a separation that does not order
// memory fails the run (exit status 1) instead of timing as fast.
//
// Usage: sync_cost [phases=1000]. Prints a markdown table: microseconds per phase (the chain's time
// over P; median of 5 timed runs after one warm-up), which is a boundary's cost plus a phase's tiny work.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "bench_util.cuh"

namespace cg = cooperative_groups;

constexpr int kThreads = 256;

// One phase's work for element i of n: read the element half the grid plus one further on (another
// block's, but for a grid of one block), add 1.
__device__ __forceinline__ void exchange(const float* in, float* out, int n, int shift) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  out[i] = in[(i + shift) % n] + 1.0f;
}

template <bool PDL>
__global__ void phase_kernel(const float* __restrict__ in, float* __restrict__ out, int n, int shift) {
  if (PDL) asm volatile("griddepcontrol.launch_dependents;\n\tgriddepcontrol.wait;" ::: "memory");
  exchange(in, out, n, shift);
}

// All blocks of the grid have reached the barrier of phase p (0-based) and their writes before it
// are visible to every block after it. `arrived` counts arrivals over the whole kernel (zeroed
// before the launch), so phase p waits for gridDim.x * (p + 1) of them and nothing is ever reset.
__device__ __forceinline__ void grid_barrier(unsigned* arrived, unsigned p) {
  __syncthreads();  // the block's writes happen before thread 0's fence (bar.sync is cumulative)
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(arrived, 1u);
    const unsigned target = gridDim.x * (p + 1);
    unsigned seen;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(arrived) : "memory");
    } while (seen < target);
  }
  __syncthreads();
}

// P phases in one kernel, ping-ponging between a and b. GRID_SYNC: cooperative groups' grid sync,
// else grid_barrier. Needs a cooperative launch (every block resident).
template <bool GRID_SYNC>
__global__ void persistent_kernel(float* a, float* b, int n, int shift, int phases, unsigned* arrived) {
  for (int p = 0; p < phases; ++p) {
    exchange(p & 1 ? b : a, p & 1 ? a : b, n, shift);
    if (GRID_SYNC)
      cg::this_grid().sync();
    else
      grid_barrier(arrived, unsigned(p));
  }
}

struct Chain {
  float *a = nullptr, *b = nullptr;
  unsigned* arrived = nullptr;
  int blocks = 0, n = 0, shift = 0, phases = 0;
  cudaStream_t s = nullptr;

  void reset() const {
    CK(cudaMemsetAsync(a, 0, sizeof(float) * size_t(n), s));
    CK(cudaMemsetAsync(b, 0, sizeof(float) * size_t(n), s));
    CK(cudaMemsetAsync(arrived, 0, sizeof(unsigned), s));
  }
  // The P phase kernels (a -> b, b -> a, ...) on s, plain or as programmatic dependents.
  void launches(bool pdl) const {
    for (int p = 0; p < phases; ++p) {
      const float* in = p & 1 ? b : a;
      float* out = p & 1 ? a : b;
      if (!pdl) {
        phase_kernel<false><<<blocks, kThreads, 0, s>>>(in, out, n, shift);
        CK(cudaGetLastError());
        continue;
      }
      cudaLaunchAttribute attr{};
      attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr.val.programmaticStreamSerializationAllowed = 1;
      cudaLaunchConfig_t cfg{};
      cfg.gridDim = dim3(blocks);
      cfg.blockDim = dim3(kThreads);
      cfg.stream = s;
      cfg.attrs = &attr;
      cfg.numAttrs = 1;
      CK(cudaLaunchKernelEx(&cfg, phase_kernel<true>, in, out, n, shift));
    }
  }
  void persistent(bool grid_sync) const {
    float *pa = a, *pb = b;
    int nn = n, sh = shift, ph = phases;
    unsigned* arr = arrived;
    void* args[] = {&pa, &pb, &nn, &sh, &ph, &arr};
    const void* fn = grid_sync ? reinterpret_cast<const void*>(persistent_kernel<true>)
                               : reinterpret_cast<const void*>(persistent_kernel<false>);
    CK(cudaLaunchCooperativeKernel(fn, dim3(blocks), dim3(kThreads), args, 0, s));
  }
  // Every element of the last phase's output equals the number of phases.
  bool correct() const {
    std::vector<float> h(static_cast<size_t>(n));
    CK(cudaStreamSynchronize(s));
    CK(cudaMemcpy(h.data(), phases & 1 ? b : a, sizeof(float) * h.size(), cudaMemcpyDeviceToHost));
    return std::all_of(h.begin(), h.end(), [&](float v) { return v == float(phases); });
  }
};

// Microseconds per phase of run() (which enqueues the whole chain on c.s), the median of 5 timed runs
// after a warm-up; -1 when a run's result is wrong.
float time_per_phase(const Chain& c, const std::function<void()>& run) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> us;
  bool ok = true;
  for (int rep = 0; rep < 6; ++rep) {
    c.reset();
    CK(cudaEventRecord(e0, c.s));
    run();
    CK(cudaEventRecord(e1, c.s));
    CK(cudaEventSynchronize(e1));
    ok = ok && c.correct();
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    if (rep > 0) us.push_back(ms * 1e3f / float(c.phases));
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  std::sort(us.begin(), us.end());
  return ok ? us[us.size() / 2] : -1.0f;
}

float graph_per_phase(const Chain& c, bool pdl) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(c.s, cudaStreamCaptureModeThreadLocal));
  c.launches(pdl);
  CK(cudaStreamEndCapture(c.s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  const float us = time_per_phase(c, [&] { CK(cudaGraphLaunch(ge, c.s)); });
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  return us;
}

int main(int argc, char** argv) {
  const int phases = argc > 1 ? std::atoi(argv[1]) : 1000;
  if (phases < 1 || phases > 100000) {
    std::fprintf(stderr, "phases must be 1..100000, got %s\n", argv[1]);
    return 2;
  }
  int dev = 0, sms = 0, coop = 0, per_sm_sync = 0, per_sm_bar = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev));
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm_sync, persistent_kernel<true>, kThreads, 0));
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm_bar, persistent_kernel<false>, kThreads, 0));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, dev));
  const std::vector<int> grids = {1, sms, 2 * sms, 4 * sms};

  Chain c;
  c.phases = phases;
  CK(cudaStreamCreateWithFlags(&c.s, cudaStreamNonBlocking));
  const size_t most = size_t(grids.back()) * kThreads;
  CK(cudaMalloc(&c.a, sizeof(float) * most));
  CK(cudaMalloc(&c.b, sizeof(float) * most));
  CK(cudaMalloc(&c.arrived, sizeof(unsigned)));

  const char* modes[] = {"launch", "launch+pdl", "graph", "graph+pdl", "grid.sync", "barrier"};
  std::vector<std::vector<float>> us(6);
  bool all_ok = true;
  for (int blocks : grids) {
    c.blocks = blocks;
    c.n = blocks * kThreads;
    c.shift = c.n / 2 + 1;
    us[0].push_back(time_per_phase(c, [&] { c.launches(false); }));
    us[1].push_back(time_per_phase(c, [&] { c.launches(true); }));
    us[2].push_back(graph_per_phase(c, false));
    us[3].push_back(graph_per_phase(c, true));
    const bool fits_sync = coop && blocks <= per_sm_sync * sms, fits_bar = coop && blocks <= per_sm_bar * sms;
    us[4].push_back(fits_sync ? time_per_phase(c, [&] { c.persistent(true); }) : -2.0f);
    us[5].push_back(fits_bar ? time_per_phase(c, [&] { c.persistent(false); }) : -2.0f);
  }

  std::printf("%s, %d SMs; %d phases per chain, %d threads per block; us per phase (median of 5 runs)\n\n",
              prop.name, sms, phases, kThreads);
  std::printf("| separation |");
  for (int blocks : grids) std::printf(" %d block%s |", blocks, blocks > 1 ? "s" : "");
  std::printf("\n| --- |");
  for (size_t i = 0; i < grids.size(); ++i) std::printf(" --- |");
  std::printf("\n");
  for (int m = 0; m < 6; ++m) {
    std::printf("| %s |", modes[m]);
    for (float v : us[m]) {
      if (v == -2.0f)
        std::printf(" (not resident) |");
      else if (v < 0.0f)
        std::printf(" WRONG RESULT |");
      else
        std::printf(" %.2f |", v);
      all_ok = all_ok && v != -1.0f;
    }
    std::printf("\n");
  }
  CK(cudaFree(c.a));
  CK(cudaFree(c.b));
  CK(cudaFree(c.arrived));
  CK(cudaStreamDestroy(c.s));
  if (!all_ok) std::fprintf(stderr, "a chain's result was wrong: its separation does not order memory\n");
  return all_ok ? 0 : 1;
}
