// KV-cache write and GQA softmax attention on the GPU; same contracts as cpu::kv_write and
// cpu::attention (cpu/attention.h), for F32, F16 and Q8_0 caches and any head_dim up to 1024
// (64/128/256 in the models; Q8_0 needs head_dim % 32 == 0).
//
// kv_write: one block per (row, KV head). F32 copies, F16 rounds to nearest even, Q8_0 is ggml's
// quantize_row_q8_0_ref (d = amax / 127, q = round-half-away(x / d) with the unrounded reciprocal,
// one warp per 32-element block). Bit-identical to the CPU op for finite inputs (NaN payloads may
// differ). Row indices are range/distinctness-checked on the host (a GPU rows tensor is read back).
//
// attention: split-free, one thread block per (query row, query head), blockDim = head_dim rounded
// up to a warp. Two passes over the row's visible key range [lo, hi), in a fixed key order:
//   pass 1: score s_j = (q . k_j) * scale for every visible key (one warp per key: lane l sums dims
//           l, l+32, ... in order, then a fixed xor-butterfly), block max m (exact, order-free);
//   pass 2: tiles of kTile keys: the scores are recomputed bit for bit (same code) and
//           p_j = expf(s_j - m) stored in shared memory; then thread c (one per output dim) walks the
//           tile's visible keys in increasing order: l += p_j, acc_c += p_j * v_j[c].
// So every (query, head) result depends only on the ordered sequence of its visible keys: it is
// bit-identical whatever the number of query rows in the call (batch invariance), whatever other
// rows or heads do, and whatever cache rows hold the keys (a tree node equals the chain verify of
// its path bitwise), as on the CPU. A query with no visible key gets zeros.
// Tolerance vs the CPU op (different dot-product order, expf vs libm exp, FMA): |gpu - cpu| <=
// ~1e-5 * max|v| per element for F32 caches at 32k keys; tests use atol = 2e-5 * max|v| + rtol 1e-4.
// q_pos is checked (>= 0) on the host (one small synchronising read when it is a GPU tensor).
// Cost: K is read twice and V once per (query, head); GQA groups re-read K/V through L2.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "../cpu/attention.h"
#include "op_util.cuh"
#include "ops.h"

namespace specd::gpu {

namespace {

constexpr int kTile = 64;
constexpr int kMaxDim = 1024;

void check_cache(const Tensor& c, const char* op, const char* arg) {
  detail::check_gpu(c, op, arg);
  check_ndim(c, 3, op, arg);
  check_contiguous(c, op, arg);
  SPECD_CHECK(c.dtype == DType::F32 || c.dtype == DType::F16 || c.dtype == DType::Q8_0, op, ": ", arg,
              " must be F32, F16 or Q8_0, got ", dtype_info(c.dtype).name);
  SPECD_CHECK(c.dim(2) % dtype_info(c.dtype).block_size == 0, op, ": ", arg, " head_dim (", c.dim(2),
              ") must be a multiple of ", dtype_info(c.dtype).block_size, " for ", dtype_info(c.dtype).name);
}

void check_index(const Tensor& t, const char* op, const char* arg, int64_t ndim) {
  check_dtype(t, DType::I32, op, arg);
  check_ndim(t, ndim, op, arg);
  check_contiguous(t, op, arg);
}

// Element c of a cache head row.
template <DType T>
__device__ __forceinline__ float load(const uint8_t* row, int c) {
  if constexpr (T == DType::F32) return reinterpret_cast<const float*>(row)[c];
  if constexpr (T == DType::F16) return detail::f16_at(row, c);
  return detail::q8_0_at(row, c);
}

// ---------------------------------------------------------------------------------------- kv_write

constexpr int kWriteThreads = 128;

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int m = SPECD_WARP / 2; m > 0; m >>= 1) v = fmaxf(v, SPECD_SHFL_XOR(v, m));
  return v;
}

