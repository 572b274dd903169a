#include "../cpu/activations.h"
#include "bindings.h"

namespace specd::py_bind {

void register_activations(py::module_& m) {
  using Unary = Tensor (*)(const Tensor&);
  using Binary = Tensor (*)(const Tensor&, const Tensor&);
  const char* shapes = "\n\nF32, any shape with a contiguous last dimension; returns a new F32 tensor of that shape.";
  m.def("silu", static_cast<Unary>(&cpu::silu), py::arg("x"),
        (std::string("silu(x) = x * sigmoid(x) (Elfwing et al. 2017), elementwise.") + shapes).c_str());
  m.def("sigmoid", static_cast<Unary>(&cpu::sigmoid), py::arg("x"),
        (std::string("sigmoid(x) = 1 / (1 + exp(-x)), elementwise; evaluated as exp(x) / (1 + exp(x)) for x < 0, "
                     "so it never overflows (sigmoid(-100) ~ 3.7e-44, sigmoid(100) = 1).") + shapes).c_str());
  m.def("softplus", static_cast<Unary>(&cpu::softplus), py::arg("x"),
        (std::string("softplus(x) = log(1 + exp(x)), elementwise: x for x > 20 (the remainder log1p(exp(-x)) "
                     "< 2.1e-9 is below half an F32 ulp there), log1p(exp(x)) otherwise; exact-to-rounding at "
                     "both extremes (softplus(-100) ~ 3.7e-44). GDN gate, qwen35-target.md §6.5 step 4.") + shapes)
            .c_str());
  m.def("swiglu", static_cast<Binary>(&cpu::swiglu), py::arg("gate"), py::arg("up"),
        (std::string("swiglu(gate, up) = silu(gate) * up, elementwise (SwiGLU MLP, Shazeer 2020; "
                     "qwen35-target.md §6.1). gate and up must have the same shape.") + shapes).c_str());
  m.def("mul", static_cast<Binary>(&cpu::mul), py::arg("a"), py::arg("b"),
        (std::string("a * b elementwise; same shapes, no broadcasting.") + shapes).c_str());
  m.def("add", static_cast<Binary>(&cpu::add), py::arg("a"), py::arg("b"),
        (std::string("a + b elementwise; same shapes, no broadcasting.") + shapes).c_str());
}

}  // namespace specd::py_bind
