// The kernels of the row-wise top-k (topk.cu): the k best (value, index) pairs of each row of x F32 [n, V]
// under the argmax ranking (ranking.cuh: larger value first, NaN above every number, -0.0 == +0.0, ties by
// lower index), best first, written to vals F32 [n, k] (the entries' own bits) and idx I32 [n, k]. Also
// compiled for the host by the emulation harness (tests/gpu/host_emu/topk_main.cpp).
//
// Split path (plan(V, k).split, i.e. k <= the row's chunk count), two launches:
//   chunk_max_kernel, one block per (row, chunk of C = 2^lg entries): the chunk's best rank_key -> maxk.
//   select_kernel, one block per row: tau = the k-th best of the row's chunk maxima. Exactly k chunks have
//     a maximum >= tau and every other entry of the row is < tau, so the row's top k are among the entries
//     >= tau of those k chunks (and there are at least k of them: the k maxima). The block scans those k
//     chunks (k C entries), gathers the entries >= tau in shared memory and writes each one whose rank
//     (the number of candidates with a larger key) is < k to position rank. When more than kCandCap
//     entries are >= tau (many ties at the k-th value, e.g. a row of mostly -inf), k selection rounds
//     over the k chunks do it instead (round r: the largest key below round r - 1's).
// The keys are distinct (the index is in them) and totally ordered as the ranking, so either way the
// result is exactly the row's top k, whatever C is: bit-identical to cpu::topk, and a row's result
// depends on that row alone. C depends only on (V, k): at least kChunksPerK k chunks when V allows (so
// the k chunks the select kernel scans are at most ~1/8 of the row), C in [256, 4096] unless the row
// has more than kMaxChunks chunks of 4096. Work: one read of the row plus k C entries per row, instead
// of the k reads of rounds_kernel (627 us for [8, 248320], k = 16, on an H200).
// Otherwise (k > chunks: k close to V) rounds_kernel: one block per row, k selection rounds over the row,
// O(k V).
#pragma once

#ifndef SPECD_HOST_EMU
#include "common.cuh"
#endif

#include <climits>
#include <cstdint>

#include "pdl.cuh"
#include "ranking.cuh"

namespace specd::gpu::detail::topk {

constexpr int kRoundThreads = 512;    // rounds_kernel
constexpr int kMaxThreads = 256;      // chunk_max_kernel
constexpr int kSelThreads = 1024;     // select_kernel
constexpr int kMinLg = 8, kMaxLg = 12;  // C in [256, 4096] (larger only past kMaxChunks chunks)
constexpr int64_t kChunksPerK = 8;
constexpr int kMaxChunks = 1024;  // a row's chunk maxima: one per select_kernel thread, in shared memory
constexpr int kCandCap = 1024;    // candidates select_kernel ranks in shared memory
static_assert(kMaxChunks <= kSelThreads, "select_kernel ranks one chunk maximum per thread");
static_assert(kSelThreads / SPECD_WARP == SPECD_WARP, "select_kernel reduces its warps' results in one warp");
static_assert((int64_t(1) << kMinLg) % kMaxThreads == 0, "a chunk is whole rows of chunk_max_kernel's block");

// How a row of V entries is cut for top-k (V in [1, INT32_MAX], k in [1, V]): chunks of 2^lg entries,
// the last one short. split: the two-kernel path applies (k <= chunks).
struct Plan {
  int lg;
  int64_t chunks;
  bool split;
};
inline Plan plan(int64_t V, int64_t k) {
  int lg = kMaxLg;
  while (lg > kMinLg && (V >> lg) < kChunksPerK * k) --lg;
  while (((V + (int64_t(1) << lg) - 1) >> lg) > kMaxChunks) ++lg;  // ends by lg = 21 for V <= INT32_MAX
  const int64_t chunks = (V + (int64_t(1) << lg) - 1) >> lg;
  return Plan{lg, chunks, k <= chunks};
}

__device__ __forceinline__ uint64_t key_max(uint64_t a, uint64_t b) { return a > b ? a : b; }

// The largest key of the logical warp's lanes, in every lane (two 32-bit shuffles: every backend and
// the host emulation shuffle 32-bit values).
__device__ __forceinline__ uint64_t warp_max_key(uint64_t v) {
#pragma unroll
  for (int m = SPECD_WARP / 2; m > 0; m >>= 1) {
    const uint32_t hi = uint32_t(SPECD_SHFL_XOR(int(uint32_t(v >> 32)), m));
    const uint32_t lo = uint32_t(SPECD_SHFL_XOR(int(uint32_t(v)), m));
    v = key_max(v, (uint64_t(hi) << 32) | lo);
  }
  return v;
}

// The largest key of a block of THREADS threads (every thread calls it), in every thread. red: shared,
// THREADS / SPECD_WARP slots; out: one shared slot. Ends with a barrier, so red and out may be reused.
template <int THREADS>
__device__ __forceinline__ uint64_t block_max_key(uint64_t v, uint64_t* red, uint64_t* out) {
  static_assert(THREADS / SPECD_WARP <= SPECD_WARP, "one warp reduces the warps' results");
  const int lane = int(threadIdx.x) % SPECD_WARP, warp = int(threadIdx.x) / SPECD_WARP;
  v = warp_max_key(v);
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = warp_max_key(lane < THREADS / SPECD_WARP ? red[lane] : 0);
    if (lane == 0) *out = v;
  }
  __syncthreads();
  return *out;
}

