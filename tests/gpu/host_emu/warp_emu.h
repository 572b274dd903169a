// Host emulation of the CUDA execution model for the kernel harnesses in this folder (*_main.cpp: the
// tensor-core GEMV, the FP32-FMA GEMV, the attention kernels, the mask compaction, the chunked and step Gated DeltaNet, the
// causal conv, the top-k; each names the header it runs):
// a block runs as one std::thread per lane; the warp-wide instructions are emulated from the PTX ISA
// fragment layouts with one barrier per instruction: every lane publishes its operands in the warp's
// exchange slot of that instruction (two slots used in turn), waits at the warp barrier, then computes
// its own result from the published operands (a lane can only publish into a slot again after the next
// instruction's barrier, which every lane reaches after reading the slot). mma.sync m16n8k32 s8 -> s32
// (exact integers, as the hardware), mma.sync m16n8k16 f16 -> f32 (products exact, summed in double and
// rounded once), mma.sync m16n8k8 tf32 -> f32 (operands truncated to tf32, products exact, summed in double and
// rounded once), ldmatrix .x4 (and .trans), shuffles, __syncwarp, atomicAdd on an int; __syncthreads is a block barrier
// (and bar.sync id, count a named one: specd_emu_bar_sync),
// cp.async an immediate copy, __shared__ arrays are statics (one block at a time) and dynamic shared
// memory is specd_emu_dyn_smem (set by the harness). Thread-block clusters (emulate_clusters): a cluster's blocks
// run together, each with dynamic shared memory of its own, which cooperative_groups' cluster_group maps block to
// block (distributed shared memory) and synchronises with a cluster barrier.
#pragma once
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "portability.h"

#ifndef SPECD_HIP  // -DSPECD_HIP=1 builds a header's AMD path (e.g. gdn_chunked.cuh's FP32 state kernel)
#define SPECD_HIP 0
#endif
#define SPECD_HOST_EMU 1
#define SPECD_WARP 32
#define __global__
#define __launch_bounds__(...)
// One block at a time: a static array is the block's shared memory. Not in a cluster, whose blocks run at once
// (emulate_clusters): there the declaration aborts (specd_emu_static_shared_ok), as the blocks would share it.
inline bool specd_emu_static_shared_ok();
#define SPECD_EMU_CAT2(a, b) a##b
#define SPECD_EMU_CAT(a, b) SPECD_EMU_CAT2(a, b)
#define __shared__ \
  [[maybe_unused]] const bool SPECD_EMU_CAT(specd_emu_shared_ok_, __COUNTER__) = specd_emu_static_shared_ok(); static
#define __align__(n) __attribute__((aligned(n)))
inline void __trap() { std::abort(); }

struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};
thread_local Dim3 threadIdx, blockIdx;
thread_local Dim3 blockDim;

// IEEE binary16, round to nearest even (subnormals, overflow to inf, NaN kept), as __float2half_rn.
inline uint16_t f16_rn(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);                 // NaN
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);                // >= 65520: inf
  if (a >= 0x38800000u) {                                               // >= 2^-14: normal
    const uint32_t r = a + 0xfffu + ((a >> 13) & 1u);                   // round the 13 dropped bits
    return uint16_t(sign | ((r - 0x38000000u) >> 13));
  }
  float af;
  std::memcpy(&af, &a, 4);
  return uint16_t(sign | uint16_t(std::nearbyint(af * 16777216.0f)));  // subnormal: units of 2^-24
}
inline float f16_f(uint16_t h) { return specd_fp16_bits_to_float(h); }

