#include "norm.h"

#include <cmath>
#include <cstring>

#include "activations.h"
#include "specd/error.h"
#include "specd/parallel.h"

namespace specd::cpu {

namespace {

// Sum of squares of one row in a fixed order (double accumulator), independent of the batch.
double sum_squares(const float* x, int64_t d) {
  double s = 0.0;
  for (int64_t i = 0; i < d; ++i) s += double(x[i]) * double(x[i]);
  return s;
}

// The RMSNorm scale of one row, as float (the double mean of squares, rounded once).
float rms_scale(const float* x, int64_t d, float eps) {
  return float(1.0 / std::sqrt(sum_squares(x, d) / double(d) + double(eps)));
}

// One row of the L2 norm: y = x / sqrt(sum(x^2) + eps), the scale rounded to F32 once.
void l2_row(const float* x, float* y, int64_t d, float eps) {
  float scale = float(1.0 / std::sqrt(sum_squares(x, d) + double(eps)));
  for (int64_t i = 0; i < d; ++i) y[i] = x[i] * scale;
}

}  // namespace

void rms_norm_row(const float* x, const float* weight, int64_t d, float eps, float* y) {
  const float scale = rms_scale(x, d, eps);
  for (int64_t i = 0; i < d; ++i) y[i] = x[i] * scale * (weight ? weight[i] : 1.0f);
}

void check_like_x(const Tensor& t, const Tensor& x, Device dev, const char* op, const char* arg) {
  check_device(t, dev, op, arg);
  check_dtype(t, DType::F32, op, arg);
  check_contiguous(t, op, arg);
  SPECD_CHECK(t.shape == x.shape, op, ": ", arg, " shape differs from x");
}

void check_rms_args(const Tensor& x, const std::optional<Tensor>& weight, float eps, Device dev, const char* op) {
  check_device(x, dev, op, "x");
  check_dtype(x, DType::F32, op, "x");
  check_contiguous(x, op, "x");
  SPECD_CHECK(x.ndim() >= 1, op, ": x must have at least 1 dimension");
  if (weight) {
    check_device(*weight, dev, op, "weight");
    check_dtype(*weight, DType::F32, op, "weight");
    check_contiguous(*weight, op, "weight");
    SPECD_CHECK(weight->numel() == x.cols(), op, ": weight has ", weight->numel(), " elements, x rows have ",
                x.cols());
  }
  SPECD_CHECK(eps >= 0.0f && std::isfinite(eps), op, ": eps must be finite and >= 0");
}

std::pair<Tensor, Tensor> rms_norm(const Tensor& x, const std::optional<Tensor>& weight, float eps,
                                   const std::optional<Tensor>& residual) {
  const char* op = "rms_norm";
  check_rms_args(x, weight, eps, Device::CPU, op);
  if (residual) check_like_x(*residual, x, Device::CPU, op, "residual");
  int64_t d = x.cols(), rows = x.rows();
  Tensor y = Tensor::empty(x.shape, DType::F32);
  Tensor h = residual ? Tensor::empty(x.shape, DType::F32) : x;
  const float* w = weight ? weight->ptr<float>() : nullptr;
  parallel_for(rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* xr = x.ptr<float>() + r * d;
      float* hr = h.ptr<float>() + r * d;
      if (residual) {
        const float* rr = residual->ptr<float>() + r * d;
        for (int64_t i = 0; i < d; ++i) hr[i] = xr[i] + rr[i];
      }
      rms_norm_row(residual ? hr : xr, w, d, eps, y.ptr<float>() + r * d);
    }
  });
  return {y, h};
}

