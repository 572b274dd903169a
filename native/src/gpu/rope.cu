// Partial NeoX RoPE (+ YaRN) on the GPU, same contract as cpu::rope_neox, and the fused q / k
// preparation of the gated attention (qk_norm_rope: rms_norm then RoPE of every q and k head).
//
// The inverse frequencies and the YaRN multiplier come from cpu::rope_freqs (host, double) and are
// passed to the kernel by value. rope_neox: one block per (row, group of kHeads heads): the block
// computes a = pos * inv_freq[i] and cos/sin in double times the multiplier once per pair i (shared
// by all its heads: the double trig dominates the cost), then each (head, pair) thread rotates in
// double with explicit round-to-nearest operations (no FMA contraction, as the CPU build), rounded
// to F32 once. The head groups give a one-row decode several blocks. Tolerance vs the CPU op:
// bit-identical except when the device and host double cos/sin (each within ~1 ulp of double)
// straddle an F32 rounding boundary: <= 1 F32 ulp, practically never. Dims >= n_rot are copied.
// qk_norm_rope: one block per (row, q or k head), of rms_norm's block size for a row of head_dim:
// the head is normalised with rms_norm's row arithmetic (norm.cuh) into shared memory, then
// rotated with the same cos/sin and pair functions as rope_neox, so q and k are bit-identical to
// rope_neox(rms_norm(.)) on the GPU (vector loads exactly when rms_norm uses them: head_dim % 4 == 0
// and aligned tensors, as every tensor the library allocates is); gate is a view of qg (no work).
// With a cache write (cpu::QkCacheWrite) the same launch also does kv_write's work: each k head's block,
// once its row is stored, stores it again into k_cache (store_kv_row, kv_write's conversion: the same
// bytes), and nkv more blocks per row store v into v_cache, so a decode step saves kv_write's two launches.
// positions (I32 [n], CPU or GPU) are checked (>= 0) on the host, which reads GPU ones back (one
// small synchronising copy) unless `trusted`; CPU ones are uploaded asynchronously. Any position
// value is safe for the kernels (a negative one is rotated as given). Cache rows likewise, as kv_write's.
#include <cmath>
#include <optional>

#include "../cpu/attention.h"
#include "../cpu/rope.h"
#include "kv_store.cuh"
#include "norm.cuh"
#include "op_util.cuh"
#include "ops.h"

