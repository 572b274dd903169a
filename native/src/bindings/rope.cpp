#include "../cpu/rope.h"
#if SPECD_WITH_GPU
#include "../gpu/ops.h"
#endif
#include "bindings.h"

namespace specd::py_bind {

void register_rope(py::module_& m) {
  m.def(
      "rope_neox",
      [](const Tensor& x, const Tensor& positions, int64_t n_rot, double theta, double yarn_factor,
         int64_t yarn_original_context, double yarn_beta_fast, double yarn_beta_slow,
         std::optional<double> yarn_attention_factor, bool trusted) {
        cpu::Yarn yarn{yarn_factor, yarn_original_context, yarn_beta_fast, yarn_beta_slow, yarn_attention_factor};
        return without_gil([&] {
#if SPECD_WITH_GPU
          if (x.device == Device::GPU) return gpu::rope_neox(x, positions, n_rot, theta, yarn, trusted);
#else
          (void)trusted;
#endif
          return cpu::rope_neox(x, positions, n_rot, theta, yarn);
        });
      },
      py::arg("x"), py::arg("positions"), py::arg("n_rot"), py::arg("theta"), py::arg("yarn_factor") = 1.0,
      py::arg("yarn_original_context") = 0, py::arg("yarn_beta_fast") = 32.0, py::arg("yarn_beta_slow") = 1.0,
      py::arg("yarn_attention_factor") = py::none(), py::arg("trusted") = false,
      R"doc(Partial NeoX ("rotate half") RoPE, optionally YaRN-scaled.

x: F32 [n, heads, head_dim] (last dim contiguous); positions: I32 [n], each >= 0.
For i < n_rot/2 the pair (x[i], x[i + n_rot/2]) of every head is rotated by a = pos * inv_freq[i]:
  y[i] = m*(x[i] cos a - x[i+h] sin a),  y[i+h] = m*(x[i+h] cos a + x[i] sin a),  h = n_rot/2;
dims >= n_rot are copied (qwen35-target.md §6.4: n_rot 64 of 256, theta 1e7; drafters rotate the
whole head, drafters.md §3.4). Plain RoPE: inv_freq[i] = theta**(-2i/n_rot), m = 1.
YaRN (yarn_factor > 1; transformers modeling_rope_utils._compute_yarn_parameters, truncate=True):
correction dims d(r) = n_rot*ln(orig/(2*pi*r))/(2 ln theta), low = max(floor(d(beta_fast)), 0),
high = min(ceil(d(beta_slow)), n_rot-1), ramp[i] = clip((i-low)/(high-low), 0, 1),
inv_freq[i] = inv[i]/factor*ramp[i] + inv[i]*(1-ramp[i]), orig = yarn_original_context
(original_max_position_embeddings). m = yarn_attention_factor, default 0.1*ln(factor) + 1 (1 when
factor == 1; an explicit attention factor applies even then, as in transformers), folded into cos/sin
exactly once. Angles, cos/sin and the rotation are computed in double and rounded to F32 once.
Returns a new F32 tensor of x's shape. Raises ValueError unless theta is finite > 0, n_rot is even
with 0 <= n_rot <= head_dim, positions >= 0 with one per row, yarn_factor >= 1, and
yarn_original_context > 0 when yarn_factor > 1.
trusted (GPU only; the CPU op always checks, at no cost): the caller guarantees GPU positions are
>= 0, so they are not read back (no host synchronisation; needed inside a GPU graph capture); a
negative one is then rotated as given.)doc");
  m.def(
      "qk_norm_rope",
      [](const Tensor& qg, const Tensor& k, const Tensor& q_norm_w, const Tensor& k_norm_w, const Tensor& positions,
         int64_t n_rot, double theta, float eps, bool trusted, std::optional<Tensor> k_cache,
         std::optional<Tensor> v_cache, std::optional<Tensor> v, std::optional<Tensor> rows) {
        const int given = int(bool(k_cache)) + int(bool(v_cache)) + int(bool(v)) + int(bool(rows));
        SPECD_CHECK(given == 0 || given == 4, "qk_norm_rope: k_cache, v_cache, v and rows must be given together");
        std::optional<cpu::QkCacheWrite> cache;
        if (given) cache = cpu::QkCacheWrite{*k_cache, *v_cache, *v, *rows};
        // k_cache, v_cache and v: the backends' device checks name them
        for (const Tensor* t : {&k, &q_norm_w, &k_norm_w}) require_same_device(qg, *t, "qk_norm_rope");
        auto [q, gate, ko] = without_gil([&] {
#if SPECD_WITH_GPU
          if (qg.device == Device::GPU)
            return gpu::qk_norm_rope(qg, k, q_norm_w, k_norm_w, positions, n_rot, theta, eps, trusted, cache);
#else
          (void)trusted;
#endif
          return cpu::qk_norm_rope(qg, k, q_norm_w, k_norm_w, positions, n_rot, theta, eps, cache);
        });
        return py::make_tuple(q, gate, ko);
      },
      py::arg("qg"), py::arg("k"), py::arg("q_norm_w"), py::arg("k_norm_w"), py::arg("positions"), py::arg("n_rot"),
      py::arg("theta"), py::arg("eps"), py::arg("trusted") = false, py::arg("k_cache") = py::none(),
      py::arg("v_cache") = py::none(), py::arg("v") = py::none(), py::arg("rows") = py::none(),
      R"doc(The gated attention's q / k preparation in one op (qwen35-target.md §6.3 steps 1-3): returns
(q, gate, k) with
  q    = rope_neox(rms_norm(qg[..., :hd], q_norm_w, eps), positions, n_rot, theta)  F32 [w, nh, hd]
  gate = qg[..., hd:]                                                                 [w, nh, hd]
  k    = rope_neox(rms_norm(k, k_norm_w, eps), positions, n_rot, theta)              F32 [w, nkv, hd]
qg: F32 [w, nh, 2*hd], each head's projection row [q | gate] (attn_q's packed layout); k: F32
[w, nkv, hd]; both contiguous. q_norm_w, k_norm_w: F32 [hd]; positions: I32 [w], each >= 0 (on the GPU
a CPU or GPU tensor). Plain partial NeoX RoPE, theta the GGUF rope.freq_base (no YaRN).
gate is not copied: it is a view of qg's memory (rows 2*hd floats apart; it keeps qg alive) for
mul_sigmoid, which reads it as it is; ops that need contiguous inputs reject it (on the CPU,
gate.numpy() is the numpy view qg[..., hd:]).
q and k are bit-identical on each backend to that rms_norm / rope_neox composition (the same per-row
arithmetic); on the GPU one kernel launch (n_rot <= 512, hd <= 8192 there). Raises ValueError naming
the argument on a dtype, shape or device mismatch, a negative position, n_rot odd, negative or > hd,
theta not finite > 0, or eps not finite >= 0. trusted: as rope_neox's (GPU positions not read back;
needed inside a graph capture).
KV cache write (k_cache, v_cache, v, rows: all four or none): also writes the caches in place as
  kv_write(k_cache, k, rows); kv_write(v_cache, v, rows)
would, with the returned k: the same bytes (kv_write's row codecs), still in one launch on the GPU.
k_cache, v_cache: KV caches as kv_write's ([capacity, nkv, hd], F32, F16 or Q8_0, contiguous, writable,
on qg's device), of the same shape (dtypes may differ); v: F32 [w, nkv, hd], contiguous; rows: I32 [w]
(on the GPU a CPU or GPU tensor). Everything is checked before anything is written: besides the errors
above, ValueError naming the argument when only some of the four are given, on a cache's dtype, shape,
layout or read-only memory, v not of k's shape, a row outside [0, capacity) or repeated rows, or a cache
overlapping the other or an input. trusted also covers GPU rows as kv_write's (not read back; a row
outside [0, capacity) is then skipped, repeated rows race: their bytes are then unspecified).)doc");
}

}  // namespace specd::py_bind
