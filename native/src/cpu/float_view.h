// Helpers shared by the float ops (rope, attention, ssm, activations, sampling): checked access to
// 4-byte-element tensors (F32, I32) whose innermost dimension is contiguous while the outer
// dimensions may have any byte strides. Such "row-strided" views are what numpy slicing of a fused
// projection produces (e.g. gate_up[:, :I]), so the ops read them without a copy.
#pragma once
#include <cstdint>

#include "specd/error.h"
#include "specd/tensor.h"

namespace specd::cpu {

// Throws unless t is a CPU tensor of `dtype` (4-byte elements), with exactly `ndim` dimensions
// (ndim < 0: any) and a contiguous innermost dimension.
inline void check_rows(const Tensor& t, DType dtype, int64_t ndim, const char* op, const char* arg) {
  check_cpu(t, op, arg);
  check_dtype(t, dtype, op, arg);
  if (ndim >= 0) check_ndim(t, ndim, op, arg);
  SPECD_CHECK(t.ndim() == 0 || t.cols() <= 1 || t.numel() == 0 || t.strides.back() == 4, op, ": ", arg,
              " must have a contiguous last dimension");
}

// Byte offset of flattened row r (over all dimensions but the last) of a row-strided tensor.
inline int64_t row_offset(const Tensor& t, int64_t r) {
  int64_t off = 0;
  for (int64_t d = t.ndim() - 2; d >= 0; --d) {
    off += (r % t.shape[d]) * t.strides[d];
    r /= t.shape[d];
  }
  return off;
}

template <class T>
inline const T* row_at(const Tensor& t, int64_t r) {
  return reinterpret_cast<const T*>(static_cast<const uint8_t*>(t.data) + row_offset(t, r));
}

// Element i of a 1-D tensor with any stride.
template <class T>
inline T elem_at(const Tensor& t, int64_t i) {
  return *reinterpret_cast<const T*>(static_cast<const uint8_t*>(t.data) + i * t.strides[0]);
}

// Dot product of two float vectors with 8 independent partial sums combined in a fixed order: the
// result depends only on the inputs and n (never on threads or batch), and the compiler may
// vectorise the lanes.
inline float dot_f32(const float* a, const float* b, int64_t n) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) lane[l] += a[i + l] * b[i + l];
  for (int l = 0; i < n; ++i, ++l) lane[l] += a[i] * b[i];
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

}  // namespace specd::cpu