template <DType T>
__global__ void __launch_bounds__(kWriteThreads) kv_write_kernel(uint8_t* __restrict__ cache, const float* __restrict__ x,
                                                                 const int32_t* __restrict__ rows, int hkv, int d,
                                                                 int64_t row_stride, int64_t head_stride) {
  const int64_t i = blockIdx.x / hkv;
  const int g = int(blockIdx.x % hkv);
  const float* xr = x + (i * hkv + g) * d;
  uint8_t* dst = cache + int64_t(rows[i]) * row_stride + g * head_stride;
  if constexpr (T == DType::F32) {
    for (int c = threadIdx.x; c < d; c += kWriteThreads) reinterpret_cast<float*>(dst)[c] = xr[c];
  } else if constexpr (T == DType::F16) {
    for (int c = threadIdx.x; c < d; c += kWriteThreads)
      reinterpret_cast<uint16_t*>(dst)[c] = __half_as_ushort(__float2half_rn(xr[c]));
  } else {
    const int lane = threadIdx.x % SPECD_WARP, warp = threadIdx.x / SPECD_WARP;
    for (int b = warp; b < d / 32; b += kWriteThreads / SPECD_WARP) {  // uniform per warp
      float v = xr[b * 32 + lane];
      float amax = warp_max(fabsf(v));
      float dd = __fdiv_rn(amax, 127.0f);
      float id = dd != 0.0f ? __fdiv_rn(1.0f, dd) : 0.0f;
      uint8_t* blk = dst + b * 34;
      if (lane == 0) {
        *reinterpret_cast<uint16_t*>(blk) = __half_as_ushort(__float2half_rn(dd));
      }
      reinterpret_cast<int8_t*>(blk + 2)[lane] = int8_t(roundf(__fmul_rn(v, id)));
    }
  }
}

// --------------------------------------------------------------------------------------- attention

struct AttnParams {
  const float* q;
  const uint8_t* kc;
  const uint8_t* vc;
  int64_t k_row_stride, k_head_stride;  // cache strides (bytes); K and V may have different dtypes
  int64_t v_row_stride, v_head_stride;
  const int32_t* q_pos;
  const int32_t* mask;  // [n, kv_len] or null
  int64_t kv_len, window;
  int causal, hq, r, d;
  float scale;
  float* out;
};

// (q . k_j) * scale for the key row `krow`, computed by one warp; every lane gets the same value.
template <DType KT>
__device__ __forceinline__ float score(const float* qs, const uint8_t* krow, int d, int lane, float scale) {
  float acc = 0.0f;
  for (int c = lane; c < d; c += SPECD_WARP) acc = __fadd_rn(acc, __fmul_rn(qs[c], load<KT>(krow, c)));
  return __fmul_rn(detail::warp_sum(acc), scale);
}

template <DType KT, DType VT>
__global__ void __launch_bounds__(kMaxDim) attention_kernel(const AttnParams P) {
  extern __shared__ float smem[];
  float* qs = smem;        // [d]
  float* ps = smem + P.d;  // [kTile]: p_j of the tile, -1 for keys not visible
  __shared__ float wmax[kMaxDim / SPECD_WARP];
  __shared__ float m_all;
  const int64_t i = blockIdx.x / P.hq;
  const int h = int(blockIdx.x % P.hq), g = h / P.r;
  const int lane = threadIdx.x % SPECD_WARP, warp = threadIdx.x / SPECD_WARP, nwarps = blockDim.x / SPECD_WARP;
  for (int c = threadIdx.x; c < P.d; c += blockDim.x) qs[c] = P.q[(i * P.hq + h) * P.d + c];
  const int64_t pos = P.q_pos[i];
  const int64_t lo = P.window > 0 ? (pos - P.window + 1 > 0 ? pos - P.window + 1 : 0) : 0;
  const int64_t hi = P.causal ? (P.kv_len < pos + 1 ? P.kv_len : pos + 1) : P.kv_len;
  const int32_t* mrow = P.mask ? P.mask + i * P.kv_len : nullptr;
  const uint8_t* kbase = P.kc + g * P.k_head_stride;
  const uint8_t* vbase = P.vc + g * P.v_head_stride;
  __syncthreads();

  // Pass 1: the max over the visible scores (exact whatever the order).
  float m = -INFINITY;
  for (int64_t j = lo + warp; j < hi; j += nwarps) {
    if (mrow && mrow[j] == 0) continue;  // uniform per warp
    float s = score<KT>(qs, kbase + j * P.k_row_stride, P.d, lane, P.scale);
    m = m < s ? s : m;
  }
  if (lane == 0) wmax[warp] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    float mm = -INFINITY;
    for (int w = 0; w < nwarps; ++w) mm = mm < wmax[w] ? wmax[w] : mm;
    m_all = mm;
  }
  __syncthreads();
  m = m_all;

  // Pass 2: weights and weighted values, keys in increasing order.
  float l = 0.0f, acc = 0.0f;
  const int c = threadIdx.x;
  for (int64_t t0 = lo; t0 < hi; t0 += kTile) {
    const int cnt = int(hi - t0 < kTile ? hi - t0 : kTile);
    for (int jj = warp; jj < cnt; jj += nwarps) {
      const int64_t j = t0 + jj;
      float p = -1.0f;
      if (!mrow || mrow[j] != 0) p = expf(score<KT>(qs, kbase + j * P.k_row_stride, P.d, lane, P.scale) - m);
      if (lane == 0) ps[jj] = p;
    }
    __syncthreads();
    if (c < P.d) {
      for (int jj = 0; jj < cnt; ++jj) {
        const float p = ps[jj];
        if (!(p >= 0.0f)) continue;  // not visible (uniform over the block)
        l = __fadd_rn(l, p);
        acc = __fadd_rn(acc, __fmul_rn(p, load<VT>(vbase + (t0 + jj) * P.v_row_stride, c)));
      }
    }
    __syncthreads();
  }
  if (c < P.d) P.out[(i * P.hq + h) * P.d + c] = l > 0.0f ? __fdiv_rn(acc, l) : 0.0f;
}