namespace specd::gpu {

namespace {

constexpr int kMaxHalf = 256;  // n_rot <= 512
constexpr int kThreads = 128;
constexpr int kHeads = 4;  // heads per block

struct Freqs {
  double inv[kMaxHalf];
  double mscale;
};

// cs[2i], cs[2i + 1] = m cos(a), m sin(a) of pair i at position p (a = p * inv_freq[i]), computed by
// the block's threads; the caller syncs before reading cs.
__device__ __forceinline__ void block_cos_sin(double p, const Freqs& f, int half, double* cs) {
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const double a = __dmul_rn(p, f.inv[i]);
    cs[2 * i] = __dmul_rn(cos(a), f.mscale);
    cs[2 * i + 1] = __dmul_rn(sin(a), f.mscale);
  }
}

// Pair i of one head: (x[i], x[i + half]) rotated by cs in double, rounded to F32 once, into y.
__device__ __forceinline__ void rotate_pair(const float* x, const double* cs, int i, int half, float* y) {
  const double c = cs[2 * i], s = cs[2 * i + 1];
  const double x0 = x[i], x1 = x[i + half];
  y[i] = float(__dsub_rn(__dmul_rn(x0, c), __dmul_rn(x1, s)));
  y[i + half] = float(__dadd_rn(__dmul_rn(x1, c), __dmul_rn(x0, s)));
}

// Block (row t, head group blockIdx.y): heads [h0, h0 + nh). hd <= INT_MAX / kHeads (host check).
__global__ void __launch_bounds__(kThreads) rope_kernel(const float* __restrict__ x, const int32_t* __restrict__ pos,
                                                        float* __restrict__ y, int heads, int hd, int half,
                                                        const Freqs f) {
  detail::pdl_enter();
  __shared__ double cs[2 * kMaxHalf];
  const int64_t t = blockIdx.x;
  const int h0 = int(blockIdx.y) * kHeads;
  const int nh = heads - h0 < kHeads ? heads - h0 : kHeads;
  block_cos_sin(double(pos[t]), f, half, cs);
  __syncthreads();
  const float* xr = x + (t * heads + h0) * hd;
  float* yr = y + (t * heads + h0) * hd;
  for (int e = threadIdx.x; e < nh * half; e += kThreads) {
    const int h = e / half;
    rotate_pair(xr + h * hd, cs, e % half, half, yr + h * hd);
  }
  const int rest = hd - 2 * half;
  for (int e = threadIdx.x; e < nh * rest; e += kThreads) {
    const int h = e / rest, i = 2 * half + e % rest;
    yr[h * hd + i] = xr[h * hd + i];
  }
}

constexpr int kMaxHeadDim = 8192;  // qk_norm_rope's normalised head in shared memory: 32 KiB

namespace norm = detail::norm;

// qk_norm_rope's cache write as the kernel takes it (kc null: none): the caches' bytes, dtypes and
// strides (bytes), their capacity, v [w, nkv, hd] and the rows [w].
struct CacheDst {
  uint8_t* kc = nullptr;
  uint8_t* vc = nullptr;
  DType kt = DType::F32, vt = DType::F32;
  int64_t k_row_stride = 0, k_head_stride = 0, v_row_stride = 0, v_head_stride = 0, cap = 0;
  const float* v = nullptr;
  const int32_t* rows = nullptr;
};

// x (hd floats), head g of row t, into the k (is_k) or v cache at row rows[t], as kv_write_kernel stores
// it, by the whole block; a row outside [0, capacity) is skipped (only reachable with trusted rows).
__device__ __forceinline__ void store_cache_row(const CacheDst& c, bool is_k, int64_t t, int g, const float* x,
                                                int hd) {
  const int32_t r = c.rows[t];
  if (r < 0 || r >= c.cap) return;  // uniform per block
  uint8_t* dst = is_k ? c.kc + r * c.k_row_stride + g * c.k_head_stride
                      : c.vc + r * c.v_row_stride + g * c.v_head_stride;
  detail::store_kv_row(is_k ? c.kt : c.vt, dst, x, hd, int(blockDim.x));
}

// Block (row t, head blockIdx.y: q heads [0, nh), then k heads, then with a cache write (c.kc set) v heads),
// blockDim.x = norm::threads_for(items) with items rms_norm's loads per row of hd (vectors when VEC). qg:
// [w, nh, 2 hd], k, ko: [w, nkv, hd], q: [w, nh, hd].
template <bool VEC>
__global__ void __launch_bounds__(norm::kMaxThreads)
    qk_norm_rope_kernel(const float* __restrict__ qg, const float* __restrict__ k, const float* __restrict__ q_norm_w,
                        const float* __restrict__ k_norm_w, const int32_t* __restrict__ pos, float* __restrict__ q,
                        float* __restrict__ ko, int nh, int nkv, int hd, int half, float eps, const Freqs f,
                        const CacheDst c) {
  detail::pdl_enter();
  using T = typename norm::Row<VEC>::T;
  extern __shared__ float4 normed4[];  // the normalised head, hd floats
  __shared__ double cs[2 * kMaxHalf];
  T* normed = reinterpret_cast<T*>(normed4);
  const int64_t t = blockIdx.x;
  const int h = blockIdx.y;
  if (h >= nh + nkv) {  // a v head: stored as it is
    const int g = h - nh - nkv;
    store_cache_row(c, false, t, g, c.v + (t * nkv + g) * hd, hd);
    return;
  }
  const bool is_q = h < nh;
  const int64_t r = is_q ? t * nh + h : t * nkv + (h - nh);  // the head's row in q or k / ko
  const T* x = reinterpret_cast<const T*>(is_q ? qg + r * 2 * hd : k + r * hd);
  const T* w = reinterpret_cast<const T*>(is_q ? q_norm_w : k_norm_w);
  const int64_t n = hd / norm::Row<VEC>::kWidth;
  const float scale = norm::rms_scale(norm::block_sum(norm::row_squares<false, T>(x, nullptr, nullptr, n)), hd, eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) normed[i] = norm::normed<false>(x[i], scale, w + i, T{});
  block_cos_sin(double(pos[t]), f, half, cs);
  __syncthreads();
  const float* v = reinterpret_cast<const float*>(normed4);
  float* y = (is_q ? q : ko) + r * hd;
  for (int i = threadIdx.x; i < half; i += blockDim.x) rotate_pair(v, cs, i, half, y);
  for (int i = 2 * half + threadIdx.x; i < hd; i += blockDim.x) y[i] = v[i];
  if (!is_q && c.kc) {
    __syncthreads();  // the block's stores of the row y are visible to all its threads
    store_cache_row(c, true, t, h - nh, y, hd);
  }
}

// The frequencies as the kernels take them (rf from cpu::rope_freqs; n_rot / 2 <= kMaxHalf checked).
Freqs device_freqs(const cpu::RopeFreqs& rf) {
  Freqs f{};
  for (size_t i = 0; i < rf.inv_freq.size(); ++i) f.inv[i] = rf.inv_freq[i];
  f.mscale = rf.mscale;
  return f;
}

// positions (I32 [n], CPU or GPU, contiguous) as a GPU tensor, checked >= 0 on the host unless
// trusted GPU ones (detail::check_on_host).
Tensor gpu_positions(const Tensor& positions, bool trusted, const char* op) {
  check_contiguous(positions, op, "positions");
  if (detail::check_on_host(positions, trusted)) {
    std::vector<int32_t> pv = detail::host_i32(positions);
    for (size_t i = 0; i < pv.size(); ++i)
      SPECD_CHECK(pv[i] >= 0, op, ": positions must be >= 0, got ", pv[i], " at index ", i);
  }
  return detail::i32_on_gpu(positions);
}

}  // namespace

