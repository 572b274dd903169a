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

py::tuple gdn_gates(const Tensor& a, const Tensor& b, const Tensor& dt, const Tensor& ssm_a) {
  for (const Tensor* t : {&b, &dt, &ssm_a}) require_same_device(a, *t, "gdn_gates");
  auto [g, beta] = without_gil([&] {
#if SPECD_WITH_GPU
    if (a.device == Device::GPU) return gpu::gdn_gates(a, b, dt, ssm_a);
#endif
    return cpu::gdn_gates(a, b, dt, ssm_a);
  });
  return py::make_tuple(g, beta);
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
  m.def("mul_sigmoid",
        [](const Tensor& a, const Tensor& gate) {
          return binary(a, gate, "mul_sigmoid", cpu::mul_sigmoid, GPU_FN(mul_sigmoid));
        },
        py::arg("a"), py::arg("gate"),
        R"doc(a * sigmoid(gate), elementwise: the gated attention's output gate (qwen35-target.md §6.3 step 6).

a, gate: F32 of one shape on one device with a contiguous last dimension (outer strides free on the
CPU; on the GPU a contiguous and gate's rows evenly spaced, as qk_norm_rope's gate view inside qg,
read there without a copy). Returns a new contiguous F32 tensor of a's shape, bit-identical on each backend to
mul(a, sigmoid(gate)) (the F32 sigmoid, then one F32 multiply); on the GPU one kernel launch. Raises
ValueError naming the argument on a dtype, shape, layout or device mismatch.)doc");
  m.def("gdn_gates", &gdn_gates, py::arg("a"), py::arg("b"), py::arg("dt"), py::arg("ssm_a"),
        R"doc(Gated DeltaNet gates in one pass: returns (g, beta) with g = ssm_a * softplus(a + dt) and
beta = sigmoid(b), elementwise (qwen35-target.md §6.5 step 4).

a, b: F32 [T, H] with a contiguous last dimension (fully contiguous on the GPU; T may be 0); dt, ssm_a: F32 [H] or [1, H], broadcast
over the rows; all on one device. Returns two new F32 [T, H] tensors. Bit-identical on each backend to
mul(softplus(add(a, dt)), ssm_a) and sigmoid(b) (one F32 rounding per add / mul; on the CPU also to
numpy's float32 (a + dt), (x * ssm_a)); on the GPU one kernel launch. Raises ValueError naming the
argument on a wrong dtype, number of dimensions, shape or device.)doc");
}

}  // namespace specd::py_bind
