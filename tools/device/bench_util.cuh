// Helpers of the standalone device benchmarks (gemv_sweep.cu, sync_cost.cu): a checked
// CUDA call, the median time per call of a launch sequence, and the device-to-device copy bandwidth they
// report their ratios to.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

// Runs a CUDA runtime call; on failure prints the call, place and error string and exits with 2.
#define CK(call)                                                                                             \
  do {                                                                                                       \
    cudaError_t e_ = (call);                                                                                 \
    if (e_ != cudaSuccess) {                                                                                 \
      std::fprintf(stderr, "%s failed at %s:%d: %s\n", #call, __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(2);                                                                                          \
    }                                                                                                        \
  } while (0)

// Microseconds per call of launch(i), i = 0 .. calls - 1, enqueued back to back on the default
// stream: the median of 5 repetitions timed with events, after 12 warm-up calls.
template <class Launch>
float median_us(const Launch& launch, int calls) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < 12; ++i) launch(i);
  std::vector<float> us;
  for (int rep = 0; rep < 5; ++rep) {
    CK(cudaEventRecord(e0));
    for (int i = 0; i < calls; ++i) launch(i);
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    us.push_back(ms * 1e3f / float(calls));
  }
  CK(cudaGetLastError());
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  std::sort(us.begin(), us.end());
  return us[2];
}

// Device-to-device copy bandwidth in GB/s (bytes read + written), copies of 1 GiB.
inline double copy_gbps() {
  const size_t bytes = size_t(1) << 30;
  void *a, *b;
  CK(cudaMalloc(&a, bytes));
  CK(cudaMalloc(&b, bytes));
  CK(cudaMemset(a, 1, bytes));
  const float us = median_us([&](int) { CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); }, 4);
  CK(cudaFree(a));
  CK(cudaFree(b));
  return 2.0 * double(bytes) / (double(us) * 1e-6) / 1e9;
}
