#include "../cpu/activations.h"
#if SPECD_WITH_GPU
#include "../gpu/ops.h"
#endif
#include "bindings.h"

namespace specd::py_bind {

namespace {

using UnaryFn = Tensor (*)(const Tensor&);
using BinaryFn = Tensor (*)(const Tensor&, const Tensor&);
#if SPECD_WITH_GPU
#define GPU_FN(name) &gpu::name
#else
#define GPU_FN(name) nullptr
#endif

// Runs the GPU op for GPU tensors (builds with a GPU backend), else the CPU op.
Tensor unary(const Tensor& x, UnaryFn cpu_fn, UnaryFn gpu_fn) {
  return without_gil([&] { return x.device == Device::GPU && gpu_fn ? gpu_fn(x) : cpu_fn(x); });
}
Tensor binary(const Tensor& a, const Tensor& b, const char* op, BinaryFn cpu_fn, BinaryFn gpu_fn) {
  require_same_device(a, b, op);
  return without_gil([&] { return a.device == Device::GPU && gpu_fn ? gpu_fn(a, b) : cpu_fn(a, b); });
}

}  // namespace

void register_activations(py::module_& m) {
  const char* shapes = "\n\nF32, any shape with a contiguous last dimension; returns a new F32 tensor of that shape.";
  m.def("silu", [](const Tensor& x) { return unary(x, cpu::silu, GPU_FN(silu)); }, py::arg("x"),
        (std::string("silu(x) = x * sigmoid(x) (Elfwing et al. 2017), elementwise.") + shapes).c_str());
  m.def("sigmoid", [](const Tensor& x) { return unary(x, cpu::sigmoid, GPU_FN(sigmoid)); }, py::arg("x"),
        (std::string("sigmoid(x) = 1 / (1 + exp(-x)), elementwise; evaluated as exp(x) / (1 + exp(x)) for x < 0, "
                     "so it never overflows (sigmoid(-100) ~ 3.7e-44, sigmoid(100) = 1).") + shapes).c_str());
  m.def("softplus", [](const Tensor& x) { return unary(x, cpu::softplus, GPU_FN(softplus)); }, py::arg("x"),
        (std::string("softplus(x) = log(1 + exp(x)), elementwise: x for x > 20 (the remainder log1p(exp(-x)) "
                     "< 2.1e-9 is below half an F32 ulp there), log1p(exp(x)) otherwise; exact-to-rounding at "
                     "both extremes (softplus(-100) ~ 3.7e-44). GDN gate, qwen35-target.md §6.5 step 4.") + shapes)
            .c_str());
  m.def("swiglu", [](const Tensor& gate, const Tensor& up) { return binary(gate, up, "swiglu", cpu::swiglu, GPU_FN(swiglu)); },
        py::arg("gate"), py::arg("up"),
        (std::string("swiglu(gate, up) = silu(gate) * up, elementwise (SwiGLU MLP, Shazeer 2020; "
                     "qwen35-target.md §6.1). gate and up must have the same shape.") + shapes).c_str());
  m.def("mul", [](const Tensor& a, const Tensor& b) { return binary(a, b, "mul", cpu::mul, GPU_FN(mul)); },
        py::arg("a"), py::arg("b"),
        (std::string("a * b elementwise (one F32 rounding, as numpy). b has a's shape, or [H] / [1, H] for a of "
                     "shape [..., H]: then b is broadcast over a's rows. Raises ValueError on other shapes.") + shapes).c_str());
  m.def("add", [](const Tensor& a, const Tensor& b) { return binary(a, b, "add", cpu::add, GPU_FN(add)); },
        py::arg("a"), py::arg("b"),
        (std::string("a + b elementwise (one F32 rounding, as numpy). b has a's shape, or [H] / [1, H] for a of "
                     "shape [..., H]: then b is broadcast over a's rows. Raises ValueError on other shapes.") + shapes).c_str());
}

}  // namespace specd::py_bind
