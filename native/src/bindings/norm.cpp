#include "../cpu/norm.h"
#if SPECD_WITH_GPU
#include "../gpu/ops.h"
#endif
#include "bindings.h"

namespace specd::py_bind {

void register_norm(py::module_& m) {
  m.def(
      "rms_norm",
      [](const Tensor& x, std::optional<Tensor> weight, float eps, std::optional<Tensor> residual) -> py::object {
        if (weight) require_same_device(x, *weight, "rms_norm");
        if (residual) require_same_device(x, *residual, "rms_norm");
        auto [y, h] = without_gil([&] {
#if SPECD_WITH_GPU
          if (x.device == Device::GPU) return gpu::rms_norm(x, weight, eps, residual);
#endif
          return cpu::rms_norm(x, weight, eps, residual);
        });
        if (residual) return py::make_tuple(y, h);
        return py::cast(y);
      },
      py::arg("x"), py::arg("weight") = py::none(), py::arg("eps") = 1e-6f, py::arg("residual") = py::none(),
      R"doc(RMSNorm over the last dimension: y = x / sqrt(mean(x**2) + eps) * weight.

x: F32 [..., d]; weight: F32 [d] or None; eps: float >= 0.
With residual (F32, same shape as x) computes h = x + residual first and returns (y, h);
otherwise returns y. Raises ValueError on a dtype/shape mismatch. Source: Zhang & Sennrich 2019;
GGUF stores the multiplier (HF's 1 + w), qwen35-target.md §6.2.)doc");
  m.def(
      "rms_norm_gated",
      [](const Tensor& x, std::optional<Tensor> weight, float eps, const Tensor& z) {
        if (weight) require_same_device(x, *weight, "rms_norm_gated");
        require_same_device(x, z, "rms_norm_gated");
        return without_gil([&] {
#if SPECD_WITH_GPU
          if (x.device == Device::GPU) return gpu::rms_norm_gated(x, weight, eps, z);
#endif
          return cpu::rms_norm_gated(x, weight, eps, z);
        });
      },
      py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("z"),
      R"doc(Gated RMSNorm: y = rms_norm(x, weight, eps) * silu(z), elementwise (the Gated DeltaNet
output norm, qwen35-target.md §6.5).

x, z: F32 [..., d] of the same shape, contiguous; weight: F32 [d] or None; eps: float >= 0; all on one
device. Returns a new F32 tensor of x's shape. Bit-identical on each backend to
mul(rms_norm(x, weight, eps), silu(z)) (the norm's per-row arithmetic, then one F32 multiply by the
silu value); on the GPU one kernel launch. Raises ValueError naming the argument on a dtype, shape or
device mismatch.)doc");
  m.def(
      "l2_norm",
      [](const Tensor& x, float eps) {
        return without_gil([&] {
#if SPECD_WITH_GPU
          if (x.device == Device::GPU) return gpu::l2_norm(x, eps);
#endif
          return cpu::l2_norm(x, eps);
        });
      },
      py::arg("x"),
      py::arg("eps") = 1e-6f,
      R"doc(L2 normalisation over the last dimension: y = x / sqrt(sum(x**2) + eps).

x: F32 [..., d]. The Gated DeltaNet q/k normalisation (eps inside the square root of the sum).)doc");
}

}  // namespace specd::py_bind
