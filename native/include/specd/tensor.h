// specd::Tensor: a typed view of a buffer on the CPU or the GPU.
//
// Shape is the logical element shape, outermost dimension first (numpy order), so a GGUF weight
// with ggml ne = [in, out] is a Tensor of shape {out, in}. Strides are in bytes. For block formats
// (Q8_0, Q4_K, ...) the innermost dimension must be contiguous and a multiple of the block size;
// rows are then sequences of ggml blocks. `holder` keeps the memory alive: a numpy array (for
// zero-copy views, including memory-mapped GGUF data), a heap allocation or a device buffer.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "specd/dtype.h"

namespace specd {

enum class Device : int32_t { CPU = 0, GPU = 1 };

struct Tensor {
  DType dtype = DType::F32;
  Device device = Device::CPU;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // bytes
  void* data = nullptr;
  std::shared_ptr<void> holder;
  bool writable = true;  // false for views of read-only memory (a GGUF memory map, a read-only array)

  int64_t ndim() const { return static_cast<int64_t>(shape.size()); }
  int64_t dim(int64_t i) const { return shape.at(i < 0 ? i + ndim() : i); }
  int64_t numel() const;  // throws std::invalid_argument if the product overflows int64
  // Innermost dimension (elements) and the number of rows (product of the outer dimensions).
  int64_t cols() const { return shape.empty() ? 1 : shape.back(); }
  int64_t rows() const { return cols() == 0 ? 0 : numel() / cols(); }
  int64_t row_bytes() const { return row_size(dtype, cols()); }
  int64_t nbytes() const { return rows() * row_bytes(); }
  bool is_contiguous() const;

  template <class T>
  T* ptr() const { return static_cast<T*>(data); }
  // Pointer to row r of a tensor whose outer dimensions are contiguous over rows.
  uint8_t* row_ptr(int64_t r) const { return static_cast<uint8_t*>(data) + r * row_bytes(); }

  // A new contiguous tensor with uninitialised contents (zeros() clears it).
  static Tensor empty(const std::vector<int64_t>& shape, DType dtype, Device device = Device::CPU);
  static Tensor zeros(const std::vector<int64_t>& shape, DType dtype, Device device = Device::CPU);
  // Same buffer, new shape (contiguous tensors only; element counts must match).
  Tensor reshape(const std::vector<int64_t>& new_shape) const;
};

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape, DType dtype);

// Shape/dtype/device checks that throw std::invalid_argument naming `op` and `arg`.
void check_dtype(const Tensor& t, DType want, const char* op, const char* arg);
void check_ndim(const Tensor& t, int64_t want, const char* op, const char* arg);
void check_contiguous(const Tensor& t, const char* op, const char* arg);
void check_cpu(const Tensor& t, const char* op, const char* arg);
void check_device(const Tensor& t, Device want, const char* op, const char* arg);  // "must be on the CPU / GPU"
// For ops that write into an argument (KV cache, recurrent and conv states).
void check_writable(const Tensor& t, const char* op, const char* arg);

}  // namespace specd
