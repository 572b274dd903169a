#include "../cpu/attention.h"
#if SPECD_WITH_GPU
#include "../gpu/ops.h"
#endif
#include "bindings.h"

namespace specd::py_bind {

void register_attention(py::module_& m) {
  m.def(
      "kv_write",
      [](const Tensor& cache, const Tensor& x, const Tensor& rows, bool trusted) {
        require_same_device(cache, x, "kv_write");
        without_gil([&] {
#if SPECD_WITH_GPU
          if (cache.device == Device::GPU) return gpu::kv_write(cache, x, rows, trusted);
#else
          (void)trusted;
#endif
          cpu::kv_write(cache, x, rows);
        });
      },
      py::arg("cache"), py::arg("x"), py::arg("rows"), py::arg("trusted") = false,
        R"doc(Write K or V rows into a KV cache in place.

cache: Tensor [capacity, n_kv_heads, head_dim] of dtype F32, F16 or Q8_0 (Q8_0: head_dim % 32 == 0),
contiguous, on the CPU (a numpy float32/float16 array, or Tensor(uint8 raw rows, DType.Q8_0), is
written through zero-copy). x: F32 [n, n_kv_heads, head_dim]; rows: I32 [n].
cache[rows[i]] = quantize(x[i]) with the ggml row codecs (bit-identical to gguf.quants.quantize).
Returns None. Raises ValueError on dtype/shape mismatch, a row outside [0, capacity) or repeated rows.
trusted (GPU only; the CPU op always checks, at no cost): the caller guarantees GPU rows are in range
and distinct, so they are not read back (no host synchronisation; needed inside a GPU graph
capture). A row outside [0, capacity) is then skipped; repeated rows race (their bytes are then unspecified).)doc");
  m.def(
      "attention",
      [](const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, int64_t kv_len, const Tensor& q_pos,
         bool causal, int64_t window, std::optional<Tensor> mask, std::optional<float> scale, bool trusted,
         bool exact) {
        cpu::AttentionArgs a{kv_len, causal, window, std::move(mask), scale};
        require_same_device(q, k_cache, "attention");
        require_same_device(q, v_cache, "attention");
        return without_gil([&] {
#if SPECD_WITH_GPU
          if (q.device == Device::GPU) return gpu::attention(q, k_cache, v_cache, q_pos, a, trusted, exact);
#else
          (void)trusted;
          (void)exact;
#endif
          return cpu::attention(q, k_cache, v_cache, q_pos, a);
        });
      },
      py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("kv_len"), py::arg("q_pos"),
      py::arg("causal") = true, py::arg("window") = 0, py::arg("mask") = py::none(), py::arg("scale") = py::none(),
      py::arg("trusted") = false, py::arg("exact") = true,
      R"doc(Softmax attention of n queries over the first kv_len rows of a KV cache (GQA).

q: F32 [n, Hq, d] (last dim contiguous); k_cache, v_cache: [capacity, Hkv, d] F32/F16/Q8_0 caches
(see kv_write; dtypes may differ); kv_len: 0 <= kv_len <= capacity; q_pos: I32 [n], each >= 0;
mask: None or I32 [n, kv_len] (numpy int32; nonzero = visible); scale: None = 1/sqrt(d).
Key j is visible to query i iff (mask is None or mask[i, j] != 0) and (not causal or j <= q_pos[i])
and (window == 0 or j > q_pos[i] - window); cache row j is taken to hold position j.
out[i, h] = sum_j softmax_j(scale * q[i, h] . k[j, g]) v[j, g] over visible j, g = h // (Hq // Hkv)
(qwen35-target.md §6.3 step 5; drafters.md §3.3 masks). Scores/softmax/accumulation in F32, two
passes (max, then weights and values in key order); a query with no visible key returns zeros.
Each (query, head) result depends only on its ordered visible keys: bitwise independent of n, the
thread count and where the keys sit in the cache (tree verify equals chain verify).
Used causal for target prefill/verify, causal=False with an ancestor mask for tree verify, and
causal=False (optionally windowed) for drafter blocks. Returns F32 [n, Hq, d].
Raises ValueError on dtype/shape mismatch, Hq % Hkv != 0, kv_len out of range, window < 0,
q_pos < 0, a mask that is not [n, kv_len] I32, or a non-finite scale.
trusted (GPU only; the CPU op always checks, at no cost): the caller guarantees GPU q_pos are >= 0,
so they are not read back (no host synchronisation; needed inside a GPU graph capture). No memory
access depends on q_pos (keys come from rows < kv_len only, the grid is sized from kv_len): a
negative q_pos sees no key when causal (zeros), keys from row 0 otherwise.
exact (GPU only; the CPU is always exact and ignores it): True (default) keeps everything above
(split-K CUDA-core kernel, |gpu - cpu| <= ~1e-5 * max|v|, batch invariant bit for bit). False allows
the tensor-core flash-attention path (FlashAttention-2, Dao 2023) for calls of n >= 64 rows with
mask None on F16 k_cache and v_cache with head_dim 64, 128 or 256 (causal or not, any window, any
GQA ratio) on CUDA: q is rounded to F16 when staged, scores and the online softmax are F32, the
softmax weights are rounded to F16 for the weights @ v product (F32 accumulation), so
|gpu - cpu| <= ~1e-3 * max|v| (first order: max|v| * (u + 2 u * scale * max_j sum_e |q_e k_je|),
u = 2^-11); still deterministic, and a row's result does not depend on the other rows of the call,
but it differs from exact=True. q elements beyond F16's range (|q| > 65504) become inf there (the
target's q is RMS-normed first, so far inside it). Any other call (fewer rows, a mask, F32 / Q8_0 caches, other head
dims, HIP) runs the exact kernel whatever `exact` says. For prefill only (Qwen35Model.prefill passes
exact=False; verify and decode must stay exact).)doc");
}

}  // namespace specd::py_bind
