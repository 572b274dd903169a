// Tensor glue ops: slice, concat, copy, copy_rows and copy_tensors, on the CPU and (same code, device copies) the
// GPU. They let a forward keep its activations on the device (target_worker/model.py on the GPU):
// numpy's basic slicing, np.concatenate, ndarray.copy() and in-place row assignment, for contiguous
// tensors. Pure byte moves, exact on both devices.
#include <cstring>
#include <string>
#include <vector>

#include "../cpu/ssm.h"  // WrittenSpans
#include "bindings.h"

namespace specd::py_bind {

namespace {

// Bytes of one step along `axis` of a contiguous tensor (the product of the inner dimensions).
int64_t axis_unit(const Tensor& t, int64_t axis) {
  return axis == t.ndim() - 1 ? dtype_info(t.dtype).type_size : t.strides[size_t(axis)];
}

int64_t outer_count(const Tensor& t, int64_t axis) {
  int64_t n = 1;
  for (int64_t d = 0; d < axis; ++d) n *= t.shape[size_t(d)];
  return n;
}

void check_row_major(const Tensor& t, const char* op) {
  SPECD_CHECK(is_row_major(t.dtype), op, ": ", dtype_info(t.dtype).name,
              " is the GPU GEMV's tiled layout: only the GPU matmul reads it");
}

int64_t norm_axis(const Tensor& t, int64_t axis, const char* op) {
  check_row_major(t, op);
  SPECD_CHECK(t.ndim() >= 1, op, ": x must have at least 1 dimension");
  int64_t a = axis < 0 ? axis + t.ndim() : axis;
  SPECD_CHECK(a >= 0 && a < t.ndim(), op, ": axis ", axis, " is out of range for ", t.ndim(), " dimensions");
  SPECD_CHECK(!(is_block_type(t.dtype) && a == t.ndim() - 1), op, ": cannot cut ", dtype_info(t.dtype).name,
              " blocks along the last axis");
  return a;
}

// height rows of width bytes; CPU: memcpy per row, GPU: one device copy.
void copy_2d(Device dev, void* dst, int64_t dpitch, const void* src, int64_t spitch, int64_t width, int64_t height) {
  if (width <= 0 || height <= 0) return;
  if (dev == Device::GPU) {
    gpu::copy_2d(dst, size_t(dpitch), src, size_t(spitch), size_t(width), size_t(height));
    return;
  }
  auto* d = static_cast<uint8_t*>(dst);
  auto* s = static_cast<const uint8_t*>(src);
  for (int64_t r = 0; r < height; ++r) std::memmove(d + r * dpitch, s + r * spitch, size_t(width));
}

Tensor slice(const Tensor& x, int64_t axis, int64_t start, int64_t stop) {
  check_contiguous(x, "slice", "x");
  int64_t a = norm_axis(x, axis, "slice");
  int64_t n = x.shape[size_t(a)];
  SPECD_CHECK(0 <= start && start <= stop && stop <= n, "slice: [", start, ", ", stop,
              ") is not a range within 0..", n, " of axis ", a);
  std::vector<int64_t> shape = x.shape;
  shape[size_t(a)] = stop - start;
  Tensor y = Tensor::empty(shape, x.dtype, x.device);
  int64_t unit = axis_unit(x, a);
  copy_2d(x.device, y.data, (stop - start) * unit, static_cast<const uint8_t*>(x.data) + start * unit, n * unit,
          (stop - start) * unit, outer_count(x, a));
  return y;
}

Tensor concat(const std::vector<Tensor>& xs, int64_t axis) {
  SPECD_CHECK(!xs.empty(), "concat: needs at least one tensor");
  const Tensor& x0 = xs[0];
  int64_t a = norm_axis(x0, axis, "concat");
  std::vector<int64_t> shape = x0.shape;
  shape[size_t(a)] = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    const Tensor& x = xs[i];
    std::string arg = "xs[" + std::to_string(i) + "]";
    check_contiguous(x, "concat", arg.c_str());
    SPECD_CHECK(x.device == x0.device, "concat: inputs are on different devices");
    SPECD_CHECK(x.dtype == x0.dtype, "concat: ", arg, " is ", dtype_info(x.dtype).name, ", xs[0] is ",
                dtype_info(x0.dtype).name);
    SPECD_CHECK(x.ndim() == x0.ndim(), "concat: ", arg, " has ", x.ndim(), " dimensions, xs[0] has ", x0.ndim());
    for (int64_t d = 0; d < x.ndim(); ++d)
      SPECD_CHECK(d == a || x.shape[size_t(d)] == x0.shape[size_t(d)], "concat: ", arg,
                  " differs from xs[0] in dimension ", d, " (only axis ", a, " may differ)");
    shape[size_t(a)] += x.shape[size_t(a)];
  }
  Tensor y = Tensor::empty(shape, x0.dtype, x0.device);
  int64_t unit = axis_unit(y, a), outer = outer_count(y, a), off = 0;
  for (const Tensor& x : xs) {
    int64_t w = x.shape[size_t(a)] * unit;
    copy_2d(y.device, static_cast<uint8_t*>(y.data) + off, shape[size_t(a)] * unit, x.data, w, w, outer);
    off += w;
  }
  return y;
}

Tensor copy(const Tensor& x) {
  check_contiguous(x, "copy", "x");
  Tensor y = Tensor::empty(x.shape, x.dtype, x.device);
  copy_2d(x.device, y.data, y.nbytes(), x.data, x.nbytes(), x.nbytes(), 1);
  return y;
}

void copy_rows(const Tensor& dst, int64_t dst_start, const Tensor& src, int64_t src_start, int64_t n,
               bool across_devices) {
  check_row_major(dst, "copy_rows");
  check_row_major(src, "copy_rows");
  check_contiguous(dst, "copy_rows", "dst");
  check_contiguous(src, "copy_rows", "src");
  check_writable(dst, "copy_rows", "dst");
  // Opt-in: in device code a host tensor is a bug to report, not a synchronous copy to make.
  SPECD_CHECK(dst.device == src.device || across_devices,
              "copy_rows: dst and src are on different devices (across_devices=True copies between them)");
  SPECD_CHECK(dst.dtype == src.dtype, "copy_rows: dst is ", dtype_info(dst.dtype).name, ", src is ",
              dtype_info(src.dtype).name);
  SPECD_CHECK(dst.ndim() >= 1 && dst.ndim() == src.ndim() &&
                  std::equal(dst.shape.begin() + 1, dst.shape.end(), src.shape.begin() + 1),
              "copy_rows: dst and src must have the same shape after the first dimension");
  SPECD_CHECK(n >= 0 && dst_start >= 0 && src_start >= 0 && dst_start + n <= dst.shape[0] &&
                  src_start + n <= src.shape[0],
              "copy_rows: ", n, " rows from ", src_start, " of ", src.shape[0], " to ", dst_start, " of ",
              dst.shape[0], " are out of range");
  int64_t rb = dst.ndim() == 1 ? dtype_info(dst.dtype).type_size : dst.strides[0];
  auto* d = static_cast<uint8_t*>(dst.data) + dst_start * rb;
  auto* s = static_cast<const uint8_t*>(src.data) + src_start * rb;
  if (n == 0) return;
  // Across devices: one synchronous copy of just these rows, e.g. a verify's accepted feature rows
  // from the GPU straight into the host feature ring (no download of the whole output first).
  if (dst.device != src.device) {
    if (dst.device == Device::CPU)
      gpu::copy_to_host(d, s, size_t(n * rb));
    else
      gpu::copy_to_device(d, s, size_t(n * rb));
    return;
  }
  if (dst.device == Device::GPU) {
    SPECD_CHECK(d + n * rb <= s || s + n * rb <= d, "copy_rows: source and destination rows overlap");
  }
  copy_2d(dst.device, d, n * rb, s, n * rb, n * rb, 1);
}

// dsts[i] = srcs[i] for every i: checked whole before anything is written, then on the GPU one launch for up to
// 128 pairs of whole 16-byte words (gpu::copy_many).
void copy_tensors(const std::vector<Tensor>& dsts, const std::vector<Tensor>& srcs) {
  const char* op = "copy_tensors";
  SPECD_CHECK(dsts.size() == srcs.size(), op, ": ", dsts.size(), " destinations for ", srcs.size(), " sources");
  std::vector<void*> d;
  std::vector<const void*> s;
  std::vector<size_t> bytes;
  for (size_t i = 0; i < dsts.size(); ++i) {
    const Tensor &dst = dsts[i], &src = srcs[i];
    const std::string at = std::string(op) + ": pair " + std::to_string(i);
    check_contiguous(dst, at.c_str(), "dst");
    check_contiguous(src, at.c_str(), "src");
    check_writable(dst, at.c_str(), "dst");
    SPECD_CHECK(dst.device == dsts[0].device && src.device == dsts[0].device, at,
                ": every tensor must be on pair 0's device");
    SPECD_CHECK(dst.dtype == src.dtype && dst.shape == src.shape, at,
                ": dst and src must have the same dtype and shape");
    d.push_back(dst.data), s.push_back(src.data), bytes.push_back(size_t(dst.nbytes()));
  }
  std::vector<const Tensor*> written;
  for (const Tensor& t : dsts) written.push_back(&t);
  const cpu::WrittenSpans spans(written);  // O(N log N): a commit copies 96 pairs
  if (const auto c = spans.clash())
    fail(op, ": pair ", c->first, ": dst overlaps another pair's tensor (pair ", c->second, ")");
  for (size_t j = 0; j < srcs.size(); ++j)
    if (const auto i = spans.hit(srcs[j]))
      fail(op, ": pair ", *i, ": dst overlaps ",
           *i == j ? "its src" : "another pair's tensor (pair " + std::to_string(j) + ")");
  if (d.empty()) return;
  if (dsts[0].device == Device::GPU) return gpu::copy_many(d.data(), s.data(), bytes.data(), d.size());
  for (size_t i = 0; i < d.size(); ++i) std::memcpy(d[i], s[i], bytes[i]);
}

}  // namespace

