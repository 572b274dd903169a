#include "specd/parallel.h"

#include <atomic>
#include <thread>

namespace specd {

namespace {
int default_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}
std::atomic<int> g_threads{0};
}  // namespace

int num_threads() {
  int n = g_threads.load(std::memory_order_relaxed);
  return n > 0 ? n : default_threads();
}

void set_num_threads(int n) { g_threads.store(n > 0 ? n : 0, std::memory_order_relaxed); }

}  // namespace specd
