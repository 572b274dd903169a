#include "../cpu/dynamic_conv.h"
#include "../cpu/ssm.h"
#if SPECD_WITH_GPU
#include "../gpu/ops.h"
#endif
#include "bindings.h"

namespace specd::py_bind {

void register_ssm(py::module_& m) {
  m.def(
      "conv1d_causal",
      [](const Tensor& x, const Tensor& weight, const Tensor& state, bool apply_silu,
         std::optional<Tensor> state_out) {
        require_same_device(x, weight, "conv1d_causal");
        require_same_device(x, state, "conv1d_causal");
        if (state_out) require_same_device(x, *state_out, "conv1d_causal");
        return without_gil([&] {
#if SPECD_WITH_GPU
          if (x.device == Device::GPU) return gpu::conv1d_causal(x, weight, state, apply_silu, state_out);
#endif
          return cpu::conv1d_causal(x, weight, state, apply_silu, state_out);
        });
      },
      py::arg("x"), py::arg("weight"), py::arg("state"),
        py::arg("apply_silu") = true, py::arg("state_out") = py::none(),
        R"doc(Depthwise causal conv of the Gated DeltaNet, with its rolling state (qwen35-target.md §6.5 step 2).

x: F32 [T, C] (last dim contiguous); weight: F32 [K, C] (GGUF ssm_conv1d, tap K-1 = current token);
state: F32 [K-1, C], contiguous and writable (a numpy array is updated in place; zeros at sequence
start). With X = [state ; x]: y[t, c] = sum_{j<K} weight[j, c] * X[t + j, c] (F32, j ascending),
then silu if apply_silu. The last K-1 rows of X (the new state) overwrite state, or go to
state_out when given: F32 [K-1, C], contiguous, writable, on x's device, either state itself or
memory overlapping neither state nor x; state is then only read (it need not be writable), and
the result equals the in-place one bitwise. Splitting the T tokens over several calls gives
bitwise the same outputs and state. Returns F32 [T, C]. Raises ValueError on dtype/shape mismatch
(weight [K >= 1, C], state and state_out [K-1, C]) or an overlapping state_out.)doc");
  m.def(
      "grouped_dynamic_conv",
      [](const Tensor& y, const Tensor& dyn, const Tensor& base, int64_t side) {
        // no require_same_device: the backend's checks name the argument on the wrong device
        return without_gil([&] {
#if SPECD_WITH_GPU
          if (y.device == Device::GPU) return gpu::grouped_dynamic_conv(y, dyn, base, side);
#endif
          return cpu::grouped_dynamic_conv(y, dyn, base, side);
        });
      },
      py::arg("y"), py::arg("dyn"), py::arg("base"), py::arg("side") = 0,
      R"doc(DFlash 2's grouped dynamic causal convolution, one side of one module (drafters.md §6.2; the z-lab
dflash package's _grouped_dynamic_convolve, ZL-0.1.0 model.py).

For one block of L rows and H channels in G groups of group_size = H / G contiguous channels:
  out[t, c] = sum_{o < taps} (base[o, c] + D[t, o, c // group_size]) * y[t - o, c],
with y[t - o] = 0 before the block start (those terms are left out) and the dynamic coefficient taken
at the output row t. y: F32 [L, H]; base: F32 [taps, H] (the module's base_kernel of this side);
dyn: F32 [L, taps, G] (D itself; side 0), or the kernel projection's whole output F32 [L, S, taps, G]
(S = 2 in DFlash 2: the prepare and finish sides) with D = dyn[:, side], read in place. All on one
device, contiguous; taps >= 1, G >= 1, H % G == 0; L may be 0. The F32 operations and their order are
those of the numpy reference draft_worker.model.grouped_dynamic_conv: coef = base + D, out = coef_0 * y_t,
then out += coef_o * y_{t-o} for o = 1 .. min(taps - 1, t), every product and sum rounded to F32 (no
fused multiply-add): CPU, GPU and numpy agree bit for bit (NaN payloads aside). Returns F32 [L, H].
Raises ValueError naming the argument on a wrong device, dtype, layout or shape, a side outside
[0, S), or a tensor of 2^31 elements or more.)doc");
  m.def(
      "gated_delta_net",
      [](const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta, const Tensor& state,
         float scale, std::optional<Tensor> checkpoints, std::optional<Tensor> state_out, bool exact) {
        for (const Tensor* t : {&k, &v, &g, &beta, &state}) require_same_device(q, *t, "gated_delta_net");
        if (checkpoints) require_same_device(q, *checkpoints, "gated_delta_net");
        if (state_out) require_same_device(q, *state_out, "gated_delta_net");
        return without_gil([&] {
#if SPECD_WITH_GPU
          if (q.device == Device::GPU)
            return gpu::gated_delta_net(q, k, v, g, beta, state, scale, checkpoints, state_out, exact);
#endif
          return cpu::gated_delta_net(q, k, v, g, beta, state, scale, checkpoints, state_out);
        });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"),
        py::arg("beta"), py::arg("state"), py::arg("scale"), py::arg("checkpoints") = py::none(),
        py::arg("state_out") = py::none(), py::arg("exact") = true,
        R"doc(Gated DeltaNet recurrence, token by token (qwen35-target.md §6.5 step 7; ggml gated_delta_net).

q, k: F32 [T, Hk, dk], already L2-normalised; v: F32 [T, Hv, dv]; g: F32 [T, Hv] log-decay
(ssm_a * softplus(a + dt_bias)); beta: F32 [T, Hv] (sigmoid(b)); inputs need a contiguous last dim.
state: F32 [Hv, dv, dk], contiguous, writable, ggml layout: head j element S[i_k, j_v] at
state[j, j_v, i_k]. scale: multiplies q (1/sqrt(dk) for qwen35). Hv % Hk == 0; value head j uses key
head j % Hk (GGUF tiled order). Per token, per head, in F32:
  S <- exp(g) S;  m = S^T k;  d = beta (v - m);  S <- S + k outer d;  o = S^T (scale q)
(output from the updated state). state holds the final state afterwards, unless state_out is
given: F32 [Hv, dv, dk], contiguous, writable, on q's device, either state itself or memory
overlapping none of q, k, v, g, beta, state, checkpoints; it then receives the final state and
state is only read (it need not be writable); out of place equals in place bitwise. checkpoints:
None or F32 [T, Hv, dv, dk] contiguous writable; checkpoints[t] receives the state after token t
(fast rollback, spec-loop.md §5.3). Running T tokens at once equals running them in several calls
with the carried state, bitwise. exact=False (prefill only) lets the GPU run a call of >= 64 tokens
without checkpoints in chunks of 64 tokens (the WY / chunkwise form of Yang et al., "Gated Delta
Networks", ICLR 2025): the same recurrence in real arithmetic, other F32 rounding (within 1e-4 of
max|o| of the CPU op), and its results then depend on how the tokens are split over calls; the CPU
is always exact. Returns o: F32 [T, Hv, dv]. Raises ValueError on dtype/shape
mismatch or an overlapping state_out.)doc");
  using Tensors = std::vector<Tensor>;
  m.def(
      "conv1d_causal_states",
      [](const Tensors& xs, const Tensors& states) {
        without_gil([&] {
#if SPECD_WITH_GPU
          if (!states.empty() && states[0].device == Device::GPU) return gpu::conv1d_causal_states(xs, states);
#endif
          cpu::conv1d_causal_states(xs, states);
        });
      },
      py::arg("xs"), py::arg("states"),
      R"doc(conv1d_causal's state update on several layers at once, without its outputs: a spec step's commit of
the accepted rows of a chain verify (spec-loop.md §5.3).

xs[i]: F32 [T, C] contiguous (layer i's conv inputs, e.g. a verify's leading T rows); states[i]: F32 [K-1, C]
contiguous and writable (a numpy array is updated in place), replaced by the last K-1 rows of [states[i] ; xs[i]],
bitwise what conv1d_causal(xs[i], w, states[i]) leaves there. Every layer has layer 0's T, C and K-1; all on one
device. On the GPU one launch (up to 64 layers a launch). Raises ValueError naming the layer and argument on a
wrong dtype, shape, layout or device, lists of different lengths, or a state overlapping another layer's state or
any x.)doc");
  m.def(
      "gated_delta_net_states",
      [](const Tensors& q, const Tensors& k, const Tensors& v, const Tensors& g, const Tensors& beta,
         const Tensors& states, float scale) {
        without_gil([&] {
#if SPECD_WITH_GPU
          if (!states.empty() && states[0].device == Device::GPU)
            return gpu::gated_delta_net_states(q, k, v, g, beta, states, scale);
#endif
          cpu::gated_delta_net_states(q, k, v, g, beta, states, scale);
        });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"), py::arg("states"), py::arg("scale"),
      R"doc(gated_delta_net on several layers at once, states only: a spec step's commit of the accepted rows of a
chain verify (spec-loop.md §5.3), the recurrence over those rows from each layer's state.

For every layer i: gated_delta_net(q[i], k[i], v[i], g[i], beta[i], states[i], scale) in place on states[i]
(bitwise the same state; its output o is not computed). Shapes as gated_delta_net's (q, k F32 [T, Hk, dk], v
[T, Hv, dv], g, beta [T, Hv], states F32 [Hv, dv, dk]), the same for every layer, every tensor contiguous and on
one device (a numpy state is updated in place). On the GPU one launch runs all layers side by side (up to 64 a
launch; shapes without gated_delta_net's register kernel run a layer at a time). Raises ValueError naming the
layer and argument on a wrong dtype, shape, layout or device, lists of different lengths, layers of different
shapes, or a state overlapping another layer's state or any input.)doc");
  m.def(
      "gdn_step",
      [](const Tensor& cv, const Tensor& a, const Tensor& b, const Tensor& dt, const Tensor& ssm_a, const Tensor& state,
         int64_t n_k_heads, int64_t head_k_dim, int64_t n_v_heads, int64_t head_v_dim, float eps, float scale,
         std::optional<Tensor> state_out) {
        for (const Tensor* t : {&a, &b, &dt, &ssm_a, &state}) require_same_device(cv, *t, "gdn_step");
        if (state_out) require_same_device(cv, *state_out, "gdn_step");
        auto r = without_gil([&] {
#if SPECD_WITH_GPU
          if (cv.device == Device::GPU)
            return gpu::gdn_step(cv, a, b, dt, ssm_a, state, n_k_heads, head_k_dim, n_v_heads, head_v_dim, eps, scale,
                                 state_out);
#endif
          return cpu::gdn_step(cv, a, b, dt, ssm_a, state, n_k_heads, head_k_dim, n_v_heads, head_v_dim, eps, scale,
                               state_out);
        });
        return py::make_tuple(std::get<0>(r), std::get<1>(r), std::get<2>(r), std::get<3>(r), std::get<4>(r),
                              std::get<5>(r));
      },
      py::arg("cv"), py::arg("a"), py::arg("b"), py::arg("dt"), py::arg("ssm_a"), py::arg("state"),
      py::arg("n_k_heads"), py::arg("head_k_dim"), py::arg("n_v_heads"), py::arg("head_v_dim"), py::arg("eps"),
      py::arg("scale"), py::arg("state_out") = py::none(),
      R"doc(The Gated DeltaNet core of a decode / verify step after its conv, as one op (qwen35-target.md §6.5
steps 3-7).

cv: F32 [T, 2 Hk dk + Hv dv] (conv1d_causal's output); a, b: F32 [T, Hv] (alpha, beta projections);
dt, ssm_a: F32 [Hv] or [1, Hv]; state / state_out as gated_delta_net. Computes (q, k, v) = gdn_qkv(cv,
...), (g, beta) = gdn_gates(a, b, dt, ssm_a) and o = gated_delta_net(q, k, v, g, beta, state, scale,
state_out=state_out) (exact, token by token). Returns (o [T, Hv, dv], q, k [T, Hk, dk], v [T, Hv, dv],
g, beta [T, Hv]), exactly those ops' results: on the GPU one launch (q / k norms, gates and recurrence in
gated_delta_net's blocks) where gated_delta_net runs its register kernel (dk 32 / 64 / 128; dv % 32 == 0,
or dv * max(4, dk / 16) <= 512 and a multiple of 32), bit-identical to the composition, which runs
otherwise (and on the CPU). The output's gated norm (step 8) is left to the out projection:
rms_norm_gated_matmul(o, norm_weight, eps, z, [ssm_out]). Every argument is checked before anything runs
(a bad one leaves the state untouched): raises ValueError on a dtype, shape or layout mismatch (a, b
[T, Hv]; state and state_out as gated_delta_net's) or a written state overlapping an input.)doc");
}

}  // namespace specd::py_bind
