#pragma once
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "specd/tensor.h"

namespace specd::cpu {

// Depthwise causal 1-D convolution of the Gated DeltaNet (qwen35-target.md §6.5 step 2).
// x: F32 [T, C] (last dim contiguous); weight: F32 [K, C] (ggml ssm_conv1d layout, tap K-1 =
// current token); state: F32 [K-1, C], contiguous and writable (the previous K-1 inputs, zeros at
// sequence start). With X = [state ; x] ((K-1+T) rows):
//   y[t, c] = sum_{j=0..K-1} weight[j, c] * X[t + j, c]   (F32, j ascending),
// then y = silu(y) if apply_silu. The last K-1 rows of X (the new state) are written to
// `state_out` if given (F32 [K-1, C], contiguous, writable; either `state` itself or memory
// overlapping neither `state` nor x; `state` is then only read, and need not be writable), else
// over `state`. Each output element is computed by the same operations whatever T or the thread
// count, so running T tokens at once equals running them in several calls (bitwise), and in place
// equals out of place (bitwise). Returns F32 [T, C]. Throws std::invalid_argument on a bad dtype,
// shape, layout or an overlapping state_out.
Tensor conv1d_causal(const Tensor& x, const Tensor& weight, const Tensor& state, bool apply_silu,
                     const std::optional<Tensor>& state_out = std::nullopt);

// Gated DeltaNet recurrence (qwen35-target.md §6.5 step 7; ggml gated_delta_net).
// q, k: F32 [T, Hk, dk] (already L2-normalised); v: F32 [T, Hv, dv]; g, beta: F32 [T, Hv]
// (log-decay and write strength); inputs need a contiguous last dim only. state: F32 [Hv, dv, dk],
// contiguous and writable, ggml layout (head j, element S[i_k][j_v] at j_v * dk + i_k).
// Hv % Hk == 0; value head j uses key head j % Hk (GGUF tiled order). For each token t in order and
// each head j:  S <- exp(g) S;  m = S^T k;  d = beta (v - m);  S <- S + k (x) d;  o = S^T (scale q),
// all in F32 with fixed-order partial sums. The final state goes to `state_out` if given (F32
// [Hv, dv, dk], contiguous, writable; either `state` itself or memory overlapping none of q, k, v,
// g, beta, state, checkpoints; `state` is then only read, and need not be writable), else over
// `state`; out of place equals in place bitwise. If `checkpoints` (F32 [T, Hv, dv, dk],
// contiguous, writable) is given, the state after token t is stored in checkpoints[t] (fast
// rollback, spec-loop.md §5.3). Parallel over heads; results do not depend on T splits or threads.
// Returns o: F32 [T, Hv, dv]. Throws std::invalid_argument on a bad dtype, shape, layout or an
// overlapping state_out.
Tensor gated_delta_net(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                       const Tensor& state, float scale, const std::optional<Tensor>& checkpoints,
                       const std::optional<Tensor>& state_out = std::nullopt);

// A spec step's commit of a chain prefix on several Gated DeltaNet layers at once (spec-loop.md §5.3: the states
// after the accepted tokens, recomputed from the verify's inputs). The layers share T, C and K - 1; each state is
// updated in place, and the result equals the single-layer op's bitwise (the GPU runs all layers in one launch).
// conv1d_causal_states: states[i] (F32 [K-1, C], contiguous, writable) <- the last K-1 rows of [states[i] ; xs[i]]
// (xs[i]: F32 [T, C], contiguous): conv1d_causal's state update without its outputs.
// gated_delta_net_states: gated_delta_net(q[i], k[i], v[i], g[i], beta[i], states[i], scale) for every layer i, in
// place, without its outputs (o); inputs contiguous, the shapes of gated_delta_net, the same for every layer.
// Throws std::invalid_argument naming the layer and argument on a bad dtype, shape, layout or device, lists of
// different lengths, layers of different shapes, or a state overlapping another state or any layer's input.
void conv1d_causal_states(const std::vector<Tensor>& xs, const std::vector<Tensor>& states);
void gated_delta_net_states(const std::vector<Tensor>& q, const std::vector<Tensor>& k, const std::vector<Tensor>& v,
                            const std::vector<Tensor>& g, const std::vector<Tensor>& beta,
                            const std::vector<Tensor>& states, float scale);

// The Gated DeltaNet core of a step after its conv, as one op (the GPU fuses it: gpu::gdn_step): with
// (q, k, v) = gdn_qkv(cv, n_k_heads, head_k_dim, n_v_heads, head_v_dim, eps) and (g, beta) =
// gdn_gates(a, b, dt, ssm_a), o = gated_delta_net(q, k, v, g, beta, state, scale, none, state_out).
// Returns (o, q, k, v, g, beta), the ops' results (the output's gated norm is the out projection's
// rms_norm_gated_matmul); throws std::invalid_argument as they do.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> gdn_step(
    const Tensor& cv, const Tensor& a, const Tensor& b, const Tensor& dt, const Tensor& ssm_a, const Tensor& state,
    int64_t n_k_heads, int64_t head_k_dim, int64_t n_v_heads, int64_t head_v_dim, float eps, float scale,
    const std::optional<Tensor>& state_out);

