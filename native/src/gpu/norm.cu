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
#include <cmath>

#include "../cpu/norm.h"
#include "common.cuh"
#include "norm.cuh"
#include "ops.h"

namespace specd::gpu {

namespace {

using namespace detail::norm;

// Mode: RMS (mean of squares, optional weight, optional residual) or L2 (sum of squares).
enum class Mode { RMS, L2 };

// x, residual, h, z, y: [rows, d]; w: [d] or null. h is written only with a residual, z read only
// when GATE (then y = norm * silu(z)). The second pass re-reads the row this thread wrote or read
// in the first pass (same thread, so the h stores are visible; the row is usually still in L1/L2).
template <Mode M, bool VEC, bool RESID, bool GATE>
__global__ void norm_kernel(const float* __restrict__ x, const float* __restrict__ residual,
                            const float* __restrict__ w, float* h, const float* __restrict__ z,
                            float* __restrict__ y, int64_t d, float eps) {
  using T = typename Row<VEC>::T;
  const int64_t n = d / Row<VEC>::kWidth;  // vectors (or floats) per row
  const int64_t off = int64_t(blockIdx.x) * d;
  const T* xr = reinterpret_cast<const T*>(x + off);
  T* hr = RESID ? reinterpret_cast<T*>(h + off) : nullptr;
  const T* zr = GATE ? reinterpret_cast<const T*>(z + off) : nullptr;
  T* yr = reinterpret_cast<T*>(y + off);
  const double ss = block_sum(row_squares<RESID>(xr, RESID ? reinterpret_cast<const T*>(residual + off) : nullptr, hr, n));
  const float scale = M == Mode::RMS ? rms_scale(ss, d, eps) : l2_scale(ss, eps);
  const T* src = RESID ? const_cast<const T*>(hr) : xr;
  const T* wr = reinterpret_cast<const T*>(w);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    yr[i] = normed<GATE>(src[i], scale, wr ? wr + i : nullptr, GATE ? zr[i] : T{});
}

template <Mode M, bool RESID, bool GATE = false>
void launch(const float* x, const float* r, const float* w, float* h, float* y, int64_t rows, int64_t d,
            float eps, const float* z = nullptr) {
  bool vec = d % 4 == 0 && detail::aligned16(x) && detail::aligned16(y) && (!w || detail::aligned16(w)) &&
             (!RESID || (detail::aligned16(r) && detail::aligned16(h))) && (!GATE || detail::aligned16(z));
  int threads = threads_for(vec ? d / 4 : d);
  cudaStream_t s = detail::stream();
  // rows <= 2^31 - 1 (grid x limit) is checked by the caller.
  if (vec)
    norm_kernel<M, true, RESID, GATE><<<unsigned(rows), threads, 0, s>>>(x, r, w, h, z, y, d, eps);
  else
    norm_kernel<M, false, RESID, GATE><<<unsigned(rows), threads, 0, s>>>(x, r, w, h, z, y, d, eps);
  SPECD_GPU_CHECK_LAUNCH("norm_kernel");
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

}  // namespace specd::gpu
