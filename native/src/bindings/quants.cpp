// dequantize, quantize, matmul, embedding.
#include <stdexcept>
#include <string>

#include "../cpu/activations.h"
#include "../cpu/matmul.h"
#include "../cpu/norm.h"
#include "../cpu/quants.h"
#include "../cpu/ssm.h"
#if SPECD_WITH_GPU
#include "../gpu/ops.h"
#endif
#include "bindings.h"

namespace specd::py_bind {

namespace {

// A Tensor argument given as a Tensor or a numpy array. Numpy arrays are taken by their own dtype
// (float32 -> F32, float16 -> F16, int32 -> I32, native byte order); anything else is refused naming
// op and argument (block formats and BF16 come as Tensor(raw, DType.X)).
Tensor as_tensor(const py::handle& obj, const char* op, const char* arg) {
  if (py::isinstance<Tensor>(obj)) return obj.cast<Tensor>();
  SPECD_CHECK(py::isinstance<py::array>(obj), op, ": ", arg, " must be a specd Tensor or a numpy array, got ",
              std::string(py::str(obj.get_type())));
  auto a = py::reinterpret_borrow<py::array>(obj);
  // by kind and size: str(dtype) runs numpy's Python code, ~3.5 us on every op call of the CPU forward
  SPECD_CHECK(numpy_dtype(a.dtype()), op, ": ", arg, " has numpy dtype ", std::string(py::str(a.dtype())),
              "; pass float32, float16 or int32 arrays, or Tensor(raw_bytes, DType.X) for block formats and BF16");
  return from_numpy(a, std::nullopt);
}

// The weights of a group call (a non-empty sequence, each on x's device).
std::vector<Tensor> group_weights(const Tensor& x, const py::sequence& ws, const char* op) {
  std::vector<Tensor> wt;
  for (const py::handle& w : ws) {
    wt.push_back(as_tensor(w, op, "ws[i]"));
    require_same_device(x, wt.back(), op);
  }
  SPECD_CHECK(!wt.empty(), op, ": no weights");
  return wt;
}

// [x @ w.T for w in ws] on the CPU (call without the GIL); errors name the weight's index.
std::vector<Tensor> cpu_group(const Tensor& x, const std::vector<Tensor>& ws, const char* op) {
  std::vector<Tensor> ys;
  for (size_t i = 0; i < ws.size(); ++i) {
    try {
      ys.push_back(cpu::matmul(x, ws[i]));
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(std::string(op) + ": ws[" + std::to_string(i) + "]: " + e.what());
    }
  }
  return ys;
}

// The CPU's `partials` outputs: each output as its one part [1, ...] (the CPU's matmul has no splits).
std::vector<Tensor> cpu_partials(std::vector<Tensor> ys, bool partials) {
  if (partials)
    for (Tensor& y : ys) {
      std::vector<int64_t> shape = y.shape;
      shape.insert(shape.begin(), 1);
      y = y.reshape(shape);
    }
  return ys;
}

// An `in_partials` input on the CPU: the value it stands for (cpu::sum_partials, errors naming op and arg).
Tensor cpu_input(const Tensor& t, bool in_partials, const char* op, const char* arg) {
  return in_partials ? cpu::sum_partials(t, op, arg) : t;
}

// The ops' `in_partials` inputs stand for matrices [n, d]: partials of one are [S, n, d] (a 2-D tensor would be
// read as S partials of one row). Both backends.
void check_matrix_partials(const Tensor& t, bool in_partials, const char* op, const char* arg) {
  SPECD_CHECK(!in_partials || t.ndim() == 3, op, ": ", arg,
              " must be split-K partials [S, n, d] with in_partials=True, got ", t.ndim(), " dimension(s)");
}

// doc followed by the paragraph on split-K partials that the ops taking `partials` share (m.def copies a
// docstring: the temporary may go once it returns).
std::string with_partials_doc(const char* doc) {
  return std::string(doc) + R"doc(

Split-K partials (the GEMV's per-split sums, handed from one op to the next instead of being summed by a
kernel of their own): with partials=True each output comes as F32 [S, n, out_i] whose sum p[0] + p[1] + ...
+ p[S - 1], added in that order in F32, is the output bit for bit (sum_partials); S is the integer
tensor-core GEMV's split count when it computed that output in one slice (GPU, 1 <= n <= 16, a Q8_0 /
K-quant / IQ4_XS weight), else 1 (the output itself, with a leading axis: always on the CPU).)doc";
}

}  // namespace