// gdn_step's checks, shared by the CPU and GPU backends and made before anything runs (so a bad argument
// leaves the state untouched): cv as gdn_qkv; a, b F32 [T, Hv] and dt, ssm_a F32 [Hv] or [1, Hv], contiguous;
// Hv % Hk == 0; scale finite; state /
// state_out as gated_delta_net's (written_state), the written one overlapping none of the inputs. Returns the
// state the call writes. Throws std::invalid_argument naming gdn_step (or gdn_qkv / gdn_gates for cv, a, b).
const Tensor& check_gdn_step_args(const Tensor& cv, const Tensor& a, const Tensor& b, const Tensor& dt,
                                  const Tensor& ssm_a, const Tensor& state, const std::optional<Tensor>& state_out,
                                  int64_t n_k_heads, int64_t head_k_dim, int64_t n_v_heads, int64_t head_v_dim,
                                  float eps, float scale, Device dev);

// gdn_step_gated_matmul's output-norm arguments, after check_gdn_step_args (both backends; std::invalid_argument
// naming op and the argument): z F32 [T, Hv, dv] and norm_weight F32 [dv] (or none), contiguous on dev, neither
// overlapping the state the step writes (`written`: the fused GPU kernel reads them while other blocks store it).
void check_gdn_output_norm_args(const Tensor& z, const std::optional<Tensor>& norm_weight, const Tensor& written,
                                int64_t T, int64_t n_v_heads, int64_t head_v_dim, Device dev, const char* op);

// The dimensions of a gated_delta_net call: T tokens, Hk key heads of dk, Hv value heads of dv.
struct GdnDims {
  int64_t T, hk, dk, hv, dv;
};

// Checks shared by the CPU and GPU backends (std::invalid_argument naming `op` and the argument).

// Whether the bytes two tensors can touch overlap (same device assumed; empty tensors never do; block
// formats: whole rows).
bool overlap(const Tensor& a, const Tensor& b);

// The byte spans of the tensors an op writes (several layers' states, copy_tensors' destinations), sorted, to test
// them against each other and against what the op reads in O(N log N) instead of pairwise.
class WrittenSpans {
 public:
  explicit WrittenSpans(const std::vector<const Tensor*>& written);
  // Two written tensors that overlap (their indices, the smaller first), if any.
  std::optional<std::pair<size_t, size_t>> clash() const;
  // A written tensor that t overlaps (its index), if any. Meaningful once clash() found none.
  std::optional<size_t> hit(const Tensor& t) const;

 private:
  struct Span {
    uintptr_t lo, hi;
    size_t index;
  };
  std::vector<Span> spans_;  // non-empty ones, by start
};

// A state argument (state, state_out, checkpoints): F32 of `shape` on `dev`, contiguous, and
// writable when `written`.
void check_state(const Tensor& s, const std::vector<int64_t>& shape, Device dev, const char* op, const char* arg,
                 bool written = true);

// The state a call writes, after checking `state` and `state_out`: state_out when given (either
// `state` itself, in place, or overlapping neither `state` nor any of `inputs`; null entries are
// skipped), else state; only the written one must be writable.
const Tensor& written_state(const Tensor& state, const std::optional<Tensor>& state_out,
                            const std::vector<int64_t>& shape, std::initializer_list<const Tensor*> inputs, Device dev,
                            const char* op);

// The shape contract of gated_delta_net above (each backend checks its own devices, dtypes and
// layouts first): q and k [T, Hk, dk], v [T, Hv, dv] with Hv % Hk == 0, g and beta [T, Hv], scale
// finite.
GdnDims check_gated_delta_net_shapes(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                     const Tensor& beta, float scale, const char* op);

// The checks of conv1d_causal_states and gated_delta_net_states (both backends, before anything runs). Return
// {T, C, K - 1} and the layers' shared dimensions.
struct ConvDims {
  int64_t T, C, km1;
};
ConvDims check_conv1d_causal_states(const std::vector<Tensor>& xs, const std::vector<Tensor>& states, Device dev);
GdnDims check_gated_delta_net_states(const std::vector<Tensor>& q, const std::vector<Tensor>& k,
                                     const std::vector<Tensor>& v, const std::vector<Tensor>& g,
                                     const std::vector<Tensor>& beta, const std::vector<Tensor>& states, float scale,
                                     Device dev);

}  // namespace specd::cpu
