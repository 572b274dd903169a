#include "activations.h"

#include <algorithm>

#include "float_view.h"
#include "specd/error.h"
#include "specd/parallel.h"

namespace specd::cpu {

namespace {

// y = f(x) elementwise over the rows of a row-strided x.
template <class F>
Tensor unary(const Tensor& x, const char* op, F f) {
  check_rows(x, DType::F32, -1, op, "x");
  Tensor y = Tensor::empty(x.shape, DType::F32);
  int64_t d = x.cols(), rows = x.rows();
  parallel_for(rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* xr = row_at<float>(x, r);
      float* yr = y.ptr<float>() + r * d;
      for (int64_t i = 0; i < d; ++i) yr[i] = f(xr[i]);
    }
  });
  return y;
}

// b of shape [H] or [1, H] with a of shape [..., H] (mul / add broadcast it over a's rows).
bool broadcasts(const Tensor& a, const Tensor& b) {
  const int64_t h = a.ndim() >= 1 ? a.shape.back() : 1;
  return b.ndim() >= 1 && b.ndim() <= 2 && b.shape.back() == h && b.numel() == h;
}

template <class F>
Tensor binary(const Tensor& a, const Tensor& b, const char* op, const char* an, const char* bn, bool broadcast, F f) {
  check_rows(a, DType::F32, -1, op, an);
  check_rows(b, DType::F32, -1, op, bn);
  SPECD_CHECK(a.shape == b.shape || (broadcast && broadcasts(a, b)), op, ": ", an, " and ", bn,
              " must have the same shape", broadcast ? " (or b of shape [H] / [1, H] for a of shape [..., H])" : "");
  const bool one_row = a.shape != b.shape;
  Tensor y = Tensor::empty(a.shape, DType::F32);
  int64_t d = a.cols(), rows = a.rows();
  parallel_for(rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)), [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r) {
      const float* ar = row_at<float>(a, r);
      const float* br = row_at<float>(b, one_row ? 0 : r);
      float* yr = y.ptr<float>() + r * d;
      for (int64_t i = 0; i < d; ++i) yr[i] = f(ar[i], br[i]);
    }
  });
  return y;
}

}  // namespace

Tensor silu(const Tensor& x) { return unary(x, "silu", [](float v) { return silu(v); }); }
Tensor sigmoid(const Tensor& x) { return unary(x, "sigmoid", [](float v) { return sigmoid(v); }); }
Tensor softplus(const Tensor& x) { return unary(x, "softplus", [](float v) { return softplus(v); }); }

Tensor swiglu(const Tensor& gate, const Tensor& up) {
  return binary(gate, up, "swiglu", "gate", "up", false,
                [](float g, float u) { return float(double(g) * sigmoid_f64(g) * double(u)); });
}
Tensor mul(const Tensor& a, const Tensor& b) {
  return binary(a, b, "mul", "a", "b", true, [](float x, float y) { return x * y; });
}
Tensor add(const Tensor& a, const Tensor& b) {
  return binary(a, b, "add", "a", "b", true, [](float x, float y) { return x + y; });
}
Tensor mul_sigmoid(const Tensor& a, const Tensor& gate) {
  return binary(a, gate, "mul_sigmoid", "a", "gate", false, [](float x, float g) { return x * sigmoid(g); });
}

void check_partials(const Tensor& p, Device device, const char* op, const char* arg) {
  check_device(p, device, op, arg);
  check_dtype(p, DType::F32, op, arg);
  check_contiguous(p, op, arg);
  SPECD_CHECK(p.ndim() >= 2, op, ": ", arg, " must be split-K partials [S, ...] (at least 2 dimensions), got ",
              p.ndim(), " dimension(s)");
  SPECD_CHECK(p.dim(0) >= 1 && p.dim(0) <= (int64_t(1) << 16), op, ": ", arg, " must hold 1 .. 65536 partials, got ",
              p.dim(0));
}

Tensor first_part(const Tensor& p) {
  Tensor v = p;
  v.shape.erase(v.shape.begin());
  v.strides = contiguous_strides(v.shape, v.dtype);
  return v;
}

Tensor sum_partials(const Tensor& p, const char* op, const char* arg) {
  check_partials(p, Device::CPU, op, arg);
  if (p.dim(0) == 1) return first_part(p);  // the value itself: a view
  Tensor y = Tensor::empty(first_part(p).shape, DType::F32);
  const int64_t count = y.numel(), splits = p.dim(0);
  const float* src = p.ptr<float>();
  float* dst = y.ptr<float>();
  parallel_for(count, 16384, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j) {
      float v = src[j];
      for (int64_t k = 1; k < splits; ++k) v += src[k * count + j];
      dst[j] = v;
    }
  });
  return y;
}

int64_t check_gdn_gates_shapes(const Tensor& a, const Tensor& b, const Tensor& dt, const Tensor& ssm_a) {
  SPECD_CHECK(a.ndim() == 2, "gdn_gates: a must be [T, H], got ", a.ndim(), " dimensions");
  SPECD_CHECK(b.shape == a.shape, "gdn_gates: b must have a's shape [T, H]");
  const int64_t h = a.shape[1];
  const auto per_head = [h](const Tensor& v, const char* arg) {
    SPECD_CHECK((v.ndim() == 1 || (v.ndim() == 2 && v.shape[0] == 1)) && v.shape.back() == h, "gdn_gates: ", arg,
                " must have shape [H] or [1, H] with H = ", h);
  };
  per_head(dt, "dt");
  per_head(ssm_a, "ssm_a");
  return h;
}

std::pair<Tensor, Tensor> gdn_gates(const Tensor& a, const Tensor& b, const Tensor& dt, const Tensor& ssm_a) {
  check_rows(a, DType::F32, 2, "gdn_gates", "a");
  check_rows(b, DType::F32, 2, "gdn_gates", "b");
  check_rows(dt, DType::F32, -1, "gdn_gates", "dt");
  check_rows(ssm_a, DType::F32, -1, "gdn_gates", "ssm_a");
  const int64_t t = a.shape[0], h = check_gdn_gates_shapes(a, b, dt, ssm_a);
  Tensor g = Tensor::empty(a.shape, DType::F32), beta = Tensor::empty(a.shape, DType::F32);
  const float* dv = row_at<float>(dt, 0);
  const float* sv = row_at<float>(ssm_a, 0);
  parallel_for(t, std::max<int64_t>(1, 16384 / std::max<int64_t>(h, 1)), [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r) {
      const float* ar = row_at<float>(a, r);
      const float* br = row_at<float>(b, r);
      float* gr = g.ptr<float>() + r * h;
      float* betar = beta.ptr<float>() + r * h;
      for (int64_t i = 0; i < h; ++i) {
        const float x = ar[i] + dv[i];  // rounded to F32 here, as add()
        gr[i] = softplus(x) * sv[i];
        betar[i] = sigmoid(br[i]);
      }
    }
  });
  return {g, beta};
}

}  // namespace specd::cpu
