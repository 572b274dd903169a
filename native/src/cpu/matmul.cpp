#include "matmul.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>
#include <vector>

#include "quants.h"
#include "specd/error.h"
#include "specd/parallel.h"

namespace specd::cpu {

namespace {

// Dot products keep 16 partial sums per output (lane l sums k = l mod 16), held in native vector
// registers: one AVX-512 register, two AVX ones or four SSE ones (GCC/Clang vector extension). The
// arithmetic per lane is the same whatever the register width.
#if defined(__AVX512F__)
#define SPECD_VEC_BYTES 64
constexpr int kXTile = 4;  // x rows per register tile: 16 accumulators of 32 zmm registers
#elif defined(__AVX__)
#define SPECD_VEC_BYTES 32
constexpr int kXTile = 1;  // 16 ymm registers: 8 accumulators, 4 weight vectors, 1 x vector
#else
#define SPECD_VEC_BYTES 16
constexpr int kXTile = 1;
#endif
typedef float vec __attribute__((vector_size(SPECD_VEC_BYTES)));
constexpr int kLanes = 16;
constexpr int kVecLanes = SPECD_VEC_BYTES / 4;
constexpr int kVecs = kLanes / kVecLanes;  // vectors per 16 partial sums
constexpr int kWTile = 4;                  // weight rows per register tile
constexpr int kPanelTiles = 8;             // at most 8 tiles (32 rows) decoded together

inline vec loadv(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Fixed pairwise combination of the 16 lane sums: (l, l+8), then (l, l+4), (l, l+2), (l, l+1).
inline float reduce_lanes(const vec* v) {
  float a[kLanes];
  std::memcpy(a, v, sizeof a);
  for (int width = kLanes / 2; width >= 1; width /= 2)
    for (int l = 0; l < width; ++l) a[l] += a[l + width];
  return a[0];
}

// acc[i][r] += x[i][off + l] * w[r][off + l] for the 16 lanes l.
template <int XR, int R>
inline void dot_step(vec (&acc)[XR][R][kVecs], const float* const* x, const float* const* w, int64_t off) {
  for (int v = 0; v < kVecs; ++v) {
    int64_t kv = off + v * kVecLanes;
    vec wv[R];
    for (int r = 0; r < R; ++r) wv[r] = loadv(w[r] + kv);
    for (int i = 0; i < XR; ++i) {
      vec xv = loadv(x[i] + kv);
      for (int r = 0; r < R; ++r) acc[i][r][v] += xv * wv[r];
    }
  }
}

// y[i][r] = dot(x[i], w[r]) for XR rows of x and R weight rows. Each output element has its own 16
// lane sums (lane l adds x[k] * w[k] for k = l mod 16, in increasing k; the last partial group is
// zero-padded), combined by the fixed pairwise reduction. Every output runs this same arithmetic
// whatever XR and R, so neither the number of x rows in the call nor the tiling changes a result
// (batch invariance).
template <int XR, int R>
void dot_block(const float* const* x, const float* const* w, int64_t in, float* const* y) {
  vec acc[XR][R][kVecs] = {};
  int64_t body = in / kLanes * kLanes;
  for (int64_t k = 0; k < body; k += kLanes) dot_step(acc, x, w, k);
  if (body < in) {  // the last in % 16 elements, zero-padded to 16 lanes
    float xt[XR][kLanes] = {}, wt[R][kLanes] = {};
    const float* xp[XR];
    const float* wp[R];
    for (int i = 0; i < XR; ++i) {
      std::memcpy(xt[i], x[i] + body, sizeof(float) * size_t(in - body));
      xp[i] = xt[i];
    }
    for (int r = 0; r < R; ++r) {
      std::memcpy(wt[r], w[r] + body, sizeof(float) * size_t(in - body));
      wp[r] = wt[r];
    }
    dot_step(acc, xp, wp, 0);
  }
  for (int i = 0; i < XR; ++i)
    for (int r = 0; r < R; ++r) y[i][r] = reduce_lanes(acc[i][r]);
}

using DotBlock = void (*)(const float* const*, const float* const*, int64_t, float* const*);

template <int XR, int... R>
constexpr std::array<DotBlock, sizeof...(R)> dot_row(std::integer_sequence<int, R...>) {
  return {&dot_block<XR, R + 1>...};
}

template <int... XR>
constexpr std::array<std::array<DotBlock, kWTile>, sizeof...(XR)> dot_table(std::integer_sequence<int, XR...>) {
  return {dot_row<XR + 1>(std::make_integer_sequence<int, kWTile>())...};
}

// kDot[xr - 1][r - 1] handles xr rows of x against r weight rows.
constexpr auto kDot = dot_table(std::make_integer_sequence<int, kXTile>());

// Weight rows decoded together: as many 4-row tiles as fit in about 256 KiB of floats (1 to 8), so
// the decoded panel stays in cache while every x tile runs against it.
int64_t panel_rows(int64_t in) {
  int64_t tiles = (256 << 10) / (kWTile * int64_t(sizeof(float)) * std::max<int64_t>(in, 1));
  return std::clamp<int64_t>(tiles, 1, kPanelTiles) * kWTile;
}

// Points wrows[j] at row p0 + j of w for j < rows: F32 rows in place, others decoded into buf.
void decode_rows(const Tensor& w, int64_t p0, int64_t rows, float* buf, const float** wrows) {
  int64_t in = w.dim(1);
  for (int64_t j = 0; j < rows; ++j) {
    const uint8_t* src = w.row_ptr(p0 + j);
    if (w.dtype == DType::F32) {
      wrows[j] = reinterpret_cast<const float*>(src);
    } else {
      dequantize_row(w.dtype, src, buf + j * in, in);
      wrows[j] = buf + j * in;
    }
  }
}

// y[i, p0 + j] = dot(x[i], wrows[j]) for every row i of x and j < rows, tile by tile.
void multiply_panel(const Tensor& x, const float* const* wrows, int64_t rows, Tensor& y, int64_t p0) {
  int64_t n = x.dim(0), in = x.dim(1), out = y.dim(1);
  const float* xrows[kXTile];
  float* yrows[kXTile];
  for (int64_t i0 = 0; i0 < n; i0 += kXTile) {
    int xr = int(std::min<int64_t>(kXTile, n - i0));
    for (int64_t t = 0; t < rows; t += kWTile) {
      int r = int(std::min<int64_t>(kWTile, rows - t));
      for (int i = 0; i < xr; ++i) {
        xrows[i] = x.ptr<float>() + (i0 + i) * in;
        yrows[i] = y.ptr<float>() + (i0 + i) * out + p0 + t;
      }
      kDot[xr - 1][r - 1](xrows, wrows + t, in, yrows);
    }
  }
}

void check_weight(const Tensor& w, const char* op) {
  check_cpu(w, op, "w");
  check_weight_dtype(w, op, "w");
  check_ndim(w, 2, op, "w");
  check_contiguous(w, op, "w");
}

}  // namespace

Tensor matmul(const Tensor& x, const Tensor& w) {
  const char* op = "matmul";
  check_cpu(x, op, "x");
  check_dtype(x, DType::F32, op, "x");
  check_ndim(x, 2, op, "x");
  check_contiguous(x, op, "x");
  check_weight(w, op);
  int64_t n = x.dim(0), in = x.dim(1), out = w.dim(0);
  SPECD_CHECK(w.dim(1) == in, op, ": x has ", in, " columns but w (shape [out, in]) has ", w.dim(1));
  Tensor y = Tensor::empty({n, out}, DType::F32);
  if (n == 0 || out == 0) return y;
  const int64_t panel = panel_rows(in), panels = (out + panel - 1) / panel;
  parallel_for(panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(w.dtype == DType::F32 ? 0 : static_cast<size_t>(panel * in));
    std::vector<const float*> wrows(static_cast<size_t>(panel));
    for (int64_t p = begin; p < end; ++p) {
      int64_t p0 = p * panel, rows = std::min<int64_t>(panel, out - p0);
      decode_rows(w, p0, rows, buf.data(), wrows.data());
      multiply_panel(x, wrows.data(), rows, y, p0);
    }
  });
  return y;
}

Tensor embedding(const Tensor& w, const Tensor& ids) {
  const char* op = "embedding";
  check_weight(w, op);
  check_cpu(ids, op, "ids");
  check_dtype(ids, DType::I32, op, "ids");
  check_ndim(ids, 1, op, "ids");
  check_contiguous(ids, op, "ids");
  int64_t n = ids.dim(0), vocab = w.dim(0), h = w.dim(1);
  const int32_t* id = ids.ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i)
    SPECD_CHECK(id[i] >= 0 && id[i] < vocab, op, ": ids[", i, "] = ", id[i], " is out of range for ", vocab,
                " rows of w");
  Tensor y = Tensor::empty({n, h}, DType::F32);
  parallel_for(n, std::max<int64_t>(1, 16384 / std::max<int64_t>(h, 1)), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) dequantize_row(w.dtype, w.row_ptr(id[i]), y.ptr<float>() + i * h, h);
  });
  return y;
}

}  // namespace specd::cpu
