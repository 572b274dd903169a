#include "../cpu/ssm.h"
#if SPECD_WITH_GPU
#include "../gpu/ops.h"
#endif
#include "bindings.h"

namespace specd::py_bind {

void register_ssm(py::module_& m) {
  m.def(
      "conv1d_causal",
      [](const Tensor& x, const Tensor& weight, const Tensor& state, bool apply_silu) {
        require_same_device(x, weight, "conv1d_causal");
        require_same_device(x, state, "conv1d_causal");
        return without_gil([&] {
#if SPECD_WITH_GPU
          if (x.device == Device::GPU) return gpu::conv1d_causal(x, weight, state, apply_silu);
#endif
          return cpu::conv1d_causal(x, weight, state, apply_silu);
        });
      },
      py::arg("x"), py::arg("weight"), py::arg("state"),
        py::arg("apply_silu") = true,
        R"doc(Depthwise causal conv of the Gated DeltaNet, with its rolling state (qwen35-target.md §6.5 step 2).

x: F32 [T, C] (last dim contiguous); weight: F32 [K, C] (GGUF ssm_conv1d, tap K-1 = current token);
state: F32 [K-1, C], contiguous and writable (a numpy array is updated in place; zeros at sequence
start). With X = [state ; x]: y[t, c] = sum_{j<K} weight[j, c] * X[t + j, c] (F32, j ascending),
then silu if apply_silu. state is overwritten with the last K-1 rows of X. Splitting the T tokens
over several calls gives bitwise the same outputs and state. Returns F32 [T, C].
Raises ValueError on dtype/shape mismatch (weight [K >= 1, C], state [K-1, C]).)doc");
  m.def(
      "gated_delta_net",
      [](const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta, const Tensor& state,
         float scale, std::optional<Tensor> checkpoints) {
        for (const Tensor* t : {&k, &v, &g, &beta, &state}) require_same_device(q, *t, "gated_delta_net");
        if (checkpoints) require_same_device(q, *checkpoints, "gated_delta_net");
        return without_gil([&] {
#if SPECD_WITH_GPU
          if (q.device == Device::GPU) return gpu::gated_delta_net(q, k, v, g, beta, state, scale, checkpoints);
#endif
          return cpu::gated_delta_net(q, k, v, g, beta, state, scale, checkpoints);
        });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"),
        py::arg("beta"), py::arg("state"), py::arg("scale"), py::arg("checkpoints") = py::none(),
        R"doc(Gated DeltaNet recurrence, token by token (qwen35-target.md §6.5 step 7; ggml gated_delta_net).

q, k: F32 [T, Hk, dk], already L2-normalised; v: F32 [T, Hv, dv]; g: F32 [T, Hv] log-decay
(ssm_a * softplus(a + dt_bias)); beta: F32 [T, Hv] (sigmoid(b)); inputs need a contiguous last dim.
state: F32 [Hv, dv, dk], contiguous, writable, ggml layout: head j element S[i_k, j_v] at
state[j, j_v, i_k]. scale: multiplies q (1/sqrt(dk) for qwen35). Hv % Hk == 0; value head j uses key
head j % Hk (GGUF tiled order). Per token, per head, in F32:
  S <- exp(g) S;  m = S^T k;  d = beta (v - m);  S <- S + k outer d;  o = S^T (scale q)
(output from the updated state). state holds the final state afterwards. checkpoints: None or F32
[T, Hv, dv, dk] contiguous writable; checkpoints[t] receives the state after token t (fast rollback,
spec-loop.md §5.3). Running T tokens at once equals running them in several calls with the carried
state, bitwise. Returns o: F32 [T, Hv, dv]. Raises ValueError on dtype/shape mismatch.)doc");
}

}  // namespace specd::py_bind