template <DType KT>
void launch_attention(DType vt, const AttnParams& P, unsigned blocks, int threads, size_t shmem, cudaStream_t s) {
  switch (vt) {
    case DType::F32: attention_kernel<KT, DType::F32><<<blocks, threads, shmem, s>>>(P); break;
    case DType::F16: attention_kernel<KT, DType::F16><<<blocks, threads, shmem, s>>>(P); break;
    default: attention_kernel<KT, DType::Q8_0><<<blocks, threads, shmem, s>>>(P); break;
  }
}

}  // namespace

void kv_write(const Tensor& cache, const Tensor& x, const Tensor& rows) {
  const char* op = "kv_write";
  check_cache(cache, op, "cache");
  check_writable(cache, op, "cache");
  detail::check_gpu_tensor(x, DType::F32, 3, op, "x");
  check_index(rows, op, "rows", 1);
  int64_t n = x.dim(0), cap = cache.dim(0), hkv = cache.dim(1), d = cache.dim(2);
  SPECD_CHECK(x.dim(1) == hkv && x.dim(2) == d, op, ": x must be [n, ", hkv, ", ", d, "] to match the cache, got [",
              n, ", ", x.dim(1), ", ", x.dim(2), "]");
  SPECD_CHECK(rows.dim(0) == n, op, ": rows has ", rows.dim(0), " entries, x has ", n);
  SPECD_CHECK(d <= 0x7fffffff && hkv <= 0x7fffffff, op, ": cache dimensions too large");
  std::vector<int32_t> rv = detail::host_i32(rows);
  for (int64_t i = 0; i < n; ++i)
    SPECD_CHECK(rv[size_t(i)] >= 0 && rv[size_t(i)] < cap, op, ": rows[", i, "] = ", rv[size_t(i)],
                " is outside the cache [0, ", cap, ")");
  std::vector<int32_t> sorted = rv;
  std::sort(sorted.begin(), sorted.end());
  SPECD_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(), op, ": rows must be distinct");
  if (n == 0 || hkv == 0 || d == 0) return;
  detail::check_grid(n * hkv, op);
  Tensor drows = detail::i32_on_gpu(rows);
  auto* dst = static_cast<uint8_t*>(cache.data);
  const unsigned blocks = unsigned(n * hkv);
  cudaStream_t s = detail::stream();
  const int64_t rs = cache.strides[0], hs = cache.strides[1];
  switch (cache.dtype) {
    case DType::F32: kv_write_kernel<DType::F32><<<blocks, kWriteThreads, 0, s>>>(dst, x.ptr<float>(), drows.ptr<int32_t>(), int(hkv), int(d), rs, hs); break;
    case DType::F16: kv_write_kernel<DType::F16><<<blocks, kWriteThreads, 0, s>>>(dst, x.ptr<float>(), drows.ptr<int32_t>(), int(hkv), int(d), rs, hs); break;
    default: kv_write_kernel<DType::Q8_0><<<blocks, kWriteThreads, 0, s>>>(dst, x.ptr<float>(), drows.ptr<int32_t>(), int(hkv), int(d), rs, hs); break;
  }
  SPECD_GPU_CHECK_LAUNCH("kv_write_kernel");
}