struct __half {
  uint16_t v;
};
struct __half2 {
  uint16_t x, y;
};
inline __half __float2half_rn(float f) { return __half{f16_rn(f)}; }
inline float __half2float(__half h) { return f16_f(h.v); }
inline __half2 __floats2half2_rn(float a, float b) { return __half2{f16_rn(a), f16_rn(b)}; }
inline __half2 __hsub2(__half2 a, __half2 b) {
  return __half2{f16_rn(f16_f(a.x) - f16_f(b.x)), f16_rn(f16_f(a.y) - f16_f(b.y))};
}
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
template <class T>
inline T __ldg(const T* p) { return *p; }
inline uint2 make_uint2(uint32_t x, uint32_t y) { return uint2{x, y}; }
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return uint4{x, y, z, w}; }
struct float2 {
  float x, y;
};
inline float2 make_float2(float x, float y) { return float2{x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
using std::isfinite;
using std::isnan;
using std::max;
using std::min;

// Per-warp exchange: two slots used in turn (see the header comment).
struct WarpSlot {
  uint32_t a[32][4];
  uint32_t b[32][2];
  uint32_t sh[32];
  const uint16_t* p[32];
};
struct WarpShared {
  WarpSlot slot[2];
  std::unique_ptr<std::barrier<>> bar;
};
thread_local WarpShared* tl_warp = nullptr;
thread_local unsigned tl_phase = 0;  // warp instructions this lane has executed
thread_local std::barrier<>* tl_block = nullptr;
inline uint8_t* specd_emu_dyn_smem = nullptr;  // the block's dynamic shared memory (harness-owned)

// A running cluster (emulate_clusters): each block's dynamic shared memory and the cluster barrier.
struct ClusterShared {
  std::vector<uint8_t*> smem;
  size_t smem_bytes = 0;
  std::unique_ptr<std::barrier<>> bar;
};
thread_local ClusterShared* tl_cluster = nullptr;
thread_local unsigned tl_cluster_rank = 0;
thread_local uint8_t* tl_dyn_smem = nullptr;  // this block's, in a cluster
thread_local std::optional<std::barrier<>::arrival_token> tl_cluster_arrival;
thread_local bool tl_cluster_waited = false;  // a cluster barrier completed: every block of the cluster runs
thread_local bool tl_remote_unfenced = false;  // another block's memory mapped since this thread last arrived
// The calling thread's block's dynamic shared memory (dyn_smem.cuh).
inline uint8_t* specd_emu_block_smem() { return tl_dyn_smem ? tl_dyn_smem : specd_emu_dyn_smem; }
inline bool specd_emu_static_shared_ok() {
  if (tl_cluster) std::abort();  // a static __shared__ array in a cluster kernel: one for all of its blocks here
  return true;
}

// cooperative_groups' cluster_group (sm_90), as the cluster kernels use it, with the rules of distributed shared
// memory checked (abort): another block's memory is mapped (map_shared_rank: dynamic shared memory only, the same
// offset in block `rank`'s) only after a cluster barrier completed (every block then runs) and every such access
// is followed by an arrival of the thread at a cluster barrier (so the block waits there before it exits);
// an arrival is waited for before the next (barrier_arrive, then barrier_wait).
namespace cooperative_groups {
struct cluster_group {
  unsigned num_blocks() const { return unsigned(tl_cluster->smem.size()); }
  unsigned block_rank() const { return tl_cluster_rank; }
  void barrier_arrive() const {
    if (tl_cluster_arrival) std::abort();
    tl_remote_unfenced = false;
    tl_cluster_arrival.emplace(tl_cluster->bar->arrive());
  }
  void barrier_wait() const {
    if (!tl_cluster_arrival) std::abort();
    tl_cluster->bar->wait(std::move(*tl_cluster_arrival));
    tl_cluster_arrival.reset();
    tl_cluster_waited = true;
  }
  void sync() const {
    barrier_arrive();
    barrier_wait();
  }
  template <class T>
  T* map_shared_rank(T* p, int rank) const {
    const intptr_t off = reinterpret_cast<uint8_t*>(p) - tl_dyn_smem;
    if (!tl_cluster_waited || off < 0 || size_t(off) + sizeof(T) > tl_cluster->smem_bytes || rank < 0 ||
        rank >= int(num_blocks()))
      std::abort();
    tl_remote_unfenced = true;
    return reinterpret_cast<T*>(tl_cluster->smem[size_t(rank)] + off);
  }
};
inline cluster_group this_cluster() { return {}; }
}  // namespace cooperative_groups

// This lane's slot for its next warp instruction.
inline WarpSlot& next_slot() { return tl_warp->slot[tl_phase++ & 1u]; }

inline float half_of(uint32_t reg, int h) { return f16_f(uint16_t(h ? reg >> 16 : reg & 0xffffu)); }

// One warp-wide MMA: every lane publishes its A and B registers, then computes its four D elements
// (c0, c1 = row g, columns 2t, 2t+1; c2, c3 = row g + 8) as elem(row, col, d[c]) from the published
// fragments.
template <class T, class Elem>
inline void warp_mma(T (&d)[4], const uint32_t (&a)[4], uint2 b, const Elem& elem) {
  WarpSlot& w = next_slot();
  const int lane = int(threadIdx.x & 31), g = lane >> 2, t = lane & 3;
  for (int r = 0; r < 4; ++r) w.a[lane][r] = a[r];
  w.b[lane][0] = b.x, w.b[lane][1] = b.y;
  tl_warp->bar->arrive_and_wait();
  for (int c = 0; c < 4; ++c) d[c] = elem(w, g + 8 * (c >> 1), 2 * t + (c & 1), d[c]);
}

// m16n8k16 with 16-bit operands decoded by value(reg, half) -> f32, d += a * b: products exact, summed in
// double, rounded once (for bf16 an approximation of the hardware's internal summation and rounding;
// the f16 min terms' operands are small integers, so there the hardware's sums are exact too).
template <class Value>
inline void emu_mma_k16(float (&d)[4], const uint32_t (&a)[4], uint2 b, Value value) {
  warp_mma(d, a, b, [value](const WarpSlot& w, int row, int col, float acc) {
    double s = acc;
    for (int k = 0; k < 16; ++k) {
      // A (row, k): lane 4 (row % 8) + (k % 8) / 2, register (row >= 8) + 2 (k >= 8), half k & 1.
      const float av = value(w.a[4 * (row % 8) + (k % 8) / 2][(row >= 8) + 2 * (k >= 8)], k & 1);
      // B (k, col): lane 4 col + (k % 8) / 2, register k >= 8, half k & 1.
      const float bv = value(w.b[4 * col + (k % 8) / 2][k >= 8], k & 1);
      s += double(av) * double(bv);
    }
    return float(s);
  });
}
inline float bf16_of(uint32_t reg, int h) { return __uint_as_float(h ? reg & 0xffff0000u : reg << 16); }
inline void specd_emu_mma(float (&d)[4], const uint32_t (&a)[4], uint2 b) { emu_mma_k16(d, a, b, half_of); }
inline void specd_emu_mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint2 b) { emu_mma_k16(d, a, b, bf16_of); }

// m16n8k8 tf32 -> f32, d += a * b: each operand read as tf32 (its low 13 bits ignored, as the hardware reads
// them: truncated), products exact, a row's 8 products and the accumulator summed in double and rounded once
// to F32 (an approximation of the hardware's internal summation order and rounding).
inline float tf32_of(uint32_t reg) { return __uint_as_float(reg & 0xffffe000u); }
inline void specd_emu_mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint2 b) {
  warp_mma(d, a, b, [](const WarpSlot& w, int row, int col, float acc) {
    double s = acc;
    for (int k = 0; k < 8; ++k) {
      // A (row, k): lane 4 (row % 8) + k % 4, register (row >= 8) + 2 (k >= 4); B (k, col): lane 4 col + k % 4,
      // register k >= 4.
      const float av = tf32_of(w.a[4 * (row % 8) + k % 4][(row >= 8) + 2 * (k >= 4)]);
      const float bv = tf32_of(w.b[4 * col + k % 4][k >= 4]);
      s += double(av) * double(bv);
    }
    return float(s);
  });
}