Tensor rope_neox(const Tensor& x, const Tensor& positions, int64_t n_rot, double theta, const cpu::Yarn& yarn,
                 bool trusted) {
  const char* op = "rope_neox";
  detail::check_gpu_tensor(x, DType::F32, 3, op, "x");
  check_dtype(positions, DType::I32, op, "positions");  // CPU or GPU
  check_ndim(positions, 1, op, "positions");
  int64_t n = x.dim(0), heads = x.dim(1), hd = x.dim(2);
  SPECD_CHECK(positions.dim(0) == n, op, ": positions has ", positions.dim(0), " entries, x has ", n, " rows");
  SPECD_CHECK(n_rot <= hd, op, ": n_rot must be <= head_dim (", hd, "), got ", n_rot);
  cpu::RopeFreqs rf = cpu::rope_freqs(n_rot, theta, yarn, op);
  SPECD_CHECK(n_rot / 2 <= kMaxHalf, op, ": the GPU op supports n_rot <= ", 2 * kMaxHalf, ", got ", n_rot);
  detail::check_grid(n, op);
  SPECD_CHECK(heads <= 65535 * int64_t(kHeads) && hd <= 0x7fffffff / kHeads, op, ": x dimensions too large");
  Tensor dpos = gpu_positions(positions, trusted, op);
  Tensor y = Tensor::empty(x.shape, DType::F32, Device::GPU);
  if (n == 0 || heads == 0 || hd == 0) return y;
  const dim3 grid(unsigned(n), unsigned((heads + kHeads - 1) / kHeads));
  detail::launch_kernel<rope_kernel>("rope_kernel", grid, kThreads, 0, detail::stream(), x.ptr<float>(),
                                     dpos.ptr<int32_t>(), y.ptr<float>(), int(heads), int(hd), int(n_rot / 2),
                                     device_freqs(rf));
  return y;
}