void register_quants(py::module_& m) {
  m.def(
      "norm_reads_partials",
      [](int64_t d) {
#if SPECD_WITH_GPU
        if (gpu::available()) return gpu::norm_reads_partials(d);
#endif
        (void)d;
        return false;
      },
      py::arg("d"),
      "Whether rms_norm_matmul's fused GPU norm reads split-K partials of rows of d itself on this device "
      "(norm_split_partials_kernel: sm_90 code, d cut into a cluster of 2-8 blocks of 128 threads, a device that runs "
      "such clusters); False without a GPU.");
  m.def(
      "sum_partials",
      [](const py::object& p) {
        Tensor pt = as_tensor(p, "sum_partials", "p");
#if SPECD_WITH_GPU
        if (pt.device == Device::GPU) return without_gil([&] { return gpu::sum_partials(pt); });
#endif
        return without_gil([&] { return cpu::sum_partials(pt); });
      },
      py::arg("p"),
      R"doc(The value split-K partials stand for: p F32 [S, ...] contiguous (S >= 1, as the matmul ops give them
with partials=True) -> p[0] + p[1] + ... + p[S - 1] of shape p.shape[1:], added in that order with each add
rounded once in F32 (the order every op reading partials uses, so each equals the others bit for bit). S = 1:
part 0 itself (a view, no copy). GPU: one launch. Raises ValueError on another dtype, fewer than 2 dimensions,
a non-contiguous p, or S outside 1 .. 65536.)doc");

  m.def(
      "dequantize",
      [](const py::object& w) {
        Tensor wt = as_tensor(w, "dequantize", "w");
        return without_gil([&] { return cpu::dequantize(wt); });
      },
      py::arg("w"),
      R"doc(Decode a weight tensor to float32.

w: Tensor [..., n] of F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K or IQ4_XS (CPU, contiguous rows; block
formats as Tensor(raw_uint8_rows, DType.X)). Returns an F32 Tensor of the same logical shape.
Bit-identical to gguf.quants.dequantize: the same float32 operations in the same order as gguf's
numpy code and ggml's dequantize_row_* (block layouts: qwen35-target.md §10.1, ggml-common.h).
Raises ValueError for I32 or a non-contiguous tensor.)doc");

  m.def(
      "quantize",
      [](const py::object& x, DType dtype) {
        Tensor xt = as_tensor(x, "quantize", "x");
        return without_gil([&] { return cpu::quantize(xt, dtype); });
      },
      py::arg("x"), py::arg("dtype"),
      R"doc(Encode float32 rows as F32, F16, BF16 or Q8_0.

x: F32 [..., n] (CPU, contiguous), n a multiple of the block size (32 for Q8_0). Returns a Tensor
of dtype with x's logical shape (.numpy() gives float16 / uint16 bits / raw uint8 blocks).
Bit-identical to gguf.quants.quantize (F16: numpy's round-to-nearest-even cast, NaN payloads
kept; BF16: ggml_compute_fp32_to_bf16; Q8_0: ggml quantize_row_q8_0_ref, d = amax/127,
q = round-half-away(x/d); for finite x). Raises ValueError for other dtypes or ragged blocks.)doc");

  m.def(
      "matmul",
      [](const py::object& x, const py::object& w, bool exact) {
        Tensor xt = as_tensor(x, "matmul", "x"), wt = as_tensor(w, "matmul", "w");
        require_same_device(xt, wt, "matmul");
#if SPECD_WITH_GPU
        if (wt.device == Device::GPU) return without_gil([&] { return gpu::matmul(xt, wt, exact); });
#endif
        return without_gil([&] { return cpu::matmul(xt, wt); });
      },
      py::arg("x"), py::arg("w"), py::arg("exact") = true,
      R"doc(y = x @ w.T: a linear layer without bias against a stored weight.

x: F32 [n, in] (2-D, contiguous). w: [out, in] of F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K or IQ4_XS
(a GGUF weight with ne = [in, out]; in a multiple of the block size). Returns F32 [n, out].
CPU: each weight row is decoded once per call (exactly as dequantize) and dotted with every row
of x in float32 with 16 interleaved partial sums combined in a fixed order, so row i of y is
bitwise identical whatever n (batch invariance) and the weight bytes are read once per call.
GPU tensors run gpu::matmul: every format above; a batch-invariant GEMV (weights decoded to the
same float32 values as here) over slices of 16 rows, or, with exact=False and n > 16 (prefill),
BF16-dequantized weights and BF16 x through cuBLAS / hipBLAS with float32 accumulation (error
within (2^-8 + 1e-5) * (|x| @ |w|^T), not batch invariant). The CPU is always exact and ignores
`exact`. On CUDA the GEMV starts loading w before the kernels queued before it have finished
(programmatic dependent launch, native/src/gpu/pdl.cuh): a w written on the device by another op
(not an upload or tile_for_gemv) must be complete first (gpu_synchronize). Raises ValueError on
dtype, dimension or device mismatch.)doc");

  m.def(
      "matmul_group",
      [](const py::object& x, const py::sequence& ws, bool exact) {
        Tensor xt = as_tensor(x, "matmul_group", "x");
        std::vector<Tensor> wt = group_weights(xt, ws, "matmul_group");
#if SPECD_WITH_GPU
        if (xt.device == Device::GPU) return without_gil([&] { return gpu::matmul_group(xt, wt, exact); });
#endif
        return without_gil([&] { return cpu_group(xt, wt, "matmul_group"); });
      },
      py::arg("x"), py::arg("ws"), py::arg("exact") = true,
      R"doc([x @ w.T for w in ws]: several linear layers reading the same x (the projections of one
hidden state), bit-identical to separate matmul calls (each weight keeps its own arithmetic).

