// Memory-side ceiling of the GEMV's weight access patterns on the GPU (issue 7): how fast can a kernel
// that only LOADS a [17408 x 2720 B] IQ4_XS weight (the 27B's FFN gate, 47 MB) stream it, per pattern,
// loads in flight and warps per SM, against the device-to-device copy bandwidth measured in the same
// run. Every kernel folds what it loaded into one word per thread (so nothing is optimised away).
//   ldg32<A>   the tensor-core GEMV's pattern: a warp owns 16 rows; per 136-byte unit each lane loads
//              4-byte words of rows g and g + 8 (8 rows x 16 bytes per instruction); A units ahead.
//   ldg128<A>  the same warp work (A = 1: a deeper ring spills), loaded as 16-byte words of contiguous row segments (two units of a
//              row = 272 bytes = 17 words; 16 rows = 272 words, 9 per lane); A unit pairs ahead.
//   bulk<S,P>  the copy engine (cp.async.bulk, mbarrier completion) moves P units of each of the warp's
//              16 rows into shared memory, S stages per warp; lanes read the stage in the MMA layout.
//   stream     grid-stride 16-byte loads over the whole weight (the copy-like reference).
// Usage: mem_pattern (prints "pattern splits us GBps ratio_to_copy").
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "bench_util.cuh"

constexpr int kRows = 17408, kUnits = 20, kUnit = 136, kRowBytes = kUnits * kUnit, kWarps = 4;

struct Job {  // a warp's 16 rows and unit range
  int64_t row0;
  int u0, u1;
};
__device__ __forceinline__ Job job(int splits) {
  const int rb = blockIdx.x % (kRows / 64), sp = blockIdx.x / (kRows / 64);
  const int per = (kUnits + splits - 1) / splits;
  const int u0 = sp * per, u1 = min(kUnits, u0 + per);
  return Job{int64_t(rb) * 64 + (threadIdx.x / 32) * 16, u0, u1};
}

template <int A>
__global__ void __launch_bounds__(128, 4) ldg32(const uint8_t* __restrict__ w, int splits, uint32_t* sink) {
  const Job jb = job(splits);
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const uint8_t* r0 = w + (jb.row0 + g) * kRowBytes;
  const uint8_t* r1 = r0 + 8 * kRowBytes;
  uint32_t ring[A + 1][2][10];
  uint32_t acc = 0;
  auto load = [&](uint32_t(&d)[2][10], int u) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint8_t* b = (h ? r1 : r0) + u * kUnit;
      const uint2 hdr = *reinterpret_cast<const uint2*>(b);
      d[h][8] = hdr.x, d[h][9] = hdr.y;
#pragma unroll
      for (int j = 0; j < 8; ++j) d[h][j] = *reinterpret_cast<const uint32_t*>(b + 8 + 16 * j + 4 * t);
    }
  };
#pragma unroll
  for (int i = 0; i < A; ++i)
    if (jb.u0 + i < jb.u1) load(ring[i], jb.u0 + i);
  for (int u0 = jb.u0; u0 < jb.u1; u0 += A + 1) {
#pragma unroll
    for (int i = 0; i <= A; ++i) {
      const int u = u0 + i;
      if (u < jb.u1) {
        if (u + A < jb.u1) load(ring[(i + A) % (A + 1)], u + A);
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int k = 0; k < 10; ++k) acc ^= ring[i][h][k];
      }
    }
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

template <int A>
__global__ void __launch_bounds__(128, 4) ldg128(const uint8_t* __restrict__ w, int splits, uint32_t* sink) {
  const Job jb = job(splits);
  const int lane = threadIdx.x & 31;
  uint4 ring[A + 1][9];
  uint32_t acc = 0;
  // Pair p (units 2p, 2p + 1) of the warp's 16 rows: word i = 32 k + lane of 272 (row i / 17, word i % 17).
  auto load = [&](uint4(&d)[9], int p) {
#pragma unroll
    for (int k = 0; k < 9; ++k) {
      const int i = 32 * k + lane;
      d[k] = i < 272 ? *reinterpret_cast<const uint4*>(w + (jb.row0 + i / 17) * kRowBytes + p * 2 * kUnit + (i % 17) * 16)
                     : make_uint4(0, 0, 0, 0);
    }
  };
  const int p0 = jb.u0 / 2, p1 = jb.u1 / 2;
#pragma unroll
  for (int i = 0; i < A; ++i)
    if (p0 + i < p1) load(ring[i], p0 + i);
  for (int q0 = p0; q0 < p1; q0 += A + 1) {
#pragma unroll
    for (int i = 0; i <= A; ++i) {
      const int p = q0 + i;
      if (p < p1) {
        if (p + A < p1) load(ring[(i + A) % (A + 1)], p + A);
#pragma unroll
        for (int k = 0; k < 9; ++k) acc ^= ring[i][k].x ^ ring[i][k].y ^ ring[i][k].z ^ ring[i][k].w;
      }
    }
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// Shared-memory row stride of a P-unit stage: an odd multiple of 16 bytes, so the 8 rows one load
// instruction touches (16 bytes each) land on different banks.
__host__ __device__ constexpr int bulk_stride(int P) { return (P * kUnit / 16) % 2 ? P * kUnit : P * kUnit + 16; }

template <int S, int P>
__global__ void __launch_bounds__(128) bulk(const uint8_t* __restrict__ w, int splits, uint32_t* sink) {
  constexpr int kSeg = P * kUnit, kStride = bulk_stride(P);
  static_assert(kSeg % 16 == 0, "bulk copies move multiples of 16 bytes");
  extern __shared__ __align__(128) uint8_t smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem) + warp * S;
  uint8_t* data = smem + kWarps * S * 8 + warp * S * 16 * kStride;
  const Job jb = job(splits);
  if (lane == 0)
    for (int s = 0; s < S; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar + s)));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncwarp();
  const int steps = (jb.u1 - jb.u0) / P;
  auto issue = [&](int k) {
    const int s = k % S;
    if (lane == 0)
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar + s)), "r"(16 * kSeg)
                   : "memory");
    __syncwarp();
    if (lane < 16) {
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      const uint8_t* src = w + (jb.row0 + lane) * kRowBytes + (jb.u0 + k * P) * kUnit;
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
              smem_addr(data + (s * 16 + lane) * kStride)),
          "l"(src), "r"(kSeg), "r"(smem_addr(bar + s))
          : "memory");
    }
  };
  uint32_t acc = 0;
  for (int k = 0; k < S - 1 && k < steps; ++k) issue(k);
  for (int k = 0; k < steps; ++k) {
    __syncwarp();
    if (k + S - 1 < steps) issue(k + S - 1);
    const int s = k % S;
    const uint32_t parity = (k / S) & 1;
    uint32_t done = 0;
    while (!done)
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
          : "=r"(done)
          : "r"(smem_addr(bar + s)), "r"(parity)
          : "memory");
    const uint8_t* st = data + s * 16 * kStride;