// maxk[r * chunks + c] = the largest rank_key of x[r, c C .. min(V, (c + 1) C)), C = 2^lg. Grid: n chunks
// blocks (block b: row b / chunks, chunk b % chunks), kMaxThreads threads.
__global__ void __launch_bounds__(kMaxThreads) chunk_max_kernel(const float* __restrict__ x, int64_t V, int64_t chunks,
                                                                int lg, uint64_t* __restrict__ maxk) {
  detail::pdl_enter();
  __shared__ uint64_t red[kMaxThreads / SPECD_WARP];
  __shared__ uint64_t out;
  const int64_t b = blockIdx.x, r = b / chunks, c = b % chunks;
  const float* row = x + r * V;
  const int64_t j0 = c << lg, j1 = V < j0 + (int64_t(1) << lg) ? V : j0 + (int64_t(1) << lg);
  uint64_t best = 0;  // no entry (a chunk has at least one)
#pragma unroll 4
  for (int64_t j = j0 + threadIdx.x; j < j1; j += kMaxThreads) best = key_max(best, rank_key(row[j], int32_t(j)));
  best = block_max_key<kMaxThreads>(best, red, &out);
  if (threadIdx.x == 0) maxk[b] = best;
}

// The top k of row blockIdx.x from its chunk maxima (maxk [n, chunks], chunk_max_kernel's), k <= chunks
// <= kMaxChunks. Grid: n blocks of kSelThreads threads. See the header comment. (Min 1 block per SM: without
// it ptxas aims at 2 blocks of 1024 threads, 32 registers, and spills.)
__global__ void __launch_bounds__(kSelThreads, 1) select_kernel(const float* __restrict__ x, int64_t V, int64_t k,
                                                             int64_t chunks, int lg, const uint64_t* __restrict__ maxk,
                                                             float* __restrict__ vals, int32_t* __restrict__ idx) {
  detail::pdl_enter();
  __shared__ uint64_t smax[kMaxChunks];
  __shared__ int32_t chunk_of_rank[kMaxChunks];  // [0, k): the chunk whose maximum ranks r-th
  __shared__ uint64_t cand[kCandCap];
  __shared__ uint64_t red[kSelThreads / SPECD_WARP];
  __shared__ uint64_t tau_s, best_s;
  __shared__ int ncand;
  const int64_t r = blockIdx.x;
  const int t = int(threadIdx.x);
  const float* row = x + r * V;
  float* vout = vals + r * k;
  int32_t* iout = idx + r * k;

  if (t < chunks) smax[t] = maxk[r * chunks + t];
  if (t == 0) ncand = 0;
  __syncthreads();
  // Rank of each chunk maximum among the row's: g threads per maximum (g a power of two <= SPECD_WARP,
  // so a maximum's threads are adjacent lanes of one warp), each counting every g-th maximum.
  {
    int g = 1;
    while (g < SPECD_WARP && int64_t(2 * g) * chunks <= kSelThreads) g *= 2;
    const int64_t m = t / g;
    const uint64_t mine = m < chunks ? smax[m] : 0;
    int cnt = 0;
    if (m < chunks)
      for (int64_t j = t % g; j < chunks; j += g) cnt += smax[j] > mine;
    for (int s = 1; s < g; s *= 2) cnt += SPECD_SHFL_XOR(cnt, s);  // every lane: g is the block's
    if (m < chunks && t % g == 0 && cnt < k) {
      chunk_of_rank[cnt] = int32_t(m);
      if (cnt == k - 1) tau_s = mine;
    }
  }
  __syncthreads();
  const uint64_t tau = tau_s;
  const int64_t span = k << lg, cmask = (int64_t(1) << lg) - 1;  // the k chunks' entries (the last may be short)

  // Candidates: the entries >= tau of the k chunks (order unimportant: placed by rank below).
  for (int64_t e = t; e < span; e += kSelThreads) {
    const int64_t j = (int64_t(chunk_of_rank[e >> lg]) << lg) + (e & cmask);
    if (j >= V) continue;
    const uint64_t key = rank_key(row[j], int32_t(j));
    if (key >= tau) {
      const int p = atomicAdd(&ncand, 1);
      if (p < kCandCap) cand[p] = key;
    }
  }
  __syncthreads();
  const int n = ncand;  // >= k
  if (n <= kCandCap) {
    for (int c = t; c < n; c += kSelThreads) {
      const uint64_t key = cand[c];
      int rank = 0;
      for (int j = 0; j < n; ++j) rank += cand[j] > key;
      if (rank < k) {
        const int32_t i = key_index(key);
        vout[rank] = row[i];
        iout[rank] = i;
      }
    }
    return;  // n is the block's: every thread returns here
  }
  // Too many candidates for shared memory: k rounds over the k chunks.
  uint64_t prev = 0;
  for (int64_t round = 0; round < k; ++round) {
    uint64_t best = 0;
    for (int64_t e = t; e < span; e += kSelThreads) {
      const int64_t j = (int64_t(chunk_of_rank[e >> lg]) << lg) + (e & cmask);
      if (j >= V) continue;
      const uint64_t key = rank_key(row[j], int32_t(j));
      if (key >= tau && (round == 0 || key < prev)) best = key_max(best, key);
    }
    prev = block_max_key<kSelThreads>(best, red, &best_s);
    if (t == 0) {
      const int32_t i = key_index(prev);
      vout[round] = row[i];
      iout[round] = i;
    }
  }
}

