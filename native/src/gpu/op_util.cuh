// Helpers shared by the GPU ops of ops2 (elementwise, rope, embedding, attention, ssm, topk): input
// checks that throw std::invalid_argument naming op and argument, host reads of small index
// tensors for value checks, and exact device-side decoders of the cache / table formats.
#pragma once
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "common.cuh"
#include "specd/error.h"
#include "specd/gpu.h"
#include "specd/tensor.h"

namespace specd::gpu::detail {

// A GPU tensor of `dtype`, contiguous, with `ndim` dimensions (ndim < 0: any).
inline void check_gpu_tensor(const Tensor& t, DType dtype, int64_t ndim, const char* op, const char* arg) {
  check_gpu(t, op, arg);
  check_dtype(t, dtype, op, arg);
  if (ndim >= 0) check_ndim(t, ndim, op, arg);
  check_contiguous(t, op, arg);
}

// The values of a small I32 tensor on the host (CPU tensors are read in place; GPU tensors are
// copied, which synchronises the library stream). Used for the value checks the CPU ops make
// (positions >= 0, cache rows in range and distinct, ids in range), so errors are raised as
// ValueError before any kernel runs.
inline std::vector<int32_t> host_i32(const Tensor& t) {
  std::vector<int32_t> v(size_t(t.numel()));
  if (v.empty()) return v;
  if (t.device == Device::GPU) {
    copy_to_host(v.data(), t.data, v.size() * sizeof(int32_t));
  } else {
    for (int64_t i = 0; i < t.numel(); ++i)
      v[size_t(i)] = *reinterpret_cast<const int32_t*>(static_cast<const uint8_t*>(t.data) + i * t.strides.back());
  }
  return v;
}

// An I32 index tensor (CPU or GPU, contiguous) as a GPU tensor: itself when on the GPU, else an
// asynchronous upload through the pinned staging slots (copy_to_device_async copies the host values
// before returning, so the host buffer may go away at once; large ones upload synchronously).
inline Tensor i32_on_gpu(const Tensor& t) {
  if (t.device == Device::GPU) return t;
  Tensor d = Tensor::empty(t.shape, DType::I32, Device::GPU);
  if (t.numel() > 0) copy_to_device_async(d.data, t.data, size_t(t.numel()) * sizeof(int32_t));
  return d;
}

// Whether an op must value-check index tensor `t` on the host: always for CPU tensors (free), for
// GPU tensors unless the caller vouches for the values (`trusted`: no read-back, no sync). The
// kernels guard every index either way, so a broken promise never reads or writes out of bounds.
inline bool check_on_host(const Tensor& t, bool trusted) { return t.device != Device::GPU || !trusted; }

// Floats from one row of t (F32, any rank) to the next when its rows are evenly spaced with a
// contiguous last dimension: a contiguous tensor or a column range of one (qk_norm_rope's gate), as
// mul_sigmoid and mul_sigmoid_matmul read their gate. Throws std::invalid_argument naming op and arg otherwise.
inline int64_t row_pitch(const Tensor& t, const char* op, const char* arg) {
  const char* want = " must have a contiguous last dimension and evenly spaced rows";
  SPECD_CHECK(t.ndim() == 0 || t.cols() <= 1 || t.strides.back() == 4, op, ": ", arg, want);
  std::optional<int64_t> pitch;  // bytes between rows, from the innermost dimension with several rows
  int64_t rows = 1;               // rows per step along dimension d
  for (int64_t d = t.ndim() - 2; d >= 0; --d) {
    if (t.shape[size_t(d)] > 1) {
      if (!pitch) pitch = t.strides[size_t(d)] / rows;
      SPECD_CHECK(t.strides[size_t(d)] == *pitch * rows && *pitch > 0 && *pitch % 4 == 0, op, ": ", arg, want);
    }
    rows *= t.shape[size_t(d)];
  }
  return pitch ? *pitch / 4 : t.cols();  // a single row: any pitch
}

// mul_sigmoid's arguments (a F32 contiguous on the GPU, gate F32 of a's shape with evenly spaced rows):
// gate's row pitch in floats. Throws std::invalid_argument naming op and the argument.
inline int64_t check_mul_sigmoid(const Tensor& a, const Tensor& gate, const char* op) {
  check_gpu_tensor(a, DType::F32, -1, op, "a");
  check_gpu(gate, op, "gate");
  check_dtype(gate, DType::F32, op, "gate");
  SPECD_CHECK(a.shape == gate.shape, op, ": a and gate must have the same shape");
  return row_pitch(gate, op, "gate");
}

inline void check_grid(int64_t blocks, const char* op) {
  SPECD_CHECK(blocks <= 0x7fffffff, op, ": too many rows for one launch (", blocks, " blocks)");
}

// Exact decoders (same values as cpu::dequantize_row): F16 and BF16 widen exactly, Q8_0 element is
// float(q) * d with d the fp16 block scale.
__device__ __forceinline__ float f16_at(const uint8_t* row, int64_t c) {
  return specd_fp16_bits_to_float(reinterpret_cast<const uint16_t*>(row)[c]);
}
__device__ __forceinline__ float bf16_at(const uint8_t* row, int64_t c) {
  return __uint_as_float(uint32_t(reinterpret_cast<const uint16_t*>(row)[c]) << 16);
}
__device__ __forceinline__ float q8_0_at(const uint8_t* row, int64_t c) {
  const uint8_t* blk = row + (c / 32) * 34;
  uint16_t dbits = uint16_t(blk[0]) | uint16_t(uint16_t(blk[1]) << 8);
  float d = specd_fp16_bits_to_float(dbits);
  return float(reinterpret_cast<const int8_t*>(blk + 2)[c % 32]) * d;
}

}  // namespace specd::gpu::detail