Tensor rms_norm_gated(const Tensor& x, const std::optional<Tensor>& weight, float eps, const Tensor& z) {
  const char* op = "rms_norm_gated";
  check_rms_args(x, weight, eps, Device::CPU, op);
  check_like_x(z, x, Device::CPU, op, "z");
  int64_t d = x.cols(), rows = x.rows();
  Tensor y = Tensor::empty(x.shape, DType::F32);
  const float* w = weight ? weight->ptr<float>() : nullptr;
  parallel_for(rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* xr = x.ptr<float>() + r * d;
      const float* zr = z.ptr<float>() + r * d;
      float scale = rms_scale(xr, d, eps);
      float* yr = y.ptr<float>() + r * d;
      for (int64_t i = 0; i < d; ++i) {
        const float normed = xr[i] * scale * (w ? w[i] : 1.0f);  // rms_norm's value, rounded as there
        yr[i] = normed * silu(zr[i]);
      }
    }
  });
  return y;
}

Tensor l2_norm(const Tensor& x, float eps) {
  const char* op = "l2_norm";
  check_cpu(x, op, "x");
  check_dtype(x, DType::F32, op, "x");
  check_contiguous(x, op, "x");
  SPECD_CHECK(eps >= 0.0f && std::isfinite(eps), op, ": eps must be finite and >= 0");
  int64_t d = x.cols(), rows = x.rows();
  Tensor y = Tensor::empty(x.shape, DType::F32);
  parallel_for(rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) l2_row(x.ptr<float>() + r * d, y.ptr<float>() + r * d, d, eps);
  });
  return y;
}

void check_gdn_qkv_args(const Tensor& cv, int64_t n_k_heads, int64_t head_k_dim, int64_t n_v_heads,
                        int64_t head_v_dim, float eps, Device dev) {
  const char* op = "gdn_qkv";
  check_device(cv, dev, op, "cv");
  check_dtype(cv, DType::F32, op, "cv");
  check_ndim(cv, 2, op, "cv");
  check_contiguous(cv, op, "cv");
  SPECD_CHECK(n_k_heads > 0 && head_k_dim > 0 && n_v_heads > 0 && head_v_dim > 0, op,
              ": n_k_heads, head_k_dim, n_v_heads and head_v_dim must be > 0, got ", n_k_heads, ", ", head_k_dim,
              ", ", n_v_heads, ", ", head_v_dim);
  const int64_t c = cv.dim(1);
  // Each product is compared with c before it is formed (no overflow).
  SPECD_CHECK(n_k_heads <= c / 2 && head_k_dim <= c / (2 * n_k_heads) && n_v_heads <= c &&
                  head_v_dim <= c / n_v_heads && 2 * n_k_heads * head_k_dim + n_v_heads * head_v_dim == c,
              op, ": cv has ", c, " columns, expected 2 * n_k_heads * head_k_dim + n_v_heads * head_v_dim = 2 * ",
              n_k_heads, " * ", head_k_dim, " + ", n_v_heads, " * ", head_v_dim);
  SPECD_CHECK(eps >= 0.0f && std::isfinite(eps), op, ": eps must be finite and >= 0");
}

std::tuple<Tensor, Tensor, Tensor> gdn_qkv(const Tensor& cv, int64_t n_k_heads, int64_t head_k_dim,
                                           int64_t n_v_heads, int64_t head_v_dim, float eps) {
  check_gdn_qkv_args(cv, n_k_heads, head_k_dim, n_v_heads, head_v_dim, eps, Device::CPU);
  const int64_t w = cv.dim(0), c = cv.dim(1), hk = n_k_heads, dk = head_k_dim, qk = hk * dk;
  const int64_t vcols = c - 2 * qk;
  Tensor q = Tensor::empty({w, hk, dk}, DType::F32), k = Tensor::empty({w, hk, dk}, DType::F32);
  Tensor v = Tensor::empty({w, n_v_heads, head_v_dim}, DType::F32);
  parallel_for(w, std::max<int64_t>(1, 16384 / c), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* row = cv.ptr<float>() + t * c;
      for (int64_t h = 0; h < hk; ++h) {
        l2_row(row + h * dk, q.ptr<float>() + t * qk + h * dk, dk, eps);
        l2_row(row + qk + h * dk, k.ptr<float>() + t * qk + h * dk, dk, eps);
      }
      std::memcpy(v.ptr<float>() + t * vcols, row + 2 * qk, size_t(vcols) * sizeof(float));
    }
  });
  return {q, k, v};
}

}  // namespace specd::cpu