x: F32 [n, in]; ws: a non-empty sequence of weights [out_i, in] as for matmul, all on x's device.
Returns a list of F32 [n, out_i]. GPU, n <= 16 (and exact slices of 16): x is split for the
tensor-core GEMV once per slice and each tensor-core format's weights (Q8_0, K-quants, IQ4_XS; BF16
with in % 64 == 0 and 16-byte aligned rows, on x split into three BF16 terms) run as one launch of
up to 8 weights; F32 / F16 and other BF16 weights (and every format on HIP) run one FMA-GEMV launch
each. GPU, n > 16 with exact=False: x is rounded to BF16 once, then one GEMM per weight. The
CPU runs the calls in turn. Raises ValueError on an empty sequence, dtype, dimension or device
mismatch (naming ws[i]).)doc");

  m.def(
      "rms_norm_matmul",
      [](const py::object& x, std::optional<Tensor> weight, float eps, const py::sequence& ws,
         std::optional<Tensor> residual, bool exact, bool partials, bool in_partials) {
        const char* op = "rms_norm_matmul";
        Tensor xt = as_tensor(x, op, "x");
        check_matrix_partials(xt, in_partials, op, "x");
        for (const auto* t : {&weight, &residual})
          if (*t) require_same_device(xt, **t, op);
        std::vector<Tensor> wt = group_weights(xt, ws, op);
        auto [ys, h] = without_gil([&]() -> std::pair<std::vector<Tensor>, Tensor> {
#if SPECD_WITH_GPU
          if (xt.device == Device::GPU)
            return gpu::rms_norm_matmul(xt, weight, eps, wt, residual, exact, partials, in_partials);
#endif
          auto [u, hh] = cpu::rms_norm(cpu_input(xt, in_partials, op, "x"), weight, eps, residual);
          return {cpu_partials(cpu_group(u, wt, op), partials), hh};
        });
        return py::make_tuple(ys, h);
      },
      py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("ws"), py::arg("residual") = py::none(),
      py::arg("exact") = true, py::arg("partials") = false, py::arg("in_partials") = false,
      with_partials_doc(R"doc(The projections of an RMS-normed hidden state: (ys, h) with ys = matmul_group(u, ws, exact)
where u = rms_norm(x, weight, eps) of h = x + residual (with a residual) or of h = x (without).

Arguments as for rms_norm and matmul_group (x F32 [n, d]; weight F32 [d] or None; ws [out_i, d]; all on
one device). Returns (list of F32 [n, out_i], h). Bit-identical to that composition on each backend.
On the GPU, when the tensor-core GEMV reads the normed rows (1 <= n <= 16, every weight Q8_0 /
K-quant / IQ4_XS, 16-byte aligned rows) the norm kernel also writes the GEMV's split of them and u is
never stored (one kernel launch fewer per call, norm_split.cuh: norm_split_kernel); otherwise the ops run
in turn. On CUDA that kernel loads `weight`, and the GEMV `ws`, before the kernels queued before them
have finished (programmatic dependent launch, native/src/gpu/pdl.cuh): a weight or ws written on the
device by another op (not an upload or tile_for_gemv) must be complete first (gpu_synchronize).
in_partials=True: x is given as split-K partials [S, n, d] (below) and h is their sum (+ residual); when the
norm is fused as above and norm_reads_partials(d) (sm_90 code, d cut into a cluster of 2-8 blocks of 128
threads, a device that runs such clusters) the norm reads them itself, one thread-block cluster per row whose
blocks together replay the one-block norm's sums in its order (norm_split_partials_kernel): no sum launch;
otherwise sum_partials first. Raises ValueError as those ops do, and for partials sum_partials refuses.)doc").c_str());
  m.def(
      "swiglu_matmul",
      [](const py::object& gate, const py::object& up, const py::sequence& ws, bool exact, bool partials,
         bool in_partials) {
        const char* op = "swiglu_matmul";
        Tensor gt = as_tensor(gate, op, "gate"), ut = as_tensor(up, op, "up");
        require_same_device(gt, ut, op);
        SPECD_CHECK(gt.shape == ut.shape, op, ": gate and up must have the same shape");
        check_matrix_partials(gt, in_partials, op, "gate");
        std::vector<Tensor> wt = group_weights(gt, ws, op);
#if SPECD_WITH_GPU
        if (gt.device == Device::GPU)
          return without_gil([&] { return gpu::swiglu_matmul(gt, ut, wt, exact, partials, in_partials); });
#endif
        return without_gil([&] {
          const Tensor g = cpu_input(gt, in_partials, op, "gate"), u = cpu_input(ut, in_partials, op, "up");
          return cpu_partials(cpu_group(cpu::swiglu(g, u), wt, op), partials);
        });
      },
      py::arg("gate"), py::arg("up"), py::arg("ws"), py::arg("exact") = true, py::arg("partials") = false,
      py::arg("in_partials") = false,
      with_partials_doc(R"doc(matmul_group(swiglu(gate, up), ws, exact): the SwiGLU MLP's down projection (and any other
weight reading the same activations), bit-identical to that composition on each backend, except on the
GPU's BF16 GEMM path (below), which is within that path's error bound of it.

gate, up: F32 [n, in] of one shape; ws: [out_i, in] as for matmul_group; all on one device. Returns a
list of F32 [n, out_i]. On the GPU, when the tensor-core GEMV reads the activations (as for
rms_norm_matmul), its x split computes silu(gate) * up itself with the swiglu op's device code and
the activations are never stored (one kernel launch fewer); with exact=False and more than 16 rows
(prefill) the BF16 GEMM's input conversion computes them instead, in F32 (gates below -80 in double),
rounded to BF16 (each value within a BF16 ulp of the swiglu op's: matmul_blas_swiglu); otherwise
swiglu, then matmul_group. in_partials=True: gate and up are given as split-K partials [S, n, in] (below),
which that split sums as it reads them (no sum launch; otherwise sum_partials first).
Raises ValueError as swiglu and matmul_group do, and for partials sum_partials refuses.)doc").c_str());

  m.def(
      "mul_sigmoid_matmul",
      [](const py::object& a, const py::object& gate, const py::sequence& ws, bool exact, bool partials) {
        const char* op = "mul_sigmoid_matmul";
        Tensor at = as_tensor(a, op, "a"), gt = as_tensor(gate, op, "gate");
        require_same_device(at, gt, op);
        check_dtype(at, DType::F32, op, "a");
        check_dtype(gt, DType::F32, op, "gate");
        SPECD_CHECK(at.shape == gt.shape, op, ": a and gate must have the same shape");
        SPECD_CHECK(at.ndim() >= 2, op, ": a must be [n, ..., d], got ", at.ndim(), " dimension(s)");
        std::vector<Tensor> wt = group_weights(at, ws, op);
#if SPECD_WITH_GPU
        if (at.device == Device::GPU)
          return without_gil([&] { return gpu::mul_sigmoid_matmul(at, gt, wt, exact, partials); });
#endif
        int64_t in = 1;  // elements per row of a
        for (size_t k = 1; k < at.shape.size(); ++k) in *= at.shape[k];
        return without_gil([&] {
          return cpu_partials(cpu_group(cpu::mul_sigmoid(at, gt).reshape({at.dim(0), in}), wt, op), partials);
        });
      },
      py::arg("a"), py::arg("gate"), py::arg("ws"), py::arg("exact") = true, py::arg("partials") = false,
      with_partials_doc(R"doc(The projections of a sigmoid-gated output: matmul_group(y viewed [n, in], ws, exact) with y =
mul_sigmoid(a, gate) (gated attention's output gate and out projection, qwen35-target.md §6.3).

a: F32 [n, ..., d] (in = its elements per row n); gate: a's shape, rows evenly spaced (a view such as
qk_norm_rope's gate, as mul_sigmoid takes); ws: [out_i, in] as for matmul_group; all on one device. Returns
a list of F32 [n, out_i]. Bit-identical to that composition on each backend. On the GPU, when the
tensor-core GEMV reads the gated rows (1 <= n <= 16, every weight Q8_0 / K-quant / IQ4_XS) the GEMV's x
split computes a * sigmoid(gate) itself with mul_sigmoid's device code (elementwise_split_kernel) and y is
never stored (one kernel launch fewer); otherwise mul_sigmoid, then matmul_group. On CUDA the GEMV loads `ws`
before the kernels queued before it have finished (native/src/gpu/pdl.cuh): a ws written on the device by
another op (not an upload or tile_for_gemv) must be complete first. Raises ValueError as those ops do, and for
a of fewer than 2 dimensions.)doc").c_str());

  m.def(
      "rms_norm_gated_matmul",
      [](const py::object& x, std::optional<Tensor> weight, float eps, const py::object& z, const py::sequence& ws,
         bool exact, bool partials) {
        const char* op = "rms_norm_gated_matmul";
        Tensor xt = as_tensor(x, op, "x"), zt = as_tensor(z, op, "z");
        require_same_device(xt, zt, op);
        if (weight) require_same_device(xt, *weight, op);
        cpu::check_rms_args(xt, weight, eps, xt.device, op);
        cpu::check_like_x(zt, xt, xt.device, op, "z");
        SPECD_CHECK(xt.ndim() == 3, op, ": x must be [n, groups, d], got ", xt.ndim(), " dimensions");
        std::vector<Tensor> wt = group_weights(xt, ws, op);
#if SPECD_WITH_GPU
        if (xt.device == Device::GPU)
          return without_gil([&] { return gpu::rms_norm_gated_matmul(xt, weight, eps, zt, wt, exact, partials); });
#endif
        return without_gil([&] {
          const Tensor y = cpu::rms_norm_gated(xt, weight, eps, zt);
          return cpu_partials(cpu_group(y.reshape({xt.dim(0), xt.dim(1) * xt.dim(2)}), wt, op), partials);
        });
      },
      py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("z"), py::arg("ws"), py::arg("exact") = true,
      py::arg("partials") = false,
      with_partials_doc(R"doc(The projections of a gated RMS-normed state: matmul_group(y viewed [n, groups * d], ws, exact) with
y = rms_norm_gated(x, weight, eps, z), normed over d (the Gated DeltaNet's output norm and out projection,
qwen35-target.md §6.5 steps 8-9).

x, z: F32 [n, groups, d] of one shape; weight: F32 [d] or None; ws: [out_i, groups * d] as for
matmul_group; all on one device. Returns a list of F32 [n, out_i]. Bit-identical to that composition on
each backend. On the GPU, when the tensor-core GEMV reads the normed rows (1 <= n <= 16, every weight
Q8_0 / K-quant / IQ4_XS, d % 4 == 0 dividing 256, 16-byte aligned x, z and weight) the GEMV's x split
computes the norm itself with the standalone op's sums (gated_norm_split_kernel) and y is never stored
(one kernel launch fewer); otherwise rms_norm_gated, then matmul_group. On CUDA the GEMV loads `ws` before
the kernels queued before it have finished (native/src/gpu/pdl.cuh): a ws written on the device by another op
(not an upload or tile_for_gemv) must be complete first. Raises ValueError as those ops do, and for x not
3-D.)doc").c_str());

  m.def(
      "gdn_step_gated_matmul",
      [](const Tensor& cv, const Tensor& a, const Tensor& b, const Tensor& dt, const Tensor& ssm_a, const Tensor& state,
         int64_t n_k_heads, int64_t head_k_dim, int64_t n_v_heads, int64_t head_v_dim, float eps, float scale,
         std::optional<Tensor> norm_weight, const py::object& z, const py::sequence& ws, bool exact, bool partials,
         std::optional<Tensor> state_out) {
        const char* op = "gdn_step_gated_matmul";
        Tensor zt = as_tensor(z, op, "z");
        for (const Tensor* t : {&a, &b, &dt, &ssm_a, &state, static_cast<const Tensor*>(&zt)})
          require_same_device(cv, *t, op);
        if (state_out) require_same_device(cv, *state_out, op);
        if (norm_weight) require_same_device(cv, *norm_weight, op);
        std::vector<Tensor> wt = group_weights(cv, ws, op);
        auto r = without_gil([&] {
#if SPECD_WITH_GPU
          if (cv.device == Device::GPU)
            return gpu::gdn_step_gated_matmul(cv, a, b, dt, ssm_a, state, n_k_heads, head_k_dim, n_v_heads, head_v_dim,
                                              eps, scale, state_out, norm_weight, zt, wt, exact, partials);
#endif
          // the composition; the norm's and the weights' arguments checked before the state is touched
          const Tensor& written = cpu::check_gdn_step_args(cv, a, b, dt, ssm_a, state, state_out, n_k_heads,
                                                           head_k_dim, n_v_heads, head_v_dim, eps, scale, Device::CPU);
          cpu::check_gdn_output_norm_args(zt, norm_weight, written, cv.dim(0), n_v_heads, head_v_dim, Device::CPU, op);
          (void)cpu_group(Tensor::empty({0, n_v_heads * head_v_dim}, DType::F32), wt, op);  // ws' checks
          auto [o, q, k, v, g, beta] = cpu::gdn_step(cv, a, b, dt, ssm_a, state, n_k_heads, head_k_dim, n_v_heads,
                                                     head_v_dim, eps, scale, state_out);
          const Tensor y = cpu::rms_norm_gated(o, norm_weight, eps, zt);
          return std::make_tuple(
              cpu_partials(cpu_group(y.reshape({o.dim(0), o.dim(1) * o.dim(2)}), wt, op), partials), q, k, v, g, beta);
        });
        return py::make_tuple(std::get<0>(r), std::get<1>(r), std::get<2>(r), std::get<3>(r), std::get<4>(r),
                              std::get<5>(r));
      },
      py::arg("cv"), py::arg("a"), py::arg("b"), py::arg("dt"), py::arg("ssm_a"), py::arg("state"),
      py::arg("n_k_heads"), py::arg("head_k_dim"), py::arg("n_v_heads"), py::arg("head_v_dim"), py::arg("eps"),
      py::arg("scale"), py::arg("norm_weight"), py::arg("z"), py::arg("ws"), py::arg("exact") = true,
      py::arg("partials") = false, py::arg("state_out") = py::none(),
      with_partials_doc(R"doc(A Gated DeltaNet decode / verify step after its conv, through its output's gated norm
and out projection (qwen35-target.md §6.5 steps 3-9): gdn_step(cv, a, b, dt, ssm_a, state, n_k_heads, head_k_dim,
n_v_heads, head_v_dim, eps, scale, state_out), then rms_norm_gated_matmul(o, norm_weight, eps, z, ws, exact)
on its output o [T, Hv, dv] (one eps for the q / k L2 norms and the output norm, as the model has).

Arguments as those two ops take them (z: F32 [T, Hv, dv]; norm_weight: F32 [dv] or None; ws: [out_i, Hv dv]).
Returns (ys, q, k, v, g, beta): the projections (a list of F32 [T, out_i]) and gdn_step's pending values; o is
not returned. Bit-identical to the composition on each backend. On CUDA (sm_90), where the tensor-core GEMV
reads the output (1 <= T <= 16, every weight Q8_0 / K-quant / IQ4_XS, dk 32 / 64 / 128, dv % 32 == 0 dividing
256, Hv dv % 256 == 0, 16-byte aligned z and norm_weight), the gdn_step launch itself norms and splits o for the
GEMV in clusters of 8 blocks (gdn_step_split_kernel): one launch fewer; otherwise the composition. Every argument
is checked before anything runs (a bad one leaves the state untouched): raises ValueError as those ops do.)doc")
          .c_str());

  m.def(
      "tile_for_gemv",
      [](const py::object& w, std::optional<Tensor> out) {
        Tensor wt = as_tensor(w, "tile_for_gemv", "w");
#if SPECD_WITH_GPU
        if (wt.device == Device::GPU) return without_gil([&] { return gpu::tile_for_gemv(wt, out); });
#endif
        (void)out;
        throw std::invalid_argument("tile_for_gemv: w must be a GPU tensor (the tiled layout is for the GPU GEMV)");
      },
      py::arg("w"), py::arg("out") = py::none(),
      R"doc(w regrouped for the CUDA tensor-core GEMV: IQ4_XS, Q4_K, Q5_K or Q6_K [out, in] on the GPU
(contiguous, out a multiple of 16) -> a new GPU tensor of dtype IQ4_XS_TILED, Q4_K_TILED, Q5_K_TILED or Q6_K_TILED,
same shape and size, rows in tiles of 16 whose quants sit in the MMA's lane order (every warp load of
quants covers 512 contiguous bytes: the row-major loads are 8 rows x 16 bytes, Q6_K's 2-byte words);
IQ4_XS_TILED also stores each 4-bit index with bits 2 and 3 swapped (a shorter table lookup in the
GEMV; the values are unchanged). matmul / matmul_group
give bit-identical results on either layout; every other op refuses the tiled dtypes (they are not
row-major). out: a contiguous GPU tensor of w's shape and the tiled dtype (e.g. a gpu_ipc_export
buffer) to write the tiles into instead (returned). Raises ValueError for another dtype, device or
shape (of w or out), or when the build has no tensor-core GEMV (see gemv_tiles_supported).)doc");

  m.def(
      "gemv_tiles_supported",
      [] {
#if SPECD_WITH_GPU
        return gpu::gemv_tiles_supported();
#else
        return false;
#endif
      },
      "True when this build's GPU matmul reads the tiled layouts (IQ4_XS_TILED, Q4_K_TILED, Q5_K_TILED, "
      "Q6_K_TILED; CUDA builds, "
      "not HIP, not CPU-only).");

  m.def(
      "embedding",
      [](const py::object& w, const py::object& ids, bool trusted) {
        Tensor wt = as_tensor(w, "embedding", "w"), it = as_tensor(ids, "embedding", "ids");
#if SPECD_WITH_GPU
        if (wt.device == Device::GPU) return without_gil([&] { return gpu::embedding(wt, it, trusted); });
#else
        (void)trusted;
#endif
        return without_gil([&] { return cpu::embedding(wt, it); });
      },
      py::arg("w"), py::arg("ids"), py::arg("trusted") = false,
      R"doc(Rows of a (possibly quantized) embedding table: y[i] = dequantize(w[ids[i]]).

w: [V, H] of any weight dtype (CPU, contiguous); ids: I32 [n] (an int32 numpy array or I32 Tensor),
every id in [0, V). Returns F32 [n, H], bit-identical to dequantize(w)[ids]. Raises ValueError
naming the first out-of-range id, or for ids of another dtype.
trusted (GPU only; the CPU op always checks, at no cost): the caller guarantees the values of GPU
ids, which are then not read back (no host synchronisation; needed inside a GPU graph capture). An
id outside [0, V) then yields a row of zeros (never an out-of-bounds read).)doc");
}

}  // namespace specd::py_bind