Tensor attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& q_pos,
                 const cpu::AttentionArgs& a) {
  const char* op = "attention";
  detail::check_gpu_tensor(q, DType::F32, 3, op, "q");
  check_cache(k_cache, op, "k_cache");
  check_cache(v_cache, op, "v_cache");
  SPECD_CHECK(k_cache.shape == v_cache.shape, op, ": k_cache and v_cache shapes differ");
  int64_t n = q.dim(0), hq = q.dim(1), d = q.dim(2), hkv = k_cache.dim(1);
  SPECD_CHECK(k_cache.dim(2) == d, op, ": cache head_dim ", k_cache.dim(2), " differs from q head_dim ", d);
  SPECD_CHECK(hkv > 0 && hq % hkv == 0, op, ": q heads (", hq, ") must be a multiple of cache KV heads (", hkv, ")");
  SPECD_CHECK(a.kv_len >= 0 && a.kv_len <= k_cache.dim(0), op, ": kv_len must be in [0, capacity=", k_cache.dim(0),
              "], got ", a.kv_len);
  SPECD_CHECK(a.window >= 0, op, ": window must be >= 0, got ", a.window);
  check_index(q_pos, op, "q_pos", 1);
  SPECD_CHECK(q_pos.dim(0) == n, op, ": q_pos has ", q_pos.dim(0), " entries, q has ", n, " rows");
  if (a.mask) {
    check_index(*a.mask, op, "mask", 2);
    SPECD_CHECK(a.mask->dim(0) == n && a.mask->dim(1) == a.kv_len, op, ": mask must have shape [", n, ", ",
                a.kv_len, "] (n, kv_len), got [", a.mask->dim(0), ", ", a.mask->dim(1), "]");
  }
  if (a.scale) SPECD_CHECK(std::isfinite(*a.scale), op, ": scale must be finite, got ", *a.scale);
  SPECD_CHECK(d <= kMaxDim, op, ": the GPU op supports head_dim <= ", kMaxDim, ", got ", d);
  std::vector<int32_t> pv = detail::host_i32(q_pos);
  for (int64_t i = 0; i < n; ++i)
    SPECD_CHECK(pv[size_t(i)] >= 0, "attention: q_pos must be >= 0, got ", pv[size_t(i)], " at index ", i);
  if (n == 0 || hq == 0 || d == 0) return Tensor::zeros(q.shape, DType::F32, Device::GPU);
  detail::check_grid(n * hq, op);
  Tensor out = Tensor::empty(q.shape, DType::F32, Device::GPU);
  Tensor dpos = detail::i32_on_gpu(q_pos);
  Tensor dmask = a.mask ? detail::i32_on_gpu(*a.mask) : Tensor();
  AttnParams P{q.ptr<float>(), static_cast<const uint8_t*>(k_cache.data), static_cast<const uint8_t*>(v_cache.data),
               k_cache.strides[0], k_cache.strides[1], v_cache.strides[0], v_cache.strides[1], dpos.ptr<int32_t>(),
               a.mask ? dmask.ptr<int32_t>() : nullptr, a.kv_len, a.window, a.causal ? 1 : 0, int(hq),
               int(hq / hkv), int(d), a.scale ? *a.scale : float(1.0 / std::sqrt(double(d))), out.ptr<float>()};
  const int threads = int((d + SPECD_WARP - 1) / SPECD_WARP * SPECD_WARP);
  const size_t shmem = size_t(d + kTile) * sizeof(float);
  const unsigned blocks = unsigned(n * hq);
  cudaStream_t s = detail::stream();
  switch (k_cache.dtype) {
    case DType::F32: launch_attention<DType::F32>(v_cache.dtype, P, blocks, threads, shmem, s); break;
    case DType::F16: launch_attention<DType::F16>(v_cache.dtype, P, blocks, threads, shmem, s); break;
    default: launch_attention<DType::Q8_0>(v_cache.dtype, P, blocks, threads, shmem, s); break;
  }
  SPECD_GPU_CHECK_LAUNCH("attention_kernel");
  return out;
}

}  // namespace specd::gpu