void register_copy(py::module_& m) {
  // Without the GIL, like every op: device copies may wait for another thread's graph capture.
  m.def("slice", [](const Tensor& x, int64_t axis, int64_t start, int64_t stop) {
          return without_gil([&] { return slice(x, axis, start, stop); });
        }, py::arg("x"), py::arg("axis"), py::arg("start"), py::arg("stop"),
        R"doc(A contiguous copy of x[..., start:stop, ...] along `axis` (numpy basic slicing + copy).

x: contiguous tensor of any dtype on the CPU or the GPU (block formats: not along the last axis);
0 <= start <= stop <= x.shape[axis]; negative axis counts from the end. Returns a new tensor on
x's device. Exact (a byte copy). Raises ValueError on a bad axis or range.)doc");
  m.def("concat", [](const std::vector<Tensor>& xs, int64_t axis) { return without_gil([&] { return concat(xs, axis); }); },
        py::arg("xs"), py::arg("axis") = 0,
        R"doc(np.concatenate(xs, axis) for contiguous tensors of one dtype on one device.

Shapes must agree except along `axis`. Returns a new tensor on that device; exact.
Raises ValueError on an empty list or mismatched dtype, device, rank or shape.)doc");
  m.def("copy", [](const Tensor& x) { return without_gil([&] { return copy(x); }); }, py::arg("x"),
        "A new contiguous copy of a contiguous tensor on its device (ndarray.copy()); exact.");
  m.def("copy_tensors", [](const std::vector<Tensor>& dsts, const std::vector<Tensor>& srcs) {
          without_gil([&] { copy_tensors(dsts, srcs); });
        }, py::arg("dsts"), py::arg("srcs"),
        R"doc(dsts[i][...] = srcs[i] in place for every i: on the GPU one launch for up to 128 of them (a spec
step's commit of a whole chain: every layer's states from the verify's; a pair whose address or size is not a
multiple of 16 bytes takes a copy of its own).

Each pair: contiguous tensors of one dtype and shape (any dtype), dst writable; every tensor on one device; no
dst may overlap any src or another dst. Exact (bytes are moved). Checks every pair before anything is written.
Returns None. Raises ValueError naming the pair on a mismatch, a wrong device or an overlap.)doc");
  m.def("copy_rows", [](const Tensor& dst, int64_t dst_start, const Tensor& src, int64_t src_start, int64_t n,
                        bool across_devices) {
          without_gil([&] { copy_rows(dst, dst_start, src, src_start, n, across_devices); });
        }, py::arg("dst"), py::arg("dst_start"), py::arg("src"), py::arg("src_start"),
        py::arg("n") = 1, py::arg("across_devices") = false,
        R"doc(dst[dst_start:dst_start+n] = src[src_start:src_start+n] in place (rows along the first axis).

dst (writable) and src: contiguous, same dtype (any, block formats included), same shape after the
first dimension, same device unless across_devices (then one may be on the CPU and the other on the
GPU: the n rows alone cross, one copy that returns when they have arrived; it waits for the work queued
before it and is refused during a graph capture). GPU ranges must not overlap (CPU: memmove). Returns
None. Raises ValueError on a mismatch, tensors on different devices without across_devices, or a range
outside either tensor.)doc");
}

}  // namespace specd::py_bind
