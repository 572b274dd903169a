// GPU implementations of native ops (CUDA source, HIP through portability.h). Same contracts as
// the CPU ops of the same name (native/src/cpu/*.h); inputs are GPU tensors, outputs are new GPU
// tensors enqueued on the library stream (read them with Tensor.numpy(), which synchronises).
// Only included by builds with SPECD_WITH_GPU=1. Every op checks devices, dtypes and shapes and
// throws std::invalid_argument (Python ValueError) naming the op and argument, like the CPU ops;
// runtime failures throw std::runtime_error naming the failing call.
#pragma once
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "../cpu/attention.h"
#include "../cpu/rope.h"
#include "specd/tensor.h"

namespace specd::gpu {

// RMSNorm over the last dimension: y = x / sqrt(mean(x^2) + eps) * weight (norm.cu).
// x: F32 [..., d] contiguous; weight: F32 [d] or none; eps finite, >= 0. With `residual` (F32, same
// shape as x) h = x + residual is normalised and returned as the second element; without it the
// second element is x itself. Agrees with cpu::rms_norm to ~1 ulp (double sum of squares).
std::pair<Tensor, Tensor> rms_norm(const Tensor& x, const std::optional<Tensor>& weight, float eps,
                                   const std::optional<Tensor>& residual);

// Gated RMSNorm as cpu::rms_norm_gated: rms_norm(x, weight, eps) * silu(z), z F32 of x's shape,
// one launch (norm.cu); bit-identical to mul(rms_norm(x, weight, eps), silu(z)) on the GPU.
Tensor rms_norm_gated(const Tensor& x, const std::optional<Tensor>& weight, float eps, const Tensor& z);

// L2 normalisation over the last dimension: y = x / sqrt(sum(x^2) + eps). F32 [..., d] (norm.cu).
Tensor l2_norm(const Tensor& x, float eps);

// cpu::gdn_qkv in one launch (norm.cu): each q / k head normalised by l2_norm's per-row code (same
// block size and order of sums), so bit-identical to l2_norm of the column slices on the GPU.
// head_k_dim at most 8192.
std::tuple<Tensor, Tensor, Tensor> gdn_qkv(const Tensor& cv, int64_t n_k_heads, int64_t head_k_dim,
                                           int64_t n_v_heads, int64_t head_v_dim, float eps);

// y[n, out] = x[n, in] @ w[out, in]^T (matmul.cu). x: F32 [..., in] contiguous (output shape is
// x's with the last dimension replaced by out); w: F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K or IQ4_XS
// [out, in] contiguous, in a multiple of the format's block size (32 / 256).
// n <= 16 rows: a GEMV-style kernel that reads each weight byte once per call; F32 / F16 and BF16
// rows the tensor cores do not take (and every format on HIP): weights decoded in registers to exactly
// cpu::dequantize's values, F32 FMAs; BF16 with in % 64 == 0 and 16-byte aligned rows on CUDA: bf16
// tensor cores against x split into three BF16 terms (hi + mid + lo == x for |x| >= 2^-110), F32
// sums; Q8_0 / Q4_K / Q5_K / Q6_K / IQ4_XS on CUDA: integer tensor cores on the int8 quants against
// x split per 256-input group into a power of two times three int8 terms (~21 bits of the group's
// maximum: |x - s (2^14 hi + 2^7 mid + lo)| <= 2^-20 max|x over the group| (at least 2^-120)), exact integer sums with
// the integer sub-block scales, F32 once per super-block (matmul.cu). Error within 1e-5 *
// (|x| @ |w|^T) elementwise of the exact product (barring adversarial groups whose maximum meets
// zero weights while elements ~2^17 smaller carry the product); inf / NaN in a row of x give
// non-finite results in that row;
// batch invariant: row i of y is bit-identical whatever n (1..16). n > 16 with `exact` (the default): the same GEMV over
// slices of 16 rows, so every row stays bit-identical to a 1-row call (verify of any width equals
// decode). n > 16 without `exact` (prefill): w dequantized to BF16 (BF16 weights read as they are)
// and x rounded to BF16 on the device, then cuBLAS / hipBLAS with F32 accumulation (matmul_blas.cu); error within
// (2^-8 + 1e-5) * (|x| @ |w|^T) elementwise, not batch invariant across n.
Tensor matmul(const Tensor& x, const Tensor& w, bool exact = true);

// matmul of one x against several weights [out_i, in] (the projections that read one hidden state):
// the same results as separate matmul calls, bit for bit (each weight keeps its own split of the
// reduction dimension), with x split once and each tensor-core format's weights in one launch (up
// to 8 per launch). Raises std::invalid_argument as matmul does, and for an empty list.
std::vector<Tensor> matmul_group(const Tensor& x, const std::vector<Tensor>& ws, bool exact = true);

// matmul_group of rms_norm's output: (ys, h) with ys bit-identical to matmul_group(u, ws, exact) where
// (u, h) = rms_norm(x, weight, eps, residual) (h = x + residual; x without a residual). When the GEMV
// reads x split (1..16 rows, tensor-core formats, 16-byte aligned rows) the norm kernel writes that
// split and u is never stored: one launch fewer (norm_split_kernel, norm_split.cuh); otherwise the
// composition. Raises std::invalid_argument as rms_norm and matmul_group do.
// Split-K partials (cpu::check_partials): with `partials` each output comes as the partials the GEMV computed it
// from, [S_i, n, out_i] (S_i = the integer tensor-core GEMV's splits when it ran on one slice, else 1: the output
// itself), left for the op that reads it to sum instead of a sum kernel; with `in_partials` x is such partials
// [S, n, d]: the norm sums them itself (norm_split_partials_kernel, a thread-block cluster per row) when the norm
// is fused with the GEMV's split and norm_reads_partials(d);
// otherwise sum_partials first. h = their sum (+ residual); everything bit for bit the ops on the sum.
std::pair<std::vector<Tensor>, Tensor> rms_norm_matmul(const Tensor& x, const std::optional<Tensor>& weight, float eps,
                                                       const std::vector<Tensor>& ws,
                                                       const std::optional<Tensor>& residual, bool exact = true,
                                                       bool partials = false, bool in_partials = false);

// matmul_group(swiglu(gate, up), ws, exact): bit for bit, with the SwiGLU computed by the GEMV's x split
// (elementwise_split_kernel reading gate and up) when the GEMV reads x split, or by the composition; with
// exact = false and more than 16 rows (prefill), by the BF16 GEMM's x conversion in F32 (matmul_blas_swiglu:
// within a BF16 ulp of each x value, inside the GEMM's own error bound).
// `partials` / `in_partials` (gate and up): as rms_norm_matmul's; the split sums partials as it reads them.
std::vector<Tensor> swiglu_matmul(const Tensor& gate, const Tensor& up, const std::vector<Tensor>& ws,
                                  bool exact = true, bool partials = false, bool in_partials = false);

// matmul_group(mul_sigmoid(a, gate) viewed [n, in], ws, exact), bit for bit: gated attention's output gate and
// out projection. a: F32 [n, ..., d] contiguous (in = its elements per row n); gate: a's shape, rows evenly spaced
// (as mul_sigmoid's). When the GEMV reads x split (1..16 rows, tensor-core formats) the split computes the gate
// (elementwise_split_kernel) and the product is never stored: one launch fewer; otherwise the composition.
// Raises std::invalid_argument as mul_sigmoid and matmul_group do, and for a of fewer than 2 dimensions.
// `partials`: as rms_norm_matmul's.
std::vector<Tensor> mul_sigmoid_matmul(const Tensor& a, const Tensor& gate, const std::vector<Tensor>& ws,
                                       bool exact = true, bool partials = false);

// matmul_group(rms_norm_gated(x, weight, eps, z) viewed [n, groups * d], ws, exact), bit for bit: the Gated
// DeltaNet's output norm and out projection. x, z: F32 [n, groups, d] (RMS-normed over d). When the GEMV reads x
// split (1..16 rows, tensor-core formats) and d % 4 == 0 divides 256 with 16-byte aligned x, z and weight, the
// norm is computed by the GEMV's x split (gated_norm_split_kernel) and never stored: one launch fewer;
// otherwise the composition. Raises std::invalid_argument as rms_norm_gated and matmul_group do, and for x
// not 3-D.
// `partials`: as rms_norm_matmul's.
std::vector<Tensor> rms_norm_gated_matmul(const Tensor& x, const std::optional<Tensor>& weight, float eps,
                                          const Tensor& z, const std::vector<Tensor>& ws, bool exact = true,
                                          bool partials = false);

// Whether rms_norm_matmul's fused norm reads split-K partials of rows of d itself on this device
// (norm_split_partials_kernel: a cluster shape for d, sm_90 code, a device that runs such clusters).
bool norm_reads_partials(int64_t d);

// The value split-K partials p (F32 [S, ...] on the GPU, cpu::check_partials) stand for: p[0] + ... + p[S - 1]
// in order (partials.cuh), one launch; part 0 itself (a view) when S = 1. Raises std::invalid_argument on a bad p.
Tensor sum_partials(const Tensor& p);

// Whether this build's GEMV reads the tiled layouts (CUDA: yes; HIP: no, its FMA GEMV reads row-major).
bool gemv_tiles_supported();

// w (IQ4_XS, Q4_K, Q5_K or Q6_K [out, in] on the GPU, contiguous, out a multiple of 16) regrouped into
// IQ4_XS_TILED / Q4_K_TILED / Q5_K_TILED / Q6_K_TILED, the tensor-core GEMV's layouts (matmul_mma.cuh, IQ4T / Q4T /
// Q5T / Q6T: every warp load covers 512 contiguous bytes, not 8 rows x 16 bytes or 2-byte words): a new GPU tensor of the
// same shape and size (the same bytes regrouped; IQ4_XS's 4-bit indices also recoded, bits 2 and 3 swapped, for a
// shorter table lookup); matmul / matmul_group read it with bit-identical results (the prefill path dequantizes it
// to the same BF16 values). With `out` (a contiguous GPU tensor of w's shape and tiled dtype, e.g. an IPC export's
// buffer) the tiles are written there and `out` is returned. Raises std::invalid_argument for another dtype, device
// or shape (of w or out), or on a build without the tensor-core GEMV.
Tensor tile_for_gemv(const Tensor& w, const std::optional<Tensor>& out = std::nullopt);

// Index of the first maximum of each row (argmax.cu); x F32 [..., V] contiguous, V >= 1 ->
// I32 [...] (x's shape without the last dimension). NaN counts as larger than every number
// (numpy.argmax semantics: the first NaN wins); -0.0 == +0.0 (the first wins).
Tensor argmax(const Tensor& x);

// ---- Ops of issue 7 part 2 (same contracts as the CPU ops of the same name; GPU inputs must be
// contiguous; index tensors (ids, rows, positions, q_pos, mask) may be CPU or GPU I32 tensors. CPU
// ones are value-checked on the host and uploaded asynchronously (pinned staging). GPU ones are
// read back and checked (one synchronising copy) unless `trusted`: then the caller guarantees the
// values and nothing synchronises, while the kernels still guard every index (what a bad value does
// is documented per op: never an out-of-bounds access). Tolerances in each .cu file's header.

// Elementwise (elementwise.cu): as cpu/activations.h; mul/add exact, the others <= 1 F32 ulp.
// mul / add also broadcast a b of shape [H] or [1, H] over the rows of a [..., H] (as the CPU ops).
Tensor silu(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor softplus(const Tensor& x);
Tensor swiglu(const Tensor& gate, const Tensor& up);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor add(const Tensor& a, const Tensor& b);
// a * sigmoid(gate) as cpu::mul_sigmoid, one launch; bit-identical to mul(a, sigmoid(gate)) on the GPU.
// a contiguous; gate of a's shape with evenly spaced rows (contiguous, or qk_norm_rope's view in qg).
Tensor mul_sigmoid(const Tensor& a, const Tensor& gate);
// (g, beta) = (ssm_a * softplus(a + dt), sigmoid(b)) as cpu::gdn_gates, in one launch: a, b F32
// [T, H]; dt, ssm_a F32 [H] or [1, H]. Bit-identical to mul(softplus(add(a, dt)), ssm_a) and
// sigmoid(b) on the GPU (the same device functions).
std::pair<Tensor, Tensor> gdn_gates(const Tensor& a, const Tensor& b, const Tensor& dt, const Tensor& ssm_a);

// y[i] = dequantize(w[ids[i]]) for w F32/F16/BF16/Q8_0 [V, H] (embedding.cu); bit-identical to CPU.
// Trusted ids outside [0, V) give a row of zeros.
Tensor embedding(const Tensor& w, const Tensor& ids, bool trusted = false);

// Partial NeoX RoPE + YaRN as cpu::rope_neox (rope.cu); <= 1 F32 ulp from the CPU op. A trusted
// negative position is rotated as given (no memory access depends on a position).
Tensor rope_neox(const Tensor& x, const Tensor& positions, int64_t n_rot, double theta, const cpu::Yarn& yarn,
                 bool trusted = false);
// cpu::qk_norm_rope in one launch (rope.cu): q and k bit-identical to rope_neox(rms_norm(.)) on the GPU,
// gate the same view of qg; positions and trusted as rope_neox. With `cache` the same launch writes the
// caches as kv_write(k_cache, k, rows) and kv_write(v_cache, v, rows) would (the same bytes; rows, CPU or
// GPU, and trusted as kv_write's: a trusted row outside [0, capacity) is skipped).
std::tuple<Tensor, Tensor, Tensor> qk_norm_rope(const Tensor& qg, const Tensor& k, const Tensor& q_norm_w,
                                                const Tensor& k_norm_w, const Tensor& positions, int64_t n_rot,
                                                double theta, float eps, bool trusted = false,
                                                const std::optional<cpu::QkCacheWrite>& cache = std::nullopt);

// KV cache write and GQA attention as cpu::kv_write / cpu::attention (attention.cu). kv_write is
// bit-identical to the CPU op; attention (exact, the default) is split-K over fixed chunks of each row's
// visible keys and batch invariant bit for bit (result depends only on the row's ordered visible keys).
// exact = false (prefill chunks only) lets calls of >= 64 rows without a mask on F16 caches of head_dim
// 64 / 128 / 256 run the tensor-core flash-attention kernel (attention_flash.cuh: F16 q and softmax
// weights, ~1e-3 * max|v| from the CPU op; deterministic, a row's result independent of the other rows,
// but not the exact path's); every other call ignores it. Trusted kv_write rows outside [0, capacity)
// are skipped (repeated rows: one of the writes wins); a trusted negative q_pos sees no key when causal
// (zeros) and keys from 0 otherwise; keys past kv_len are never read.
void kv_write(const Tensor& cache, const Tensor& x, const Tensor& rows, bool trusted = false);
Tensor attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& q_pos,
                 const cpu::AttentionArgs& args, bool trusted = false, bool exact = true);

// Gated DeltaNet conv and recurrence as cpu::conv1d_causal / cpu::gated_delta_net (ssm.cu),
// including the optional out-of-place state_out. exact = false lets a call of >= 64 tokens without
// checkpoints take the chunked (WY-form) recurrence: prefill only (its rounding differs from the
// token-by-token kernel's, within the CPU tolerance).
Tensor conv1d_causal(const Tensor& x, const Tensor& weight, const Tensor& state, bool apply_silu,
                     const std::optional<Tensor>& state_out = std::nullopt);
Tensor gated_delta_net(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                       const Tensor& state, float scale, const std::optional<Tensor>& checkpoints,
                       const std::optional<Tensor>& state_out = std::nullopt, bool exact = true);

// cpu::conv1d_causal_states / cpu::gated_delta_net_states (a commit's state updates on several layers, bitwise
// those of conv1d_causal / gated_delta_net): one launch for all layers (up to 64 a launch; a recurrence whose shape
// gated_delta_net runs without its register kernel runs layer by layer).
void conv1d_causal_states(const std::vector<Tensor>& xs, const std::vector<Tensor>& states);
void gated_delta_net_states(const std::vector<Tensor>& q, const std::vector<Tensor>& k, const std::vector<Tensor>& v,
                            const std::vector<Tensor>& g, const std::vector<Tensor>& beta,
                            const std::vector<Tensor>& states, float scale);

// The Gated DeltaNet core of a decode / verify step after its conv (ssm.cu): gdn_qkv(cv), gdn_gates(a, b,
// dt, ssm_a) and gated_delta_net (exact, token by token) from state (to state_out when given) in one launch
// (gdn_step_kernel), bit-identical to that composition, which it runs instead where the recurrence is not the
// register kernel's (dk not 32 / 64 / 128, or a block of dv rows that is over 512 threads or not whole warps).
// Returns (o [T, Hv, dv], q, k [T, Hk, dk], v [T, Hv, dv], g, beta [T, Hv]); the output's gated norm is the
// out projection's (rms_norm_gated_matmul). Checks every argument first (cpu::check_gdn_step_args); throws
// std::invalid_argument.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> gdn_step(
    const Tensor& cv, const Tensor& a, const Tensor& b, const Tensor& dt, const Tensor& ssm_a, const Tensor& state,
    int64_t n_k_heads, int64_t head_k_dim, int64_t n_v_heads, int64_t head_v_dim, float eps, float scale,
    const std::optional<Tensor>& state_out);