inline int8_t byte_of(uint32_t reg, int i) { return int8_t(uint8_t(reg >> (8 * i))); }

// m16n8k32 s8 -> s32, d = a * b (C = 0): exact.
inline void specd_emu_imma(int (&d)[4], const uint32_t (&a)[4], uint2 b) {
  warp_mma(d, a, b, [](const WarpSlot& w, int row, int col, int) {
    int64_t s = 0;
    for (int k = 0; k < 32; ++k) {
      // A (row, k): lane 4 (row % 8) + (k % 16) / 4, register (row >= 8) + 2 (k >= 16), byte k % 4.
      const int av = byte_of(w.a[4 * (row % 8) + (k % 16) / 4][(row >= 8) + 2 * (k >= 16)], k % 4);
      // B (k, col): lane 4 col + (k % 16) / 4, register k >= 16, byte k % 4.
      const int bv = byte_of(w.b[4 * col + (k % 16) / 4][k >= 16], k % 4);
      s += int64_t(av) * bv;
    }
    return int(s);
  });
}

// ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16: lane 8 m + i gives the address of row i of matrix
// m; register m of lane 4 g + t = row g, elements 2t, 2t+1 (trans: rows 2t, 2t+1, element g), the
// first in the lower 16 bits.
inline void specd_emu_ldmatrix_x4(uint32_t (&r)[4], const uint16_t* p, bool trans) {
  WarpSlot& w = next_slot();
  const int lane = int(threadIdx.x & 31), g = lane >> 2, t = lane & 3;
  if ((reinterpret_cast<uintptr_t>(p) & 15u) != 0) std::abort();  // rows are 16-byte aligned
  w.p[lane] = p;
  tl_warp->bar->arrive_and_wait();
  for (int m = 0; m < 4; ++m) {
    uint16_t lo, hi;
    if (!trans) {
      lo = w.p[8 * m + g][2 * t];
      hi = w.p[8 * m + g][2 * t + 1];
    } else {
      lo = w.p[8 * m + 2 * t][g];
      hi = w.p[8 * m + 2 * t + 1][g];
    }
    r[m] = uint32_t(lo) | (uint32_t(hi) << 16);
  }
}

