// Work splitting for the CPU backend. Each index range is processed by exactly one thread, and ops
// never split a reduction across threads, so results do not depend on the thread count or on how
// many rows share a call (batch invariance, required for lossless speculative decoding).
#pragma once
#include <algorithm>
#include <cstdint>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace specd {

int num_threads();
void set_num_threads(int n);

// Calls f(begin, end) over [0, n) in chunks of at least `grain` indices, in parallel.
template <class F>
void parallel_for(int64_t n, int64_t grain, F&& f) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  int64_t chunks = std::min<int64_t>((n + grain - 1) / grain, int64_t(num_threads()) * 4);
  if (chunks <= 1) {
    f(int64_t(0), n);
    return;
  }
  int64_t step = (n + chunks - 1) / chunks;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads())
  for (int64_t c = 0; c < chunks; ++c) {
    int64_t b = c * step, e = std::min(n, b + step);
    if (b < e) f(b, e);
  }
}

}  // namespace specd