// gdn_step followed by rms_norm_gated_matmul(o, norm_weight, eps, z, ws, exact, partials) (o [T, Hv, dv] not
// returned): (ys, q, k, v, g, beta), bit-identical to that composition. Where the tensor-core GEMV reads the
// output (T <= 16, tensor-core weight formats, CUDA sm_90: matmul.cu) the gdn_step launch itself norms and splits o
// (gdn_step_split_kernel), one launch fewer; otherwise the composition. Checks every argument first (the state
// is untouched on a bad one); throws std::invalid_argument.
std::tuple<std::vector<Tensor>, Tensor, Tensor, Tensor, Tensor, Tensor> gdn_step_gated_matmul(
    const Tensor& cv, const Tensor& a, const Tensor& b, const Tensor& dt, const Tensor& ssm_a, const Tensor& state,
    int64_t n_k_heads, int64_t head_k_dim, int64_t n_v_heads, int64_t head_v_dim, float eps, float scale,
    const std::optional<Tensor>& state_out, const std::optional<Tensor>& norm_weight, const Tensor& z,
    const std::vector<Tensor>& ws, bool exact, bool partials);

// DFlash 2's grouped dynamic causal convolution as cpu::grouped_dynamic_conv (dynamic_conv.cu): one thread
// per output element, the CPU op's F32 operations in its order with explicit round-to-nearest (no FMA), so
// bit-identical to the CPU op. dyn [L, S, taps, G] is read in place at `side`.
Tensor grouped_dynamic_conv(const Tensor& y, const Tensor& dyn, const Tensor& base, int64_t side = 0);

// Top-k per row as cpu::topk (topk.cu); exact.
std::pair<Tensor, Tensor> topk(const Tensor& x, int64_t k);

}  // namespace specd::gpu
