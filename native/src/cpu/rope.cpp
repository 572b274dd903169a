#include "rope.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "attention.h"
#include "float_view.h"
#include "norm.h"
#include "ssm.h"  // overlap
#include "specd/error.h"
#include "specd/parallel.h"

namespace specd::cpu {

namespace {

void check_yarn(const Yarn& y, const char* op) {
  SPECD_CHECK(std::isfinite(y.factor) && y.factor >= 1.0, op, ": yarn_factor must be finite and >= 1, got ",
              y.factor);
  if (y.factor == 1.0) return;
  SPECD_CHECK(y.original_context > 0, op, ": yarn_original_context must be > 0 when yarn_factor > 1, got ",
              y.original_context);
  SPECD_CHECK(std::isfinite(y.beta_fast) && y.beta_fast > 0 && std::isfinite(y.beta_slow) && y.beta_slow > 0,
              op, ": yarn_beta_fast and yarn_beta_slow must be finite and > 0, got ", y.beta_fast, " and ",
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

// cs[2i], cs[2i + 1] = m cos(a), m sin(a) of pair i at position pos (a = pos * inv_freq[i]), in double.
void cos_sin(double pos, const RopeFreqs& f, double* cs) {
  for (size_t i = 0; i < f.inv_freq.size(); ++i) {
    double a = pos * f.inv_freq[i];
    cs[2 * i] = std::cos(a) * f.mscale;
    cs[2 * i + 1] = std::sin(a) * f.mscale;
  }
}

// One head of hd dims: each pair (x[i], x[i + half]) rotated by cs in double and rounded to F32
// once, dims >= 2 half copied. y does not alias x.
void rotate_row(const float* x, const double* cs, int64_t half, int64_t hd, float* y) {
  for (int64_t i = 0; i < half; ++i) {
    double x0 = x[i], x1 = x[i + half], c = cs[2 * i], s = cs[2 * i + 1];
    y[i] = float(x0 * c - x1 * s);
    y[i + half] = float(x1 * c + x0 * s);
  }
  std::memcpy(y + 2 * half, x + 2 * half, size_t(hd - 2 * half) * sizeof(float));
}

// An F32 input of qk_norm_rope: on `dev`, contiguous.
void check_f32_input(const Tensor& t, Device dev, const char* arg) {
  const char* op = "qk_norm_rope";
  check_device(t, dev, op, arg);
  check_dtype(t, DType::F32, op, arg);
  check_contiguous(t, op, arg);
}

void check_positions(const Tensor& positions, const char* op) {
  for (int64_t i = 0; i < positions.dim(0); ++i) {
    int32_t p = elem_at<int32_t>(positions, i);
    SPECD_CHECK(p >= 0, op, ": positions must be >= 0, got ", p, " at index ", i);
  }
}

}  // namespace

RopeFreqs rope_freqs(int64_t n_rot, double theta, const Yarn& yarn, const char* op) {
  SPECD_CHECK(std::isfinite(theta) && theta > 0, op, ": theta must be finite and > 0, got ", theta);
  SPECD_CHECK(n_rot >= 0 && n_rot % 2 == 0, op, ": n_rot must be even and >= 0, got ", n_rot);
  check_yarn(yarn, op);
  RopeFreqs f;
  f.inv_freq.resize(size_t(n_rot / 2));
  for (int64_t i = 0; i < n_rot / 2; ++i) f.inv_freq[i] = 1.0 / std::pow(theta, double(2 * i) / double(n_rot));
  if (yarn.factor > 1.0 && n_rot > 0) apply_yarn(f, n_rot, theta, yarn);
  f.mscale = yarn.attention_factor ? *yarn.attention_factor
                                   : (yarn.factor > 1.0 ? 0.1 * std::log(yarn.factor) + 1.0 : 1.0);
  SPECD_CHECK(std::isfinite(f.mscale), op, ": yarn_attention_factor must be finite, got ", f.mscale);
  return f;
}

Tensor rope_neox(const Tensor& x, const Tensor& positions, int64_t n_rot, double theta, const Yarn& yarn) {
  const char* op = "rope_neox";
  check_rows(x, DType::F32, 3, op, "x");
  check_rows(positions, DType::I32, 1, op, "positions");
  int64_t n = x.dim(0), heads = x.dim(1), hd = x.dim(2);
  SPECD_CHECK(positions.dim(0) == n, op, ": positions has ", positions.dim(0), " entries, x has ", n, " rows");
  SPECD_CHECK(n_rot <= hd, op, ": n_rot must be <= head_dim (", hd, "), got ", n_rot);
  RopeFreqs f = rope_freqs(n_rot, theta, yarn, op);
  check_positions(positions, op);
  Tensor y = Tensor::empty(x.shape, DType::F32);
  int64_t half = n_rot / 2;
  parallel_for(n, std::max<int64_t>(1, 4096 / std::max<int64_t>(heads * hd, 1)), [&](int64_t b, int64_t e) {
    std::vector<double> cs(size_t(2 * half));
    for (int64_t t = b; t < e; ++t) {
      cos_sin(double(elem_at<int32_t>(positions, t)), f, cs.data());
      for (int64_t h = 0; h < heads; ++h)
        rotate_row(row_at<float>(x, t * heads + h), cs.data(), half, hd, y.ptr<float>() + (t * heads + h) * hd);
    }
  });
  return y;
}

void check_qk_norm_rope_args(const Tensor& qg, const Tensor& k, const Tensor& q_norm_w, const Tensor& k_norm_w,
                             const Tensor& positions, int64_t n_rot, float eps, Device dev) {
  const char* op = "qk_norm_rope";
  check_f32_input(qg, dev, "qg");
  check_f32_input(k, dev, "k");
  check_ndim(qg, 3, op, "qg");
  check_ndim(k, 3, op, "k");
  const int64_t w = k.dim(0), hd = k.dim(2);
  SPECD_CHECK(qg.dim(0) == w && qg.dim(2) == 2 * hd, op, ": qg must be [w, heads, 2 * head_dim] = [", w,
              ", heads, ", 2 * hd, "] for k of shape [w, kv_heads, head_dim] = [", w, ", ", k.dim(1), ", ", hd,
              "], got [", qg.dim(0), ", ", qg.dim(1), ", ", qg.dim(2), "]");
  const auto head_weight = [&](const Tensor& t, const char* arg) {
    check_f32_input(t, dev, arg);
    SPECD_CHECK(t.numel() == hd, op, ": ", arg, " has ", t.numel(), " elements, heads have ", hd);
  };
  head_weight(q_norm_w, "q_norm_w");
  head_weight(k_norm_w, "k_norm_w");
  check_dtype(positions, DType::I32, op, "positions");
  check_ndim(positions, 1, op, "positions");
  SPECD_CHECK(positions.dim(0) == w, op, ": positions has ", positions.dim(0), " entries, qg and k have ", w,
              " rows");
  SPECD_CHECK(n_rot <= hd, op, ": n_rot must be <= head_dim (", hd, "), got ", n_rot);
  SPECD_CHECK(eps >= 0.0f && std::isfinite(eps), op, ": eps must be finite and >= 0");
}

void check_qk_cache_write(const QkCacheWrite& c, const Tensor& qg, const Tensor& k, const Tensor& q_norm_w,
                          const Tensor& k_norm_w, const Tensor& positions, Device dev) {
  const char* op = "qk_norm_rope";
  for (const auto& [cache, arg] : {std::pair{&c.k_cache, "k_cache"}, std::pair{&c.v_cache, "v_cache"}}) {
    check_device(*cache, dev, op, arg);
    check_kv_cache_format(*cache, op, arg);
  }
  SPECD_CHECK(c.k_cache.shape == c.v_cache.shape, op, ": k_cache and v_cache shapes differ");
  check_f32_input(c.v, dev, "v");
  SPECD_CHECK(c.v.shape == k.shape, op, ": v must have k's shape [w, kv_heads, head_dim]");
  check_dtype(c.rows, DType::I32, op, "rows");
  check_ndim(c.rows, 1, op, "rows");
  check_kv_write_shapes(c.k_cache, k, c.rows, op, "k_cache", "k");
  check_kv_write_shapes(c.v_cache, c.v, c.rows, op, "v_cache", "v");
  // One pass (one GPU launch) reads the inputs while it writes the caches: no byte may be both.
  SPECD_CHECK(!overlap(c.k_cache, c.v_cache), op, ": k_cache and v_cache must not overlap");
  for (const auto& [cache, arg] : {std::pair{&c.k_cache, "k_cache"}, std::pair{&c.v_cache, "v_cache"}})
    for (const Tensor* t : {&qg, &k, &c.v, &q_norm_w, &k_norm_w, &positions, &c.rows})
      SPECD_CHECK(t->device != cache->device || !overlap(*cache, *t), op, ": ", arg, " must not overlap the inputs");
}

Tensor qk_gate_view(const Tensor& qg) {
  Tensor gate = qg;  // qg's memory, owner and strides: rows stay 2 hd floats apart
  const int64_t hd = qg.dim(2) / 2;
  gate.shape[2] = hd;
  gate.data = qg.ptr<float>() + hd;
  return gate;
}

std::tuple<Tensor, Tensor, Tensor> qk_norm_rope(const Tensor& qg, const Tensor& k, const Tensor& q_norm_w,
                                                const Tensor& k_norm_w, const Tensor& positions, int64_t n_rot,
                                                double theta, float eps, const std::optional<QkCacheWrite>& cache) {
  const char* op = "qk_norm_rope";
  check_qk_norm_rope_args(qg, k, q_norm_w, k_norm_w, positions, n_rot, eps, Device::CPU);
  check_rows(positions, DType::I32, 1, op, "positions");
  RopeFreqs f = rope_freqs(n_rot, theta, Yarn{}, op);
  check_positions(positions, op);
  if (cache) {  // all of kv_write's checks, before anything is written
    check_qk_cache_write(*cache, qg, k, q_norm_w, k_norm_w, positions, Device::CPU);
    check_rows(cache->rows, DType::I32, 1, op, "rows");
    check_kv_rows(cache->rows, cache->k_cache.dim(0), op);
  }
  const int64_t w = k.dim(0), nh = qg.dim(1), nkv = k.dim(1), hd = k.dim(2), half = n_rot / 2;
  Tensor q = Tensor::empty({w, nh, hd}, DType::F32), ko = Tensor::empty(k.shape, DType::F32);
  parallel_for(w, std::max<int64_t>(1, 4096 / std::max<int64_t>((nh + nkv) * hd, 1)), [&](int64_t b, int64_t e) {
    std::vector<double> cs(size_t(2 * half));
    std::vector<float> normed(static_cast<size_t>(hd));
    for (int64_t t = b; t < e; ++t) {
      cos_sin(double(elem_at<int32_t>(positions, t)), f, cs.data());
      for (int64_t h = 0; h < nh + nkv; ++h) {  // q heads, then k heads
        const bool is_q = h < nh;
        const int64_t r = is_q ? t * nh + h : t * nkv + h - nh;
        rms_norm_row(is_q ? qg.ptr<float>() + r * 2 * hd : k.ptr<float>() + r * hd,
                     (is_q ? q_norm_w : k_norm_w).ptr<float>(), hd, eps, normed.data());
        rotate_row(normed.data(), cs.data(), half, hd, (is_q ? q : ko).ptr<float>() + r * hd);
      }
    }
  });
  if (cache) {  // the composition the GPU op fuses (the same bytes: kv_write's row codecs)
    kv_write(cache->k_cache, ko, cache->rows);
    kv_write(cache->v_cache, cache->v, cache->rows);
  }
  return {q, qk_gate_view(qg), ko};
}

}  // namespace specd::cpu