// The top k of row blockIdx.x by k selection rounds over the whole row (any k in [1, V]): round r finds
// the best entry ranked strictly below round r - 1's pick (the r-th best, the ranking being a strict total
// order). Grid: n blocks of kRoundThreads threads. O(k V) reads per row: the path for k > chunks.
__global__ void __launch_bounds__(kRoundThreads) rounds_kernel(const float* __restrict__ x, int64_t V, int64_t k,
                                                               float* __restrict__ vals, int32_t* __restrict__ idx) {
  detail::pdl_enter();
  __shared__ uint64_t red[kRoundThreads / SPECD_WARP];
  __shared__ uint64_t best_s;
  const int64_t r = blockIdx.x;
  const float* row = x + r * V;
  uint64_t prev = 0;
  for (int64_t round = 0; round < k; ++round) {
    uint64_t best = 0;
    for (int64_t j = threadIdx.x; j < V; j += kRoundThreads) {
      const uint64_t key = rank_key(row[j], int32_t(j));
      if (round == 0 || key < prev) best = key_max(best, key);
    }
    prev = block_max_key<kRoundThreads>(best, red, &best_s);
    if (threadIdx.x == 0) {
      const int32_t i = key_index(prev);
      vals[r * k + round] = row[i];
      idx[r * k + round] = i;
    }
  }
}

}  // namespace specd::gpu::detail::topk