#pragma unroll
    for (int u = 0; u < P; ++u)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint8_t* b = st + (g + 8 * h) * kStride + u * kUnit;
        acc ^= reinterpret_cast<const uint32_t*>(b)[0] ^ reinterpret_cast<const uint32_t*>(b)[1];
#pragma unroll
        for (int j = 0; j < 8; ++j) acc ^= *reinterpret_cast<const uint32_t*>(b + 8 + 16 * j + 4 * t);
      }
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

__global__ void stream(const uint4* __restrict__ w, int64_t n16, uint32_t* sink) {
  uint32_t acc = 0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n16; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = w[i + k * stride];
#pragma unroll
    for (int k = 0; k < 4; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
  }
  for (; i < n16; i += stride) acc ^= w[i].x;
  if (acc == 0x12345678u) sink[0] = acc;
}

// Microseconds per launch(copy index), rotating over `copies` weight copies.
template <class Launch>
float time_us(const Launch& launch, int copies) {
  return median_us([&](int i) { launch(i % copies); }, 300);
}

int main() {
  const size_t wbytes = size_t(kRows) * kRowBytes;
  const int copies = 6;  // 283 MB: > 4x the L2
  std::vector<uint8_t*> ws(copies);
  for (auto& p : ws) {
    CK(cudaMalloc(&p, wbytes));
    CK(cudaMemset(p, 0x5a, wbytes));
  }
  uint32_t* sink;
  CK(cudaMalloc(&sink, 4));
  const double copy = copy_gbps();
  std::printf("# copy_GBps %.1f weight_bytes %zu\n", copy, wbytes);
  auto report = [&](const char* name, int splits, float us) {
    const double gbps = double(wbytes) / (us * 1e-6) / 1e9;
    std::printf("%s\t%d\t%.2f\t%.1f\t%.3f\n", name, splits, us, gbps, gbps / copy);
    std::fflush(stdout);
  };
  const int rb = kRows / 64;
  for (int splits : {1, 2, 5}) {  // 20, 10, 4 units per split: whole unit pairs for ldg128
    report("ldg32<2>", splits, time_us([&](int c) { ldg32<2><<<rb * splits, 128>>>(ws[c], splits, sink); }, copies));
    report("ldg32<4>", splits, time_us([&](int c) { ldg32<4><<<rb * splits, 128>>>(ws[c], splits, sink); }, copies));
    report("ldg128<1>", splits, time_us([&](int c) { ldg128<1><<<rb * splits, 128>>>(ws[c], splits, sink); }, copies));
  }
  auto run_bulk = [&](auto kernel, const char* name, int S, int P, int splits) {
    const int smem = kWarps * S * 8 + kWarps * S * 16 * bulk_stride(P);
    CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    report(name, splits, time_us([&](int c) { kernel<<<rb * splits, 128, smem>>>(ws[c], splits, sink); }, copies));
  };
  for (int splits : {1, 2}) {  // P units per stage must divide the split's units (20 / splits)
    run_bulk(bulk<3, 2>, "bulk<3,2>", 3, 2, splits);
    run_bulk(bulk<4, 2>, "bulk<4,2>", 4, 2, splits);
    if (splits == 1) run_bulk(bulk<3, 4>, "bulk<3,4>", 3, 4, splits);
    run_bulk(bulk<6, 2>, "bulk<6,2>", 6, 2, splits);
  }
  run_bulk(bulk<3, 2>, "bulk<3,2>", 3, 2, 5);  // 4 units per split
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  report("stream", 0, time_us([&](int c) {
    stream<<<sms * 8, 256>>>(reinterpret_cast<const uint4*>(ws[c]), int64_t(wbytes / 16), sink);
  }, copies));
  return 0;
}