// cp.async 16 bytes (cp-size 16, src-size 16 or 0: zero fill): copied at once.
inline void specd_emu_cp_async16(uint16_t* dst, const uint8_t* src, bool valid) {
  if ((reinterpret_cast<uintptr_t>(dst) & 15u) != 0 || (reinterpret_cast<uintptr_t>(src) & 15u) != 0) std::abort();
  if (valid) std::memcpy(dst, src, 16);
  else std::memset(dst, 0, 16);
}
inline size_t __cvta_generic_to_shared(const void* p) { return reinterpret_cast<size_t>(p); }

// Warp exchange: every lane publishes v, then reads lane src's (every lane takes part, as in the kernel).
inline uint32_t exchange(uint32_t v, int src) {
  WarpSlot& w = next_slot();
  w.sh[threadIdx.x & 31] = v;
  tl_warp->bar->arrive_and_wait();
  return w.sh[src & 31];
}
inline uint32_t __shfl_sync(unsigned mask, uint32_t v, int src) {
  if (mask != 0xffffffffu) std::abort();
  return exchange(v, src);
}
inline float __shfl_xor_sync(unsigned mask, float v, int m) {
  if (mask != 0xffffffffu) std::abort();
  uint32_t u;
  std::memcpy(&u, &v, 4);
  u = exchange(u, int(threadIdx.x & 31) ^ m);
  std::memcpy(&v, &u, 4);
  return v;
}
inline int __shfl_xor_sync(unsigned mask, int v, int m) {
  if (mask != 0xffffffffu) std::abort();
  return int(exchange(uint32_t(v), int(threadIdx.x & 31) ^ m));
}
// A double as the hardware moves it: two 32-bit exchanges (low word, then high).
inline double __shfl_xor_sync(unsigned mask, double v, int m) {
  if (mask != 0xffffffffu) std::abort();
  uint64_t u;
  std::memcpy(&u, &v, 8);
  const uint64_t lo = exchange(uint32_t(u), int(threadIdx.x & 31) ^ m);
  const uint64_t hi = exchange(uint32_t(u >> 32), int(threadIdx.x & 31) ^ m);
  u = lo | hi << 32;
  std::memcpy(&v, &u, 8);
  return v;
}
#define SPECD_SHFL_XOR(v, lane_mask) __shfl_xor_sync(0xffffffffu, (v), (lane_mask))
// Lane l gets lane l - delta's v, or its own where l < delta.
inline int __shfl_up_sync(unsigned mask, int v, int delta) {
  if (mask != 0xffffffffu) std::abort();
  const int lane = int(threadIdx.x & 31), got = int(exchange(uint32_t(v), lane - delta));
  return lane >= delta ? got : v;
}
#define SPECD_SHFL_UP(v, delta) __shfl_up_sync(0xffffffffu, (v), (delta))
// atomicAdd on an int (shared memory in the kernels): a sequentially consistent fetch_add.
inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline void __syncwarp() {
  next_slot();  // an instruction without operands: keeps the lanes' slot turns aligned
  tl_warp->bar->arrive_and_wait();
}
inline void __syncthreads() { tl_block->arrive_and_wait(); }

// A block's named barriers (PTX bar.sync id, count: the first `count` threads to arrive at barrier `id` go on
// together; id 0 is __syncthreads'), a generation per id; arrivals with another count than the first's abort.
struct NamedBarriers {
  std::mutex mu;
  std::condition_variable cv;
  int arrived[16] = {}, count[16] = {};
  unsigned gen[16] = {};
};
thread_local NamedBarriers* tl_named = nullptr;
inline void specd_emu_bar_sync(int id, int count) {
  if (id < 1 || id > 15 || count < 32 || count % 32 != 0) std::abort();
  NamedBarriers& nb = *tl_named;
  std::unique_lock<std::mutex> lock(nb.mu);
  const unsigned gen = nb.gen[id];
  if (nb.arrived[id] == 0) nb.count[id] = count;
  if (nb.count[id] != count) std::abort();
  if (++nb.arrived[id] == count) {
    nb.arrived[id] = 0, ++nb.gen[id];
    nb.cv.notify_all();
  } else {
    nb.cv.wait(lock, [&] { return nb.gen[id] != gen; });
  }
}

