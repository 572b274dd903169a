// Tensor, DType, Device and backend information.
#include <cstring>
#include <optional>

#include "bindings.h"
#include "specd/parallel.h"

namespace specd::py_bind {

// Matches by kind and size, not object identity, in native byte order only (numpy reports an
// explicit order that is the host's, e.g. GGUFReader's '<' on little-endian hosts, as '=').
std::optional<DType> numpy_dtype(const py::dtype& dt) {
  if (dt.byteorder() != '=') return std::nullopt;
  if (dt.kind() == 'f' && dt.itemsize() == 4) return DType::F32;
  if (dt.kind() == 'f' && dt.itemsize() == 2) return DType::F16;
  if (dt.kind() == 'i' && dt.itemsize() == 4) return DType::I32;
  return std::nullopt;
}

namespace {

// The metadata of a contiguous GPU tensor of `shape` / `dtype` (no data yet): the gpu_ipc_export /
// gpu_ipc_open views. ValueError ("<what>: every dimension must be > 0") on a non-positive dimension.
Tensor gpu_tensor_meta(const std::vector<int64_t>& shape, DType dtype, const char* what) {
  for (int64_t d : shape) SPECD_CHECK(d > 0, what, ": every dimension must be > 0");
  Tensor t;
  t.dtype = dtype;
  t.device = Device::GPU;
  t.shape = shape;
  t.strides = contiguous_strides(shape, dtype);
  return t;
}

}  // namespace

Tensor from_numpy(const py::array& a, std::optional<DType> dtype) {
  std::optional<DType> natural = numpy_dtype(a.dtype());
  DType t = dtype ? *dtype : (natural ? *natural : DType::F32);
  SPECD_CHECK(dtype || natural, "tensor from numpy: unsupported numpy dtype '",
              std::string(py::str(a.dtype())), "' (use float32, float16, int32, or uint8/uint16 with an explicit dtype)");
  Tensor out;
  out.dtype = t;
  out.device = Device::CPU;
  out.data = const_cast<void*>(a.data());
  out.writable = a.writeable();
  out.holder = std::shared_ptr<void>(new py::object(a), [](void* p) {
    py::gil_scoped_acquire gil;
    delete static_cast<py::object*>(p);
  });
  bool raw = natural != t;  // bytes (or uint16 bits) reinterpreted as dtype
  int64_t nd = a.ndim();
  SPECD_CHECK(nd >= 1 || !raw, "tensor from numpy: a ", dtype_info(t).name, " view needs at least 1 dimension");
  for (int64_t i = 0; i < nd; ++i) {
    out.shape.push_back(a.shape(i));
    out.strides.push_back(a.strides(i));
  }
  if (raw) {
    const DTypeInfo& info = dtype_info(t);
    int64_t item = a.itemsize();
    SPECD_CHECK(a.dtype().kind() == 'u' || a.dtype().kind() == 'i',
                "tensor from numpy: ", info.name, " data must be given as raw unsigned integers (uint8)");
    SPECD_CHECK(a.strides(nd - 1) == item, "tensor from numpy: the last dimension of ", info.name,
                " data must be contiguous");
    int64_t bytes = a.shape(nd - 1) * item;
    SPECD_CHECK(bytes % info.type_size == 0, "tensor from numpy: the last dimension holds ", bytes,
                " bytes, not a whole number of ", info.name, " blocks of ", info.type_size, " bytes");
    out.shape.back() = bytes / info.type_size * info.block_size;
    out.strides.back() = info.type_size;  // per block (or element) along the row
  }
  return out;
}

py::array to_numpy(const Tensor& t) {
  py::dtype dt = t.dtype == DType::F32   ? py::dtype::of<float>()
                 : t.dtype == DType::F16 ? py::dtype("float16")
                 : t.dtype == DType::I32 ? py::dtype::of<int32_t>()
                 : t.dtype == DType::BF16 ? py::dtype::of<uint16_t>()
                                          : py::dtype::of<uint8_t>();
  std::vector<int64_t> shape = t.shape, strides = t.strides;
  if (is_block_type(t.dtype)) {
    shape.back() = t.row_bytes();
    strides.back() = 1;
  }
  if (t.device == Device::CPU) {
    auto* keep = new Tensor(t);
    py::capsule base(keep, [](void* p) { delete static_cast<Tensor*>(p); });
    py::array view(dt, shape, strides, t.data, base);
    if (!t.writable) view.attr("flags").attr("writeable") = false;  // e.g. a GGUF memory map
    return view;
  }
  SPECD_CHECK(t.is_contiguous(), "to numpy: GPU tensor must be contiguous");
  py::array host(dt, shape);
  void* dst = host.mutable_data();
  // Without the GIL: the copy waits for the GPU (and, from another thread, for a graph capture).
  without_gil([&] { gpu::copy_to_host(dst, t.data, static_cast<size_t>(t.nbytes())); });
  return host;
}

void require_same_device(const Tensor& a, const Tensor& b, const char* op) {
  SPECD_CHECK(a.device == b.device, op, ": inputs are on different devices");
}

namespace {

Tensor to_device(const Tensor& t, Device device) {
  if (t.device == device) return t;
  SPECD_CHECK(t.is_contiguous(), "to: tensor must be contiguous to move between devices");
  Tensor out = Tensor::empty(t.shape, t.dtype, device);
  size_t bytes = static_cast<size_t>(t.nbytes());
  if (device == Device::GPU)
    gpu::copy_to_device(out.data, t.data, bytes);
  else
    gpu::copy_to_host(out.data, t.data, bytes);
  return out;
}

// Rows [start, stop) along the first axis of a contiguous tensor, sharing its memory (and owner).
Tensor view_rows(const Tensor& t, int64_t start, int64_t stop) {
  SPECD_CHECK(t.ndim() >= 1, "view_rows: the tensor must have at least 1 dimension");
  SPECD_CHECK(t.is_contiguous(), "view_rows: the tensor must be contiguous");
  SPECD_CHECK(is_row_major(t.dtype), "view_rows: ", dtype_info(t.dtype).name,
              " is the GPU GEMV's tiled layout: only the GPU matmul reads it");
  SPECD_CHECK(0 <= start && start <= stop && stop <= t.shape[0], "view_rows: [", start, ", ", stop,
              ") is not a range within 0..", t.shape[0]);
  int64_t rb = t.strides[0];  // bytes per row (2+ dimensions: contiguous row stride)
  if (t.ndim() == 1) {
    // One element (or block) per step: for block formats the range must cover whole blocks.
    const DTypeInfo& info = dtype_info(t.dtype);
    SPECD_CHECK(start % info.block_size == 0 && stop % info.block_size == 0, "view_rows: [", start, ", ", stop,
                ") of a 1-D ", info.name, " tensor must start and stop on a block boundary (", info.block_size,
                " elements)");
    start /= info.block_size;
    stop /= info.block_size;
    rb = info.type_size;  // bytes per block (per element for plain types)
  }
  Tensor v = t;
  v.shape[0] = t.ndim() == 1 ? (stop - start) * dtype_info(t.dtype).block_size : stop - start;
  v.data = static_cast<uint8_t*>(t.data) + start * rb;
  return v;
}

// dst (a contiguous GPU tensor) = the bytes of `src` (a host array of dst's dtype and size),
// enqueued on the library stream without waiting (gpu::copy_to_device_async).
void write_async(const Tensor& dst, const py::array& src) {
  SPECD_CHECK(dst.device == Device::GPU, "gpu_write_async: dst must be a GPU tensor");
  SPECD_CHECK(dst.is_contiguous(), "gpu_write_async: dst must be contiguous");
  check_writable(dst, "gpu_write_async", "dst");
  py::array arr = py::array::ensure(src, py::array::c_style);
  const bool natural = numpy_dtype(arr.dtype()).has_value();  // else raw bytes of a block format
  Tensor s = from_numpy(arr, natural ? std::nullopt : std::optional<DType>(dst.dtype));
  SPECD_CHECK(s.dtype == dst.dtype, "gpu_write_async: src is ", dtype_info(s.dtype).name, ", dst is ",
              dtype_info(dst.dtype).name);
  SPECD_CHECK(s.nbytes() == dst.nbytes(), "gpu_write_async: src holds ", s.nbytes(), " bytes, dst ", dst.nbytes());
  without_gil([&] { gpu::copy_to_device_async(dst.data, s.data, size_t(dst.nbytes())); });
}

Tensor contiguous_copy(const Tensor& t) {
  if (t.is_contiguous()) return t;
  check_cpu(t, "contiguous", "tensor");
  Tensor out = Tensor::empty(t.shape, t.dtype, Device::CPU);
  int64_t rb = out.row_bytes(), rows = out.rows(), nd = t.ndim();
  int64_t elem = dtype_info(t.dtype).type_size;
  int64_t per_row = is_block_type(t.dtype) ? t.cols() / dtype_info(t.dtype).block_size : t.cols();
  for (int64_t r = 0; r < rows; ++r) {
    // Offset of row r in the strided source.
    int64_t rem = r, off = 0;
    for (int64_t d = nd - 2; d >= 0; --d) {
      off += (rem % t.shape[d]) * t.strides[d];
      rem /= t.shape[d];
    }
    const uint8_t* src = static_cast<const uint8_t*>(t.data) + off;
    uint8_t* dst = out.row_ptr(r);
    if (t.strides.back() == elem) {
      std::memcpy(dst, src, static_cast<size_t>(rb));
    } else {
      for (int64_t c = 0; c < per_row; ++c) std::memcpy(dst + c * elem, src + c * t.strides.back(), elem);
    }
  }
  return out;
}

}  // namespace

void register_core(py::module_& m) {
  py::enum_<DType>(m, "DType", "Tensor element/block formats; values are ggml type ids (GGMLQuantizationType), except "
                       "IQ4_XS_TILED (0x10017), Q4_K_TILED (0x1000c), Q5_K_TILED (0x1000d) and Q6_K_TILED (0x1000e): "
                       "specd's GPU GEMV layouts of IQ4_XS, Q4_K, Q5_K and Q6_K (see tile_for_gemv).")
      .value("F32", DType::F32)
      .value("F16", DType::F16)
      .value("Q8_0", DType::Q8_0)
      .value("Q4_K", DType::Q4_K)
      .value("Q5_K", DType::Q5_K)
      .value("Q6_K", DType::Q6_K)
      .value("IQ4_XS", DType::IQ4_XS)
      .value("IQ4_XS_TILED", DType::IQ4_XS_TILED)
      .value("Q4_K_TILED", DType::Q4_K_TILED)
      .value("Q5_K_TILED", DType::Q5_K_TILED)
      .value("Q6_K_TILED", DType::Q6_K_TILED)
      .value("I32", DType::I32)
      .value("BF16", DType::BF16);
  m.def("dtype_from_id", &dtype_from_id, py::arg("ggml_type"),
        "DType for a ggml type id; raises ValueError for formats specd does not read.");
  m.def("untiled", &untiled, py::arg("dtype"),
        "The row-major ggml type a GPU GEMV tiled layout regroups (IQ4_XS_TILED -> IQ4_XS, ...); dtype itself "
        "for every other type.");
  m.def("tiled_of", &tiled_of, py::arg("dtype"),
        "The GPU GEMV tiled layout of a row-major type (IQ4_XS, Q4_K, Q5_K, Q6_K -> *_TILED, see "
        "tile_for_gemv); dtype itself for every other type.");
  m.def("block_size", [](DType t) { return dtype_info(t).block_size; }, "Elements per block (1 for plain types).");
  m.def("type_size", [](DType t) { return dtype_info(t).type_size; }, "Bytes per block (or element).");

  py::enum_<Device>(m, "Device").value("CPU", Device::CPU).value("GPU", Device::GPU);

  py::class_<Tensor>(m, "Tensor", R"doc(
A typed view of CPU or GPU memory. Shape is numpy order (outermost first); for a GGUF weight with
ne = [in, out] the shape is (out, in). CPU tensors made from numpy arrays share their memory.)doc")
      .def(py::init([](const py::array& a, std::optional<DType> dtype) { return from_numpy(a, dtype); }),
           py::arg("array"), py::arg("dtype") = py::none(),
           "Zero-copy view of a numpy array. For block formats pass the raw uint8 rows and the dtype; "
           "for BF16 pass uint16 bits and DType.BF16.")
      .def_static("empty", [](std::vector<int64_t> shape, DType dtype, Device device) {
            return without_gil([&] { return Tensor::empty(shape, dtype, device); });
          }, py::arg("shape"), py::arg("dtype") = DType::F32, py::arg("device") = Device::CPU)
      .def_static("zeros", [](std::vector<int64_t> shape, DType dtype, Device device) {
            return without_gil([&] { return Tensor::zeros(shape, dtype, device); });
          }, py::arg("shape"), py::arg("dtype") = DType::F32, py::arg("device") = Device::CPU)
      .def_property_readonly("shape", [](const Tensor& t) { return py::tuple(py::cast(t.shape)); })
      .def_property_readonly("dtype", [](const Tensor& t) { return t.dtype; })
      .def_property_readonly("device", [](const Tensor& t) { return t.device; })
      .def_property_readonly("nbytes", &Tensor::nbytes)
      .def("numpy", &to_numpy, "numpy array: zero-copy on the CPU, a host copy for GPU tensors.")
      .def("to", [](const Tensor& t, Device d) { return without_gil([&] { return to_device(t, d); }); },
           py::arg("device"), "Copy to `device` (returns self if already there).")
      .def("contiguous", &contiguous_copy, "A contiguous copy (self if already contiguous).")
      .def("reshape", &Tensor::reshape, py::arg("shape"))
      .def("view_rows", &view_rows, py::arg("start"), py::arg("stop"),
           "Rows [start, stop) along the first axis of a contiguous tensor, sharing its memory (zero-copy, "
           "any device). Raises ValueError on a bad range or a non-contiguous tensor.")
      .def("__repr__", [](const Tensor& t) {
        std::string s = "Tensor(shape=(";
        for (size_t i = 0; i < t.shape.size(); ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
        return s + "), dtype=" + dtype_info(t.dtype).name + (t.device == Device::GPU ? ", device=GPU)" : ")");
      });
  py::implicitly_convertible<py::array, Tensor>();

  m.def("num_threads", &num_threads, "Threads used by the CPU backend (OpenMP; default: all cores).");
  m.def("set_num_threads", &set_num_threads, py::arg("n"), "Set CPU backend threads (0 = default).");
  m.def("gpu_compiled", &gpu::compiled, "True when built with a GPU backend (SPECD_GPU=cuda|hip).");
  m.def("gpu_available", &gpu::available, "True when built with a GPU backend and a device is present.");
  m.def("gpu_backend", &gpu::backend, "\"cuda\", \"hip\" or \"none\".");
  m.def("gpu_device_name", &gpu::device_name);
  m.def("gpu_synchronize", [] { without_gil(gpu::synchronize); },
        "Wait for all queued GPU work. RuntimeError during a graph capture (it cannot wait).");
  m.def("gpu_write_async", &write_async, py::arg("dst"), py::arg("src"),
        R"doc(dst = src: a host numpy array copied into a GPU tensor without waiting for the GPU.

dst: contiguous GPU tensor; src: C-contiguous numpy array of dst's dtype (int32 for I32, float32 for
F32, raw uint8 for block formats) holding dst.nbytes bytes. The values are copied into pinned staging
memory before the call returns (src may be reused at once), and the device copy is ordered on the
library stream after all work queued before (kernels still reading dst see the old values).
Copies over 64 KiB wait for the GPU. Raises ValueError on a dtype or size mismatch, RuntimeError
during a graph capture (a replay would not see new values: write inputs before replay instead).)doc");

  py::class_<gpu::Graph, std::shared_ptr<gpu::Graph>>(m, "GpuGraph", R"doc(
GPU work recorded by gpu_graph_begin() / gpu_graph_end(). replay() enqueues it again on the library
stream, reading and writing the same device addresses (its inputs are whatever those buffers hold
when it runs; tensors allocated during the capture live in the graph's arena and are overwritten by
every replay). Destroying it waits for its last replay.)doc")
      .def("replay", [](gpu::Graph& g) { without_gil([&] { g.replay(); }); },
           "Enqueue the recorded work (asynchronous). RuntimeError during a capture.")
      .def_property_readonly("arena_bytes", &gpu::Graph::arena_bytes, "Device bytes held by the graph's arena.");
  m.def("gpu_graph_begin", [](int64_t arena_bytes) {
          SPECD_CHECK(arena_bytes >= 0, "gpu_graph_begin: arena_bytes must be >= 0, got ", arena_bytes);
          without_gil([&] { gpu::graph_begin(size_t(arena_bytes)); });
        }, py::arg("arena_bytes") = int64_t(64) << 20,
        R"doc(Start recording the library stream's GPU work into a graph (relaxed stream capture).

Until gpu_graph_end() or gpu_graph_abort(), native GPU ops are recorded, not run; their outputs are
allocated from an arena of `arena_bytes` reserved now (grown by more chunks when needed) whose
addresses stay fixed for every replay. Anything that waits for the GPU (Tensor.numpy() of a GPU
tensor, gpu_synchronize, GPU index tensors not passed as trusted, Tensor.to, gpu_write_async)
raises RuntimeError instead; call gpu_graph_abort() after such an error. Only the calling thread
may end or abort the capture. Other threads' GPU calls that allocate, upload, copy in place
(copy_rows, slice, concat, copy), zero memory, write a KV cache, read back, synchronise or replay
a graph wait until the capture ends; their frees happen right after it ends, so the captured work
must not use a buffer another thread may drop meanwhile. An op of another thread that already
allocated its output when the capture began can still be recorded: serialise GPU work around a
capture (one lock). Raises RuntimeError when a capture is already running or no GPU is usable,
ValueError on a negative arena_bytes.)doc");
  m.def("gpu_graph_end", [] { return without_gil([] { return gpu::graph_end(); }); },
        "Stop recording and return the GpuGraph (nothing has run yet: call replay()). RuntimeError when no "
        "capture is running, another thread's is, or the capture failed.");
  m.def("gpu_graph_abort", [] { without_gil([] { gpu::graph_abort(); }); },
        "Stop recording and discard the capture (no-op when none is running; RuntimeError when the running "
        "capture belongs to another thread).");
  m.def("gpu_capturing", &gpu::capturing, "True while a GPU graph capture is running.");
  m.def(
      "gpu_memory_info",
      [] {
        const gpu::MemoryInfo mi = gpu::memory_info();
        py::dict d;
        d["free_bytes"] = mi.free_bytes;
        d["total_bytes"] = mi.total_bytes;
        d["pool"] = mi.pool;
        d["pool_reserved_bytes"] = mi.pool_reserved_bytes;
        d["pool_used_bytes"] = mi.pool_used_bytes;
        d["pool_used_high_bytes"] = mi.pool_used_high_bytes;
        return d;
      },
      "Device memory in bytes: {free_bytes, total_bytes} of the device (cudaMemGetInfo) and the "
      "library pool's {pool, pool_reserved_bytes, pool_used_bytes, pool_used_high_bytes}. "
      "RuntimeError when no GPU is usable.");
  m.def("gpu_trim_pool", [] { without_gil([] { gpu::trim_pool(); }); },
        "Return the library pool's cached free blocks to the device (waits for the library stream); live "
        "buffers stay. RuntimeError when no GPU is usable or during this thread's graph capture.");
  // ---- IPC (the "cuda-ipc" feature transport)
  m.attr("GPU_IPC_HANDLE_BYTES") = gpu::kIpcHandleBytes;
  m.def(
      "gpu_ipc_export",
      [](const std::vector<int64_t>& shape, DType dtype) {
        Tensor t = gpu_tensor_meta(shape, dtype, "gpu_ipc_export");
        SPECD_CHECK(t.nbytes() > 0, "gpu_ipc_export: empty tensor");
        gpu::IpcBuffer b = without_gil([&] { return gpu::ipc_export(size_t(t.nbytes())); });
        t.data = b.ptr.get();
        t.holder = b.ptr;
        return py::make_tuple(t, py::bytes(b.handle));
      },
      py::arg("shape"), py::arg("dtype"),
      R"doc(A zeroed GPU tensor of ``shape`` / ``dtype`` in memory another process can map, and its handle.

Returns (Tensor, bytes): the tensor (contiguous, writable; plain cudaMalloc memory, not the pool)
and the GPU_IPC_HANDLE_BYTES (64) byte cudaIpcMemHandle to pass to gpu_ipc_open in the other
process (same GPU). The memory is freed (after the library stream drains) when the last reference to
the tensor (or a view of it) drops; the importer must have closed its mapping by then. Raises
ValueError on a non-positive dimension, RuntimeError without a GPU or on a runtime failure, and
during a graph capture on this thread.)doc");
  m.def(
      "gpu_ipc_open",
      [](const py::bytes& handle, const std::vector<int64_t>& shape, DType dtype, int64_t nbytes) {
        std::string h = handle;
        SPECD_CHECK(h.size() == gpu::kIpcHandleBytes, "gpu_ipc_open: the handle must be ", gpu::kIpcHandleBytes,
                    " bytes, got ", h.size());
        Tensor t = gpu_tensor_meta(shape, dtype, "gpu_ipc_open");
        SPECD_CHECK(nbytes > 0 && t.nbytes() == nbytes, "gpu_ipc_open: shape ", shape.size(), "-D of ",
                    dtype_info(dtype).name, " is ", t.nbytes(), " bytes but the exported buffer is ", nbytes);
        std::shared_ptr<void> p = without_gil([&] { return gpu::ipc_open(h, size_t(nbytes)); });
        t.data = p.get();
        t.holder = std::move(p);
        return t;
      },
      py::arg("handle"), py::arg("shape"), py::arg("dtype"), py::arg("nbytes"),
      R"doc(Maps a buffer another process exported with gpu_ipc_export (same GPU) as a GPU tensor.

handle: the 64 exported bytes; shape / dtype: the view to build; nbytes: the exporter's byte size,
which the view must match exactly and which the mapped allocation must reach (the size is read with
cuMemGetAddressRange / hipMemGetAddressRange; a runtime that cannot tell it is refused). Note that the
runtime maps a buffer of another GPU too (peer access): callers check the exporter's device
(gpu_pci_bus_id) themselves. The mapping is closed (cudaIpcCloseMemHandle, after the library stream
drains) when the last reference drops. Raises ValueError on a wrong handle length, a shape that does
not match nbytes, a smaller mapped allocation or one whose size cannot be determined, RuntimeError
without a GPU or when the runtime refuses the handle (e.g. opened in the exporting process itself).)doc");
  m.def("gpu_pci_bus_id", [] { return without_gil([] { return gpu::pci_bus_id(); }); },
        "PCI bus id of the library's GPU (cudaDeviceGetPCIBusId, e.g. \"0000:19:00.0\"); RuntimeError "
        "without a GPU. Names the device across processes whatever their CUDA_VISIBLE_DEVICES.");
  py::class_<gpu::IpcEvent, std::shared_ptr<gpu::IpcEvent>>(m, "GpuIpcEvent", R"doc(
An interprocess GPU event (cudaEventInterprocess | cudaEventDisableTiming). gpu_ipc_event_create()
makes one (the writer); gpu_ipc_event_open(handle) opens it in another process (the reader).
record() enqueues the event on the library stream after the work queued so far; wait() makes the
library stream wait for the last record before later work; synchronize() blocks the host until the
last record completes. record / wait / synchronize raise RuntimeError on a thread capturing a GPU
graph. Destroyed when the last reference drops.)doc")
      .def_property_readonly("handle", [](const gpu::IpcEvent& e) { return py::bytes(e.handle()); },
                             "The 64-byte cudaIpcEventHandle.")
      .def("record", [](gpu::IpcEvent& e) { without_gil([&] { e.record(); }); })
      .def("wait", [](gpu::IpcEvent& e) { without_gil([&] { e.wait(); }); })
      .def("synchronize", [](gpu::IpcEvent& e) { without_gil([&] { e.synchronize(); }); });
  m.def("gpu_ipc_event_create", [] { return without_gil([] { return gpu::ipc_event_create(); }); },
        "A new GpuIpcEvent (RuntimeError without a GPU).");
  m.def(
      "gpu_ipc_event_open",
      [](const py::bytes& handle) {
        std::string h = handle;
        SPECD_CHECK(h.size() == gpu::kIpcHandleBytes, "gpu_ipc_event_open: the handle must be ",
                    gpu::kIpcHandleBytes, " bytes, got ", h.size());
        return without_gil([&] { return gpu::ipc_event_open(h); });
      },
      py::arg("handle"), "Opens another process's GpuIpcEvent from its 64-byte handle (ValueError on a wrong length).");
}

}  // namespace specd::py_bind
