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
  m.def(
      "gdn_qkv",
      [](const Tensor& cv, int64_t n_k_heads, int64_t head_k_dim, int64_t n_v_heads, int64_t head_v_dim,
         float eps) {
        auto [q, k, v] = without_gil([&] {
#if SPECD_WITH_GPU
          if (cv.device == Device::GPU) return gpu::gdn_qkv(cv, n_k_heads, head_k_dim, n_v_heads, head_v_dim, eps);
#endif
          return cpu::gdn_qkv(cv, n_k_heads, head_k_dim, n_v_heads, head_v_dim, eps);
        });
        return py::make_tuple(q, k, v);
      },
      py::arg("cv"), py::arg("n_k_heads"), py::arg("head_k_dim"), py::arg("n_v_heads"), py::arg("head_v_dim"),
      py::arg("eps"),
      R"doc(The Gated DeltaNet q, k, v of the conv output in one op (qwen35-target.md §6.5 steps 3 and 6).

cv: F32 [w, C] contiguous (w may be 0), C = 2 * n_k_heads * head_k_dim + n_v_heads * head_v_dim,
columns [q heads | k heads | v heads]; all four dimensions > 0; eps finite, >= 0. Returns (q, k, v),
new tensors on cv's device: q, k F32 [w, n_k_heads, head_k_dim], each head L2-normalised
(x / sqrt(sum(x**2) + eps)); v F32 [w, n_v_heads, head_v_dim], a copy. Bit-identical on each backend
to l2_norm(reshape(slice(cv, -1, 0, Hk*dk), w, Hk, dk), eps), the same for k, and the v slice (each
head runs l2_norm's row arithmetic); on the GPU one kernel launch (head_k_dim at most 8192). Raises
ValueError naming the argument on a wrong dtype, number of dimensions, layout, column count,
dimension or eps.)doc");
}

}  // namespace specd::py_bind