// Runs fn() on `blocks` blocks of `threads` threads (warps of 32 with their exchange barrier, a block
// barrier), one block at a time (the kernels' __shared__ arrays are statics). before_block(b), when
// given, runs on the calling thread before block b starts (e.g. to poison shared memory).
template <class Fn, class Before>
void emulate(int64_t blocks, int threads, const Fn& fn, const Before& before_block) {
  for (int64_t b = 0; b < blocks; ++b) {
    before_block(b);
    std::vector<WarpShared> warps(size_t(threads / 32));
    for (auto& s : warps) s.bar = std::make_unique<std::barrier<>>(32);
    std::barrier<> block(threads);
    NamedBarriers named;
    std::vector<std::thread> th;
    for (int i = 0; i < threads; ++i)
      th.emplace_back([&, i] {
        threadIdx.x = unsigned(i), blockIdx.x = unsigned(b), blockDim.x = unsigned(threads);
        tl_warp = &warps[size_t(i / 32)];
        tl_phase = 0;
        tl_block = &block;
        tl_named = &named;
        fn();
      });
    for (auto& t : th) t.join();
  }
}
template <class Fn>
void emulate(int64_t blocks, int threads, const Fn& fn) {
  emulate(blocks, threads, fn, [](int64_t) {});
}

// Runs fn() on `clusters` clusters of `blocks` blocks (blockIdx.x = cluster * blocks + rank) of `threads` threads,
// a cluster's blocks at once (the clusters one after another), each block with its warps, its block barrier and
// smem_bytes of dynamic shared memory of its own, every byte `fill` (a poison) at the start. The kernel must not
// declare static __shared__ arrays (one per process here: the declaration aborts). A thread exiting with an
// arrival not waited for, or after mapping another block's memory without arriving at a barrier since, aborts.
template <class Fn>
void emulate_clusters(int64_t clusters, int blocks, int threads, size_t smem_bytes, uint8_t fill, const Fn& fn) {
  for (int64_t c = 0; c < clusters; ++c) {
    std::vector<std::vector<uint8_t>> mem(size_t(blocks), std::vector<uint8_t>(smem_bytes, fill));
    ClusterShared cluster;
    for (auto& m : mem) cluster.smem.push_back(m.data());
    cluster.smem_bytes = smem_bytes;
    cluster.bar = std::make_unique<std::barrier<>>(blocks * threads);
    std::vector<std::vector<WarpShared>> warps(static_cast<size_t>(blocks));
    std::vector<std::unique_ptr<std::barrier<>>> block_bars;
    std::vector<std::unique_ptr<NamedBarriers>> named;
    for (auto& wb : warps) {
      wb = std::vector<WarpShared>(size_t(threads / 32));
      for (auto& s : wb) s.bar = std::make_unique<std::barrier<>>(32);
      block_bars.push_back(std::make_unique<std::barrier<>>(threads));
      named.push_back(std::make_unique<NamedBarriers>());
    }
    std::vector<std::thread> th;
    for (int b = 0; b < blocks; ++b)
      for (int i = 0; i < threads; ++i)
        th.emplace_back([&, b, i] {
          threadIdx.x = unsigned(i), blockIdx.x = unsigned(c * blocks + b), blockDim.x = unsigned(threads);
          tl_warp = &warps[size_t(b)][size_t(i / 32)];
          tl_phase = 0;
          tl_block = block_bars[size_t(b)].get();
          tl_named = named[size_t(b)].get();
          tl_cluster = &cluster, tl_cluster_rank = unsigned(b), tl_dyn_smem = mem[size_t(b)].data();
          tl_cluster_waited = tl_remote_unfenced = false;
          fn();
          if (tl_cluster_arrival || tl_remote_unfenced) std::abort();  // exits before its arrival is waited for /
          tl_cluster = nullptr, tl_dyn_smem = nullptr;                  // after an access no barrier follows
        });
    for (auto& t : th) t.join();
  }
}

// The harnesses' input files: v.size() elements of T read from path (false when short or missing).
template <class T>
bool read_file(const char* path, std::vector<T>& v) {
  std::ifstream f(path, std::ios::binary);
  f.read(reinterpret_cast<char*>(v.data()), std::streamsize(v.size() * sizeof(T)));
  return bool(f);
}
