#include "specd/tensor.h"

#include <cstdlib>
#include <cstring>

#include "specd/error.h"
#include "specd/gpu.h"

namespace specd {

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) SPECD_CHECK(!__builtin_mul_overflow(n, d, &n), "tensor shape overflows int64 elements");
  return n;
}

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape, DType dtype) {
  std::vector<int64_t> strides(shape.size());
  if (shape.empty()) return strides;
  int64_t s = dtype_info(dtype).type_size;
  strides.back() = s;
  s = row_size(dtype, shape.back());
  for (int64_t i = int64_t(shape.size()) - 2; i >= 0; --i) {
    strides[i] = s;
    SPECD_CHECK(!__builtin_mul_overflow(s, shape[i], &s), "tensor size overflows int64 bytes");
  }
  return strides;
}

bool Tensor::is_contiguous() const {
  if (numel() == 0) return true;
  std::vector<int64_t> want = contiguous_strides(shape, dtype);
  for (size_t i = 0; i < shape.size(); ++i)
    if (shape[i] != 1 && strides[i] != want[i]) return false;
  return true;
}

Tensor Tensor::empty(const std::vector<int64_t>& shape, DType dtype, Device device) {
  Tensor t;
  t.dtype = dtype;
  t.device = device;
  t.shape = shape;
  for (int64_t d : shape) SPECD_CHECK(d >= 0, "negative dimension in tensor shape");
  t.strides = contiguous_strides(shape, dtype);
  int64_t nbytes = 0;
  SPECD_CHECK(!__builtin_mul_overflow(t.rows(), t.row_bytes(), &nbytes), "tensor size overflows int64 bytes");
  size_t bytes = static_cast<size_t>(nbytes);
  if (device == Device::GPU) {
    t.holder = gpu::alloc(bytes);
    t.data = t.holder.get();
    return t;
  }
  // 64-byte alignment for vector loads; std::free as the deleter.
  size_t padded = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, padded == 0 ? 64 : padded);
  if (!p) throw std::bad_alloc();
  t.holder = std::shared_ptr<void>(p, std::free);
  t.data = p;
  return t;
}

Tensor Tensor::zeros(const std::vector<int64_t>& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  if (device == Device::GPU)
    gpu::memset_zero(t.data, static_cast<size_t>(t.nbytes()));
  else
    std::memset(t.data, 0, static_cast<size_t>(t.nbytes()));
  return t;
}

Tensor Tensor::reshape(const std::vector<int64_t>& new_shape) const {
  SPECD_CHECK(is_contiguous(), "reshape needs a contiguous tensor");
  SPECD_CHECK(is_row_major(dtype) || new_shape == shape, "reshape: ", dtype_info(dtype).name,
              " is the GPU GEMV's tiled layout (its tiles depend on the shape): only the same shape");
  Tensor t = *this;
  t.shape = new_shape;
  SPECD_CHECK(t.numel() == numel(), "reshape changes the element count");
  t.strides = contiguous_strides(new_shape, dtype);
  return t;
}

void check_dtype(const Tensor& t, DType want, const char* op, const char* arg) {
  SPECD_CHECK(t.dtype == want, op, ": ", arg, " must be ", dtype_info(want).name, ", got ",
              dtype_info(t.dtype).name);
}

void check_ndim(const Tensor& t, int64_t want, const char* op, const char* arg) {
  SPECD_CHECK(t.ndim() == want, op, ": ", arg, " must have ", want, " dimensions, got ", t.ndim());
}

void check_contiguous(const Tensor& t, const char* op, const char* arg) {
  SPECD_CHECK(t.is_contiguous(), op, ": ", arg, " must be contiguous");
}

void check_writable(const Tensor& t, const char* op, const char* arg) {
  SPECD_CHECK(t.writable, op, ": ", arg, " is read-only (the op writes into it)");
}

void check_device(const Tensor& t, Device want, const char* op, const char* arg) {
  SPECD_CHECK(t.device == want, op, ": ", arg, " must be on the ", want == Device::GPU ? "GPU" : "CPU");
}

void check_cpu(const Tensor& t, const char* op, const char* arg) { check_device(t, Device::CPU, op, arg); }

}  // namespace specd
