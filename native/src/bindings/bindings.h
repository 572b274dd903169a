// Shared helpers for the pybind11 layer. Each op group lives in its own file and exposes a
// register_<group>(module) function called from module.cpp.
#pragma once
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "specd/error.h"
#include "specd/gpu.h"
#include "specd/tensor.h"

namespace specd::py_bind {

namespace py = pybind11;

// Zero-copy view of a numpy array (or any buffer). `dtype` overrides the element type: a uint8
// array whose last dimension holds whole ggml blocks becomes a block-format tensor, and a uint16
// array becomes BF16. Without an override float32/float16/int32 map to F32/F16/I32.
Tensor from_numpy(const py::array& a, std::optional<DType> dtype);
// The DType of a numpy dtype that maps to one (float32 -> F32, float16 -> F16, int32 -> I32, in
// native byte order), else nullopt.
std::optional<DType> numpy_dtype(const py::dtype& dt);
// A numpy array over the tensor's memory (CPU: zero-copy, GPU: a host copy). Block formats and
// BF16 come back as their raw bytes / uint16 bits.
py::array to_numpy(const Tensor& t);

// Runs f() with the GIL released, for native work that touches no Python object: other Python
// threads (RPC handlers, the other worker in a test process) run meanwhile. Tensors may be copied or
// destroyed inside: the holder of a numpy-backed tensor takes the GIL itself when it lets go.
template <class F>
decltype(auto) without_gil(F&& f) {
  py::gil_scoped_release nogil;
  return f();
}

// Runs `cpu` or `gpu` by the device of `t`; `gpu` is reached only in builds with a GPU backend.
void require_same_device(const Tensor& a, const Tensor& b, const char* op);

void register_core(py::module_& m);
void register_quants(py::module_& m);      // dequantize, matmul(_group), the fused *_matmul ops, embedding
void register_norm(py::module_& m);        // rms_norm, rms_norm_gated, l2_norm, gdn_qkv
void register_rope(py::module_& m);        // rope_neox (+ YaRN), qk_norm_rope
void register_attention(py::module_& m);   // kv_write, attention
void register_ssm(py::module_& m);         // conv1d_causal, grouped_dynamic_conv, gated_delta_net, gdn_step
void register_activations(py::module_& m); // silu, swiglu, sigmoid, softplus, mul, add, mul_sigmoid, gdn_gates
void register_sampling(py::module_& m);    // argmax, topk
void register_copy(py::module_& m);        // slice, concat, copy, copy_rows

}  // namespace specd::py_bind