std::tuple<Tensor, Tensor, Tensor> qk_norm_rope(const Tensor& qg, const Tensor& k, const Tensor& q_norm_w,
                                                const Tensor& k_norm_w, const Tensor& positions, int64_t n_rot,
                                                double theta, float eps, bool trusted,
                                                const std::optional<cpu::QkCacheWrite>& cache) {
  const char* op = "qk_norm_rope";
  cpu::check_qk_norm_rope_args(qg, k, q_norm_w, k_norm_w, positions, n_rot, eps, Device::GPU);
  if (cache) {
    cpu::check_qk_cache_write(*cache, qg, k, q_norm_w, k_norm_w, positions, Device::GPU);
    check_contiguous(cache->rows, op, "rows");  // CPU or GPU, as kv_write's
  }
  cpu::RopeFreqs rf = cpu::rope_freqs(n_rot, theta, cpu::Yarn{}, op);
  const int64_t w = k.dim(0), nh = qg.dim(1), nkv = k.dim(1), hd = k.dim(2);
  const int64_t heads = nh + nkv + (cache ? nkv : 0);  // a block per head row of q, k (and v)
  SPECD_CHECK(n_rot / 2 <= kMaxHalf, op, ": the GPU op supports n_rot <= ", 2 * kMaxHalf, ", got ", n_rot);
  SPECD_CHECK(hd <= kMaxHeadDim, op, ": the GPU op supports head_dim <= ", kMaxHeadDim, ", got ", hd);
  SPECD_CHECK(heads <= 65535, op, ": the GPU op supports at most 65535 q + k (+ v) heads, got ", heads);
  detail::check_grid(w, op);
  if (cache && detail::check_on_host(cache->rows, trusted))
    cpu::check_kv_rows(detail::host_i32(cache->rows), cache->k_cache.dim(0), op);
  Tensor dpos = gpu_positions(positions, trusted, op);
  // The caches are written in place: as kv_write, keep another thread's graph capture off until the launch
  // is queued (the allocations below wait for one only while they allocate).
  std::optional<detail::EnqueueGuard> guard;
  if (cache) guard.emplace();
  Tensor q = Tensor::empty({w, nh, hd}, DType::F32, Device::GPU), ko = Tensor::empty(k.shape, DType::F32, Device::GPU);
  if (w == 0 || nh + nkv == 0 || hd == 0) return {q, cpu::qk_gate_view(qg), ko};
  // rms_norm's choice: vector loads when hd % 4 == 0 and its tensors are 16-byte aligned. The
  // composition normalises a fresh (aligned) copy of q, so q and k take the same path only when
  // every input is aligned, as every tensor the library allocates is: anything else is refused
  // rather than computed in another order.
  const bool vec = hd % 4 == 0;
  SPECD_CHECK(!vec || (detail::aligned16(qg.data) && detail::aligned16(k.data) && detail::aligned16(q_norm_w.data) &&
                       detail::aligned16(k_norm_w.data)),
              op, ": on the GPU, qg, k, q_norm_w and k_norm_w must be 16-byte aligned when head_dim % 4 == 0 "
              "(views at other offsets: copy them first)");
  CacheDst c;
  Tensor drows;  // the rows on the GPU, alive until the launch is queued
  if (cache) {
    const Tensor &kc = cache->k_cache, &vc = cache->v_cache;
    drows = detail::i32_on_gpu(cache->rows);
    c = CacheDst{static_cast<uint8_t*>(kc.data), static_cast<uint8_t*>(vc.data), kc.dtype, vc.dtype,
                 kc.strides[0], kc.strides[1], vc.strides[0], vc.strides[1], kc.dim(0), cache->v.ptr<float>(),
                 drows.ptr<int32_t>()};
  }
  const dim3 grid{unsigned(w), unsigned(heads)};
  const int threads = norm::threads_for(vec ? hd / 4 : hd);
  const size_t shmem = size_t(hd) * sizeof(float);
  cudaStream_t s = detail::stream();
  const float *pqg = qg.ptr<float>(), *pk = k.ptr<float>(), *qw = q_norm_w.ptr<float>(), *kw = k_norm_w.ptr<float>();
  if (vec)
    detail::launch_kernel<qk_norm_rope_kernel<true>>("qk_norm_rope_kernel", grid, threads, shmem, s, pqg, pk, qw, kw,
                                                     dpos.ptr<int32_t>(), q.ptr<float>(), ko.ptr<float>(), int(nh),
                                                     int(nkv), int(hd), int(n_rot / 2), eps, device_freqs(rf), c);
  else
    detail::launch_kernel<qk_norm_rope_kernel<false>>("qk_norm_rope_kernel", grid, threads, shmem, s, pqg, pk, qw, kw,
                                                      dpos.ptr<int32_t>(), q.ptr<float>(), ko.ptr<float>(), int(nh),
                                                      int(nkv), int(hd), int(n_rot / 2), eps, device_freqs(rf), c);
  return {q, cpu::qk_gate_view(qg), ko};
}

}  // namespace specd::gpu
