// RMSNorm (optionally fused with the residual add, or gated by silu(z)) and L2 norm on the GPU.
//
// One thread block per row; the block size depends only on the row length d, so a row's result
// does not depend on how many rows share the call (batch invariance). The sum of squares is
// accumulated in double (per thread, then a fixed-order warp-shuffle and cross-warp reduction),
// and the scale is computed exactly as the CPU op does (cpu/norm.cpp: float(1 / sqrt(ss / d + eps))
// in double, then y = (v * scale) * w in float), so GPU and CPU agree to within the rare last-bit
// flip of the scale caused by a different double summation order. Rows are read with 16-byte
// vector loads when d % 4 == 0 and every pointer is 16-byte aligned, else element by element.
// The gated variant multiplies each stored value by silu(z) with the device functions of the
// standalone silu and mul ops (activations.cuh), so it is bit-identical to mul(rms_norm, silu(z)).
// gdn_qkv normalises each Gated DeltaNet q / k head with the same row code (norm_row) and block
// size as l2_norm, so it is bit-identical to l2_norm of the column slices.
#include <cmath>
#include <tuple>

#include "../cpu/norm.h"
#include "common.cuh"
#include "norm.cuh"
#include "ops.h"

namespace specd::gpu {

namespace {

using namespace detail::norm;

// x, residual, h, z, y: [rows, d], one block per row (norm_row).
template <Mode M, bool VEC, bool RESID, bool GATE>
__global__ void norm_kernel(const float* __restrict__ x, const float* __restrict__ residual,
                            const float* __restrict__ w, float* h, const float* __restrict__ z,
                            float* __restrict__ y, int64_t d, float eps) {
  detail::pdl_enter();
  const int64_t off = int64_t(blockIdx.x) * d;
  norm_row<M, VEC, RESID, GATE>(x + off, RESID ? residual + off : nullptr, w, RESID ? h + off : nullptr,
                                GATE ? z + off : nullptr, y + off, d, eps);
}

// gdn_qkv: cv [w, 2 hk dk + hv dv] -> q, k [w, hk, dk] (L2-normalised heads), v [w, hv, dv]. One block
// per (token t, q or k head h). The head is first staged in (16-byte aligned) shared memory, so
// norm_row reads a contiguous aligned row exactly as l2_norm reads the composition's copy of the
// head (vector loads whenever dk % 4 == 0, whatever the alignment of cv's rows): same sums, same
// bits. Every block then copies its share of token t's v columns.
template <bool VEC>
__global__ void gdn_qkv_kernel(const float* __restrict__ cv, float* __restrict__ q, float* __restrict__ k,
                               float* __restrict__ v, int64_t hk, int64_t dk, int64_t vcols, float eps) {
  detail::pdl_enter();
  extern __shared__ float4 stage4[];
  float* stage = reinterpret_cast<float*>(stage4);
  const int64_t heads = 2 * hk, t = blockIdx.x / heads, h = blockIdx.x % heads;
  const float* row = cv + t * (heads * dk + vcols);
  for (int64_t i = threadIdx.x; i < dk; i += blockDim.x) stage[i] = row[h * dk + i];
  __syncthreads();
  float* y = h < hk ? q + (t * hk + h) * dk : k + (t * hk + h - hk) * dk;
  norm_row<Mode::L2, VEC, false, false>(stage, nullptr, nullptr, nullptr, nullptr, y, dk, eps);
  for (int64_t i = h * blockDim.x + threadIdx.x; i < vcols; i += heads * blockDim.x)
    v[t * vcols + i] = row[heads * dk + i];
}

constexpr int64_t kMaxStagedDk = 8192;  // 32 KiB of shared memory per block

template <Mode M, bool RESID, bool GATE = false>
void launch(const float* x, const float* r, const float* w, float* h, float* y, int64_t rows, int64_t d,
            float eps, const float* z = nullptr) {
  bool vec = d % 4 == 0 && detail::aligned16(x) && detail::aligned16(y) && (!w || detail::aligned16(w)) &&
             (!RESID || (detail::aligned16(r) && detail::aligned16(h))) && (!GATE || detail::aligned16(z));
  int threads = threads_for(vec ? d / 4 : d);
  cudaStream_t s = detail::stream();
  // rows <= 2^31 - 1 (grid x limit) is checked by the caller.
  if (vec)
    detail::launch_kernel<norm_kernel<M, true, RESID, GATE>>("norm_kernel", unsigned(rows), threads, 0, s, x, r, w, h,
                                                             z, y, d, eps);
  else
    detail::launch_kernel<norm_kernel<M, false, RESID, GATE>>("norm_kernel", unsigned(rows), threads, 0, s, x, r, w, h,
                                                              z, y, d, eps);
}

void check_rows(const char* op, int64_t rows) {
  SPECD_CHECK(rows <= 0x7fffffff, op, ": at most 2^31 - 1 rows on the GPU, got ", rows);
}

}  // namespace

std::pair<Tensor, Tensor> rms_norm(const Tensor& x, const std::optional<Tensor>& weight, float eps,
                                   const std::optional<Tensor>& residual) {
  const char* op = "rms_norm";
  cpu::check_rms_args(x, weight, eps, Device::GPU, op);
  check_rows(op, x.rows());
  if (residual) cpu::check_like_x(*residual, x, Device::GPU, op, "residual");
  int64_t d = x.cols(), rows = x.rows();
  Tensor y = Tensor::empty(x.shape, DType::F32, Device::GPU);
  Tensor h = residual ? Tensor::empty(x.shape, DType::F32, Device::GPU) : x;
  if (rows == 0) return {y, h};
  const float* w = weight ? weight->ptr<float>() : nullptr;
  if (residual)
    launch<Mode::RMS, true>(x.ptr<float>(), residual->ptr<float>(), w, h.ptr<float>(), y.ptr<float>(), rows, d,
                            eps);
  else
    launch<Mode::RMS, false>(x.ptr<float>(), nullptr, w, nullptr, y.ptr<float>(), rows, d, eps);
  return {y, h};
}

Tensor rms_norm_gated(const Tensor& x, const std::optional<Tensor>& weight, float eps, const Tensor& z) {
  const char* op = "rms_norm_gated";
  cpu::check_rms_args(x, weight, eps, Device::GPU, op);
  check_rows(op, x.rows());
  cpu::check_like_x(z, x, Device::GPU, op, "z");
  Tensor y = Tensor::empty(x.shape, DType::F32, Device::GPU);
  if (x.rows() == 0) return y;
  launch<Mode::RMS, false, true>(x.ptr<float>(), nullptr, weight ? weight->ptr<float>() : nullptr, nullptr,
                                 y.ptr<float>(), x.rows(), x.cols(), eps, z.ptr<float>());
  return y;
}

Tensor l2_norm(const Tensor& x, float eps) {
  const char* op = "l2_norm";
  detail::check_gpu(x, op, "x");
  check_dtype(x, DType::F32, op, "x");
  check_contiguous(x, op, "x");
  SPECD_CHECK(x.ndim() >= 1, op, ": x must have at least 1 dimension");
  SPECD_CHECK(eps >= 0.0f && std::isfinite(eps), op, ": eps must be finite and >= 0");
  int64_t d = x.cols(), rows = x.rows();
  check_rows(op, rows);
  Tensor y = Tensor::empty(x.shape, DType::F32, Device::GPU);
  if (rows == 0) return y;
  launch<Mode::L2, false>(x.ptr<float>(), nullptr, nullptr, nullptr, y.ptr<float>(), rows, d, eps);
  return y;
}

std::tuple<Tensor, Tensor, Tensor> gdn_qkv(const Tensor& cv, int64_t n_k_heads, int64_t head_k_dim,
                                            int64_t n_v_heads, int64_t head_v_dim, float eps) {
  const char* op = "gdn_qkv";
  cpu::check_gdn_qkv_args(cv, n_k_heads, head_k_dim, n_v_heads, head_v_dim, eps, Device::GPU);
  const int64_t w = cv.dim(0), hk = n_k_heads, dk = head_k_dim;
  SPECD_CHECK(dk <= kMaxStagedDk, op, ": head_k_dim must be at most ", kMaxStagedDk, " on the GPU, got ", dk);
  const int64_t blocks = w * 2 * hk;
  SPECD_CHECK(blocks <= 0x7fffffff, op, ": at most 2^31 - 1 (token, q / k head) pairs on the GPU, got ", blocks);
  Tensor q = Tensor::empty({w, hk, dk}, DType::F32, Device::GPU);
  Tensor k = Tensor::empty({w, hk, dk}, DType::F32, Device::GPU);
  Tensor v = Tensor::empty({w, n_v_heads, head_v_dim}, DType::F32, Device::GPU);
  if (w == 0) return {q, k, v};
  // Fresh tensors (the composition's head copy and l2_norm output, q and k here) are 16-byte
  // aligned, so l2_norm takes its vector path exactly when dk % 4 == 0: so does this op.
  const bool vec = dk % 4 == 0;
  const int threads = threads_for(vec ? dk / 4 : dk);
  const size_t shmem = size_t(dk) * sizeof(float);
  cudaStream_t s = detail::stream();
  const int64_t vcols = n_v_heads * head_v_dim;
  if (vec)
    detail::launch_kernel<gdn_qkv_kernel<true>>("gdn_qkv_kernel", unsigned(blocks), threads, shmem, s, cv.ptr<float>(),
                                                q.ptr<float>(), k.ptr<float>(), v.ptr<float>(), hk, dk, vcols, eps);
  else
    detail::launch_kernel<gdn_qkv_kernel<false>>("gdn_qkv_kernel", unsigned(blocks), threads, shmem, s, cv.ptr<float>(),
                                                 q.ptr<float>(), k.ptr<float>(), v.ptr<float>(), hk, dk, vcols, eps);
  return {q, k, v};
}

}  // namespace specd::gpu
