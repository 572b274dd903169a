#include "rope.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "float_view.h"
#include "specd/error.h"
#include "specd/parallel.h"

namespace specd::cpu {

namespace {

constexpr const char* kOp = "rope_neox";

void check_yarn(const Yarn& y) {
  SPECD_CHECK(std::isfinite(y.factor) && y.factor >= 1.0, kOp, ": yarn_factor must be finite and >= 1, got ",
              y.factor);
  if (y.factor == 1.0) return;
  SPECD_CHECK(y.original_context > 0, kOp, ": yarn_original_context must be > 0 when yarn_factor > 1, got ",
              y.original_context);
  SPECD_CHECK(std::isfinite(y.beta_fast) && y.beta_fast > 0 && std::isfinite(y.beta_slow) && y.beta_slow > 0,
              kOp, ": yarn_beta_fast and yarn_beta_slow must be finite and > 0, got ", y.beta_fast, " and ",
              y.beta_slow);
}

// transformers' find_correction_dim: the dimension whose wavelength makes `rotations` turns over
// the original context.
double correction_dim(double rotations, int64_t dim, double theta, int64_t orig) {
  return double(dim) * std::log(double(orig) / (rotations * 2.0 * M_PI)) / (2.0 * std::log(theta));
}

void apply_yarn(RopeFreqs& f, int64_t n_rot, double theta, const Yarn& y) {
  double low = std::max(std::floor(correction_dim(y.beta_fast, n_rot, theta, y.original_context)), 0.0);
  double high = std::min(std::ceil(correction_dim(y.beta_slow, n_rot, theta, y.original_context)),
                         double(n_rot - 1));
  if (low == high) high += 0.001;
  for (size_t i = 0; i < f.inv_freq.size(); ++i) {
    double ramp = std::clamp((double(i) - low) / (high - low), 0.0, 1.0);  // 1: interpolate
    double extrap = f.inv_freq[i];
    f.inv_freq[i] = extrap / y.factor * ramp + extrap * (1.0 - ramp);
  }
}

}  // namespace

RopeFreqs rope_freqs(int64_t n_rot, double theta, const Yarn& yarn) {
  SPECD_CHECK(std::isfinite(theta) && theta > 0, kOp, ": theta must be finite and > 0, got ", theta);
  SPECD_CHECK(n_rot >= 0 && n_rot % 2 == 0, kOp, ": n_rot must be even and >= 0, got ", n_rot);
  check_yarn(yarn);
  RopeFreqs f;
  f.inv_freq.resize(size_t(n_rot / 2));
  for (int64_t i = 0; i < n_rot / 2; ++i) f.inv_freq[i] = 1.0 / std::pow(theta, double(2 * i) / double(n_rot));
  if (yarn.factor > 1.0 && n_rot > 0) apply_yarn(f, n_rot, theta, yarn);
  f.mscale = yarn.attention_factor ? *yarn.attention_factor
                                   : (yarn.factor > 1.0 ? 0.1 * std::log(yarn.factor) + 1.0 : 1.0);
  SPECD_CHECK(std::isfinite(f.mscale), kOp, ": yarn_attention_factor must be finite, got ", f.mscale);
  return f;
}

Tensor rope_neox(const Tensor& x, const Tensor& positions, int64_t n_rot, double theta, const Yarn& yarn) {
  check_rows(x, DType::F32, 3, kOp, "x");
  check_rows(positions, DType::I32, 1, kOp, "positions");
  int64_t n = x.dim(0), heads = x.dim(1), hd = x.dim(2);
  SPECD_CHECK(positions.dim(0) == n, kOp, ": positions has ", positions.dim(0), " entries, x has ", n, " rows");
  SPECD_CHECK(n_rot <= hd, kOp, ": n_rot must be <= head_dim (", hd, "), got ", n_rot);
  RopeFreqs f = rope_freqs(n_rot, theta, yarn);
  for (int64_t i = 0; i < n; ++i) {
    int32_t p = elem_at<int32_t>(positions, i);
    SPECD_CHECK(p >= 0, kOp, ": positions must be >= 0, got ", p, " at index ", i);
  }
  Tensor y = Tensor::empty(x.shape, DType::F32);
  int64_t half = n_rot / 2;
  parallel_for(n, std::max<int64_t>(1, 4096 / std::max<int64_t>(heads * hd, 1)), [&](int64_t b, int64_t e) {
    std::vector<double> cs(size_t(2 * half));
    for (int64_t t = b; t < e; ++t) {
      double pos = double(elem_at<int32_t>(positions, t));
      for (int64_t i = 0; i < half; ++i) {
        double a = pos * f.inv_freq[i];
        cs[2 * i] = std::cos(a) * f.mscale;
        cs[2 * i + 1] = std::sin(a) * f.mscale;
      }
      for (int64_t h = 0; h < heads; ++h) {
        const float* xr = row_at<float>(x, t * heads + h);
        float* yr = y.ptr<float>() + (t * heads + h) * hd;
        for (int64_t i = 0; i < half; ++i) {
          double x0 = xr[i], x1 = xr[i + half], c = cs[2 * i], s = cs[2 * i + 1];
          yr[i] = float(x0 * c - x1 * s);
          yr[i + half] = float(x1 * c + x0 * s);
        }
        std::memcpy(yr + n_rot, xr + n_rot, size_t(hd - n_rot) * sizeof(float));
      }
    }
  });
  return y;
}

}  // namespace specd::cpu
