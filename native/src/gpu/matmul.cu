// Matrix product y[n, out] = x[n, in] @ w[out, in]^T, F32 activations, F32 accumulation. n <= 16
// (decode / verify widths) runs a GEMV for every weight format (F32, F16, BF16, Q8_0, Q4_K, Q5_K,
// Q6_K, IQ4_XS); n > 16 exact = 16-row slices through the same GEMV; n > 16 inexact goes to the
// dequantize + vendor GEMM path (matmul_blas.cu).
//
// Two GEMVs. On CUDA the quantized formats (Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS and the tiled IQ4_XS_TILED,
// Q4_K_TILED, Q5_K_TILED, Q6_K_TILED) run the tensor-core
// GEMV of matmul_mma.cuh, and so do BF16 weights with in % 64 == 0 and 16-byte aligned rows (BF16U:
// x as three BF16 terms, bf16 MMAs with F32 accumulation); F32 / F16, other BF16 weights, and every
// format on HIP, run the FP32-FMA GEMV (gemv_fma.cuh).
// A weight always takes the same kernel at every width 1..16 (batch invariance, below).
//
// Tensor-core GEMV (matmul_mma.cuh; mma.sync m16n8k32 s8 x s8 -> s32, sm_80+):
// * Weights are decoded to their INTEGER quants as int8 (Q8_0 q; Q4_K 0..15; Q5_K 0..31; Q6_K q - 32
//   in -32..31; IQ4_XS the kvalues table, -127..113, looked up with byte permutes straight into the
//   MMA's A fragment). x is split once per call into three int8 terms per value (per row of x and
//   256-input group: x' = x * 2^k exact, |x'| < 2^20, x' ~ 2^14 hi + 2^7 mid + lo, |terms| <= 64,
//   |x - 2^-k (...)| <= 2^-20 max(max|x| over the group, 2^-100); a group holding inf / NaN gets NaN column scales,
//   so that row's results are non-finite, as on the CPU). Each term is a B column of its own (3 n
//   columns: ceil(3 n / 8) n8 tiles, one kernel instance per tile count).
// * Sums are exact integers: per 32-input sub-block one MMA per n8 tile (Q6_K: two, one per 16-input
//   scale group), then acc += scale_j * partial with the sub-block's INTEGER scale (IQ4_XS ls - 32,
//   Q4_K / Q5_K sc, Q6_K sc; |acc| < 2^27 over a super-block). Floats appear once per 256-input super-block:
//   accf = fma(d_row * colscale, float(acc), accf) (the product exact: the column scale is a power
//   of two), plus for Q4_K / Q5_K accf -= dmin_row * colscale * (m . term sums of the sub-blocks),
//   one f16 MMA of small integers (exact). Q8_0 (fp16 d per 32-block) adds per block. At the end the
//   three term columns of each row of x are summed (hi + mid) + lo. Error against the exact product:
//   <= 2^-20 sum_groups max(max|x_g|, 2^-100) * sum|w_g| + the F32 accumulation over super-blocks, inside the tests'
//   1e-5 * (|x| @ |w|^T) (H200 and host emulation ~1e-7, also for x spanning 2^-72 .. 2^72 with
//   elements 2^24 apart within a row; a group whose maximum meets zero weights while the other
//   elements carry the product could approach it: error relative to the GROUP maximum).
// * k order: in each sub-block lane t feeds the MMA's k = 4t..4t+3 with the inputs 4t, 4t+16, 4t+1,
//   4t+17 and k = 16+4t.. with 4t+2, 4t+18, 4t+3, 4t+19 (A and B alike): the order IQ4_XS's nibbles
//   come out of a word, so its quants need no reordering; the byte formats reorder with one permute.
// * Work: a block of 4 warps owns 64 output rows (each warp 16: lanes hold rows g, g + 8) and one split
//   of the reduction dimension (units of 256 inputs, Q8_0 32); each weight byte is read once per call;
//   the loads of the next units are in flight while a unit is computed (a ring of registers, as deep as each
//   instance's register budget allows, mma::units_ahead; the tiled instances without one ask L2 for their next
//   units instead, SPECD_MMA_L2_AHEAD). Splits depend only on (out, in, format, the device's multiprocessor
//   count), never on n or grouping (mma::units_per_split): for the tiled formats (and the row-major ones with a
//   tiled layout, which plan as it: mma::SplitTwin) the fewest splits of at most 2048 inputs whose blocks fill
//   the decode instance's resident slots to 0.8-1 wave or leave a last wave at least 0.4 full; else about 16
//   blocks per multiprocessor, at least 4 units each. Split partials go to a scratch buffer and are summed split 0
//   first by a second kernel or by the op reading the output (never atomics).
// * Batch invariance: a column's arithmetic (its terms and scale, the integer MMAs and IMADs, the
//   super-block float steps, the split walk and sum, the term sum) is the same in every instance and
//   depends on no other column; integer sums have no order. So row i of y is bit-identical whatever n
//   (1..16), and, with the 16-row slices, whatever n at all. BF16U's F32 MMA sums have an order, the
//   same for every column (each D element is its own dot product, added to its own accumulator in the
//   same k steps): checked bitwise on the GPU (test_gpu_matmul.py's batch-invariance tests).
// * Groups (matmul_group: several weights against one x, e.g. q / k / v): x is split once per
//   16-row slice and each format's weights run as ONE launch whose flat grid concatenates every
//   weight's (split, row block) blocks (two formats' groups may share one: mma::try_pair); each weight keeps
//   the split of its own shape, so its arithmetic, and hence every bit of its result, is that of a call of its own.
// * HIP: SPECD_MMA_GEMV is 0 there (no mma.sync); the FMA GEMV (gemv_fma.cuh) serves every format.
//
// FMA GEMV (F32 / F16, BF16 off the tensor cores; all formats on HIP): gemv_fma.cuh.
//
// Performance (H200, BENCHMARKS.md): the FMA GEMV streams F32 / F16 / BF16 weights at 0.9-1.0 of
// copy bandwidth at n = 1 but is bound by FP32 FMA issue and L1 traffic of x at n = 8-16 (time
// linear in n); the tensor-core GEMV streams the 27B's tiled IQ4_XS weights at n = 1 at 0.33-0.64 of copy by shape
// (a decode step's tiled IQ4_XS GEMVs together 0.71; the 248k-row output head 0.89-0.99), and costs more
// per byte as n grows (8 rows are 3 n8 tiles of x terms: 1.36x the one-tile time for tiled IQ4_XS)
// (tools/device/gemv_sweep.sh; BENCHMARKS.md's summary).
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "../cpu/activations.h"
#include "../cpu/norm.h"
#include "../cpu/ssm.h"
#include "activations.cuh"
#include "common.cuh"
#include "norm.cuh"
#include "op_util.cuh"
#include "partials.cuh"
#include "ops.h"
#include "specd/gpu.h"
#include "matmul_blas.h"
#include "weight_formats.cuh"
#include "gemv_fma.cuh"
#include "matmul_mma.cuh"
#include "norm_split.cuh"
#include "gdn_step_split.cuh"

namespace specd::gpu {

namespace {

using detail::fma_gemv::kNMax;

// Geometry of one launch: weights, activations in the policy's layout, output.
struct Problem {
  const uint8_t* w;
  int64_t row_bytes;
  const float* x;
  int64_t in;  // x's row length and stride, w's inputs
  float* y;
  int n;
  int64_t out;
};

template <class W, int NMAX, int R>
void launch_r(const Problem& p, cudaStream_t s) {
  int64_t blocks = (p.out + R - 1) / R;
  namespace fg = detail::fma_gemv;
  detail::launch_kernel<fg::gemv_kernel<W, NMAX, R>>("gemv_kernel", unsigned(blocks), fg::kThreads, 0, s, p.w, p.row_bytes,
                                                     fg::chunks_per_row<W>(p.in), p.x, p.in, p.y, p.n, p.out);
}

// Rows per block: more rows reuse each activation load for more weights (L1 traffic), fewer keep
// enough blocks (16 per multiprocessor) to fill the device for small `out`. The scalar F32
// fallback always uses one row per block.
template <class W, int NMAX>
void launch_n(const Problem& p, cudaStream_t s) {
  if constexpr (W::kElems > 1) {
    const int64_t target = int64_t(detail::sm_count()) * 16;
    if (p.out / 4 >= target) return launch_r<W, NMAX, 4>(p, s);
    if (p.out / 2 >= target) return launch_r<W, NMAX, 2>(p, s);
  }
  launch_r<W, NMAX, 1>(p, s);
}

template <class W>
void launch(const Problem& p) {
  cudaStream_t s = detail::stream();
  detail::fma_gemv::with_rows_instance(p.n, [&](auto rows) { launch_n<W, decltype(rows)::value>(p, s); });
}

// The GEMV for one weight format: the chunk policy from the dtype, the row length and the alignment (16-byte loads
// need 16-byte aligned rows).
void gemv(const Problem& p, DType t, bool w16) {
  const int64_t in = p.in;
  switch (t) {
    case DType::Q8_0: return launch<detail::Q8_0Quarter>(p);
    case DType::Q4_K: return launch<detail::Q4KW>(p);
    case DType::Q5_K: return launch<detail::Q5KW>(p);
    case DType::Q6_K: return launch<detail::Q6KW>(p);
    case DType::IQ4_XS: return launch<detail::IQ4XSW>(p);
    case DType::F32: return in % 4 == 0 && w16 ? launch<detail::F32W<4>>(p) : launch<detail::F32W<1>>(p);
    case DType::F16:
      return in % 8 == 0 && w16 ? launch<detail::Half16W<8, false>>(p) : launch<detail::Half16W<1, false>>(p);
    case DType::BF16:
      return in % 8 == 0 && w16 ? launch<detail::Half16W<8, true>>(p) : launch<detail::Half16W<1, true>>(p);
    default: fail("matmul: no GPU kernel for ", dtype_info(t).name);
  }
}

// Validates w for the GPU matmul (std::invalid_argument naming op and argument).
void check_weight(const Tensor& w, int64_t in, const char* op) {
  const DType t = w.dtype;
  SPECD_CHECK(t == DType::Q8_0 || t == DType::F32 || t == DType::F16 || t == DType::BF16 || t == DType::Q4_K ||
                  t == DType::Q5_K || t == DType::Q6_K || t == DType::IQ4_XS || (is_gemv_tiled(t) && SPECD_MMA_GEMV),
              op, ": w must be F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS or (CUDA) a tiled layout (IQ4_XS_TILED, "
              "Q4_K_TILED, Q5_K_TILED, Q6_K_TILED) on the GPU, got ", dtype_info(t).name);
  if (is_gemv_tiled(t))
    SPECD_CHECK(w.dim(0) % kGemvTileRows == 0, op, ": a ", dtype_info(t).name, " weight has a multiple of ",
                kGemvTileRows, " rows, got ", w.dim(0));
  const int64_t bs = dtype_info(t).block_size;
  SPECD_CHECK(in % bs == 0, op, ": w has ", in, " columns, not a multiple of the ", dtype_info(t).name,
              " block size ", bs);
  // Block loads: Q4_K/Q5_K and the tiled layouts read 16-byte words, IQ4_XS 8-byte, Q6_K/Q8_0/16-bit 2-byte.
  const auto addr = reinterpret_cast<uintptr_t>(w.data);
  const uintptr_t need = (t == DType::Q4_K || t == DType::Q5_K || is_gemv_tiled(t)) ? 16
                         : t == DType::IQ4_XS                                           ? 8
                         : t == DType::F32                                              ? 4
                                                                                        : 2;
  SPECD_CHECK(addr % need == 0, op, ": w data must be ", need, "-byte aligned for ", dtype_info(t).name);
}

}  // namespace

namespace {

// Checks weights ws[i] [out_i, in] of a product with `in` inputs (GPU, 2-D, contiguous, a GEMV format
// of `in`, rows for one launch); `op` names the caller in errors, weights are "w" (one) or "ws[i]" with i,
// the input `x_name`. The fused ops call it before their first launch, so a bad weight queues nothing.
void check_weights(int64_t in, const std::vector<Tensor>& ws, const char* op, const char* x_name = "x") {
  SPECD_CHECK(!ws.empty(), op, ": no weights");
  for (size_t i = 0; i < ws.size(); ++i) {
    const Tensor& w = ws[i];
    const char* name = ws.size() == 1 ? "w" : "ws[i]";  // no string built per call: i is in the messages
    detail::check_gpu(w, op, name);
    check_ndim(w, 2, op, name);
    check_contiguous(w, op, name);
    SPECD_CHECK(w.dim(1) == in, op, ": ", x_name, " has ", in, " columns, ", name, " (i = ", i, ") has ", w.dim(1),
                " (it is [out, in])");
    check_weight(w, in, op);
    SPECD_CHECK(w.dim(0) <= 0x7fffffff, op, ": ", name, " (i = ", i, ") has too many rows for one launch");
  }
}

// The split-K partials each output of x [n, in] @ ws[i]^T is handed over as when the caller asks for
// partials: the integer tensor-core GEMV's splits (mma::gemv_splits) when it computes that output in one
// slice (1 <= n <= 16, an integer tensor-core format: mma::handles), else 1 (the output itself; BF16 weights
// on the tensor cores too). Empty without `partials`.
std::vector<int64_t> partial_counts(int64_t n, int64_t in, const std::vector<Tensor>& ws, bool partials) {
  std::vector<int64_t> counts;
  if (!partials) return counts;
  for (const Tensor& w : ws) {
    int64_t c = 1;
#if SPECD_MMA_GEMV
    if (n >= 1 && n <= kNMax && in > 0 && w.dim(0) > 0 && detail::mma::handles(w.dtype))
      c = detail::mma::gemv_splits(w.dtype, w.dim(0), in);
#else
    (void)n, (void)in;
#endif
    counts.push_back(c);
  }
  return counts;
}

// The outputs [..., out_i] of x [..., in] @ ws[i]^T on the GPU after checking the weights against
// x's shape (check_weights; x itself is checked by the caller); with `partials`, each as its split-K
// partials [partial_counts_i, ..., out_i].
std::vector<Tensor> linear_outputs(const Tensor& x, const std::vector<Tensor>& ws, const char* op,
                                   bool partials = false) {
  check_weights(x.cols(), ws, op);
  const std::vector<int64_t> counts = partial_counts(x.rows(), x.cols(), ws, partials);
  std::vector<Tensor> ys;
  for (size_t i = 0; i < ws.size(); ++i) {
    std::vector<int64_t> shape = x.shape;
    shape.back() = ws[i].dim(0);
    if (partials) shape.insert(shape.begin(), counts[i]);
    ys.push_back(Tensor::empty(shape, DType::F32, Device::GPU));
  }
  return ys;
}

// The split-K partials output y of x (n rows) holds for the GEMV to write as they are (GroupWeight::partials),
// 0 when y is the output itself: no leading axis, or one part (partial_counts' 1: its layout is the output's, which
// a GEMV of several splits, e.g. of a call in slices of 16 rows, sums into).
int64_t kept_partials(const Tensor& y, const Tensor& x) {
  return y.ndim() == x.ndim() + 1 && y.dim(0) > 1 ? y.dim(0) : 0;
}

// matmul / matmul_group; `op` names the caller in errors; `partials`: the outputs as linear_outputs gives them.
std::vector<Tensor> linear(const Tensor& x, const std::vector<Tensor>& ws, bool exact, const char* op,
                           bool partials = false) {
  detail::check_gpu(x, op, "x");
  check_dtype(x, DType::F32, op, "x");
  check_contiguous(x, op, "x");
  SPECD_CHECK(x.ndim() >= 1, op, ": x must have at least 1 dimension");
  SPECD_CHECK(detail::aligned16(x.data), op, ": x data must be 16-byte aligned");
  std::vector<Tensor> ys = linear_outputs(x, ws, op, partials);
  const int64_t n = x.rows(), in = x.cols();
  if (n == 0) return ys;
  if (in == 0) {
    for (Tensor& y : ys)
      if (y.nbytes() > 0) memset_zero(y.data, size_t(y.nbytes()));
    return ys;
  }
  // Wide inexact calls (prefill) go to the vendor GEMM on dequantized weights: the GEMV would
  // re-read the weights once per 16 rows and runs on FP32 FMAs only.
  if (n > kNMax && !exact) {
    detail::matmul_blas(x, ws, ys);
    return ys;
  }
  // Exact: slices of at most kNMax rows through the GEMV, each row's arithmetic independent of
  // the slice it lands in (and of the other weights of the call). Every slice starts 16 * in floats
  // (64 * in bytes) after x.data, which is 16-byte aligned (checked above), so every slice is too.
  for (int64_t r0 = 0; r0 < n; r0 += kNMax) {
    const int rows = int(std::min<int64_t>(kNMax, n - r0));
    const float* xs = x.ptr<float>() + r0 * in;
#if SPECD_MMA_GEMV
    std::vector<detail::mma::Weight> mma;   // the integer tensor-core formats, split x shared, grouped launches
    std::vector<detail::mma::Weight> bf16;  // BF16 weights on the tensor cores (their own x split)
#endif
    for (size_t i = 0; i < ws.size(); ++i) {
      const Tensor& w = ws[i];
      const int64_t out = w.dim(0);
      if (out == 0) continue;
      float* y = ys[i].ptr<float>() + r0 * out;
#if SPECD_MMA_GEMV
      if (detail::mma::handles(w.dtype)) {  // partials (one slice only) go straight to ys[i]
        mma.push_back({{static_cast<const uint8_t*>(w.data), w.row_bytes(), out, y, kept_partials(ys[i], x)}, w.dtype});
        continue;
      }
      if (w.dtype == DType::BF16 && detail::mma::bf16_on_tensor_cores(w.data, in)) {
        bf16.push_back({{static_cast<const uint8_t*>(w.data), w.row_bytes(), out, y}, w.dtype});
        continue;
      }
#endif
      gemv(Problem{static_cast<const uint8_t*>(w.data), w.row_bytes(), xs, in, y, rows, out}, w.dtype,
           detail::aligned16(w.data));
    }
#if SPECD_MMA_GEMV
    if (!mma.empty()) detail::mma::gemv(mma.data(), int(mma.size()), in, xs, rows);
    if (!bf16.empty()) detail::mma::gemv_bf16(bf16.data(), int(bf16.size()), in, xs, rows);
#endif
  }
  return ys;
}

// The value at offset off of [n, in] of swiglu(g, u) (the swiglu op's device code), g and u each given as
// `splits` split-K partials of `count` floats (partials.cuh; 1: g and u themselves).
struct SwigluValue {
  const float* __restrict__ g;
  const float* __restrict__ u;
  int splits;
  int64_t count;
  __device__ __forceinline__ float operator()(int64_t off) const {
    return detail::apply<detail::Op::Swiglu>(detail::fold_partials(g, splits, count, off),
                                             detail::fold_partials(u, splits, count, off));
  }
};

// y = the in-order sum of partials p (partials.cuh): one thread per element.
__global__ void sum_partials_kernel(const float* __restrict__ p, int splits, int64_t count, float* __restrict__ y) {
  detail::pdl_enter();
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j < count) y[j] = detail::fold_partials(p, splits, count, j);
}

// ... of a * sigmoid(gate) (mul_sigmoid's device code), a contiguous, gate's rows of d at a pitch of `pitch` floats.
struct MulSigmoidValue {
  const float* __restrict__ a;
  const float* __restrict__ gate;
  int64_t d, pitch;
  __device__ __forceinline__ float operator()(int64_t off) const {
    return detail::mul_sigmoid_at(a, gate, off, d, pitch);
  }
};

#if SPECD_MMA_GEMV
// --- the GEMV's x split fused into the op that produces x (one launch fewer per call) -------------

// An elementwise op's output (F32 [n, in], in % 32 == 0 as every tensor-core format has; `value` its element at
// an offset) split for the GEMV into xb / xs / xm (the XSizes(in) layout): n * groups blocks of kGroup threads,
// one per (row r, 256-input group). A thread computes one input's value with the op's device code
// (activations.cuh: in double precision, hence one value per thread), then warp 0 splits the group from shared
// memory (split_group: the same terms as split_x of the op's output). H200, 27B decode step profile (SwiGLU): 64
// calls 134 us, against 296 us when the split's own warp computed 8 values per lane (BENCHMARKS.md).
template <class Value>
__global__ void __launch_bounds__(detail::mma::kGroup) elementwise_split_kernel(const Value value, int64_t in, int n,
                                                                                int64_t groups, uint2* __restrict__ xb,
                                                                                float* __restrict__ xs,
                                                                                uint32_t* __restrict__ xm) {
  detail::pdl_enter();
  __shared__ __align__(16) float v[detail::mma::kGroup];
  const int r = int(blockIdx.x / groups);
  const int64_t grp = blockIdx.x % groups, i = grp * detail::mma::kGroup + threadIdx.x;
  v[threadIdx.x] = i < in ? value(int64_t(r) * in + i) : 0.0f;
  __syncthreads();
  if (threadIdx.x < 32)
    detail::mma::split_group(detail::SharedGroupInput{v, grp}, r, n, grp, in, int(threadIdx.x), xb, xs, xm);
}

#endif

// Whether the projections of x [n, in] (n = rows) by ws run on the tensor-core GEMV with x split
// once by the op producing x: 1 <= n <= 16 (one GEMV slice, exact or not) and every weight in a
// tensor-core format, with 16-byte aligned rows of `in` floats (in % 4 == 0, base pointers checked by the caller).
bool split_fusable(int64_t n, int64_t in, const std::vector<Tensor>& ws) {
  if (!SPECD_MMA_GEMV || n < 1 || n > kNMax || in == 0 || in % 4 != 0) return false;
#if SPECD_MMA_GEMV
  for (const Tensor& w : ws)
    if (!detail::mma::handles(w.dtype)) return false;
#endif
  return true;
}

#if SPECD_MMA_GEMV
// The tensor-core GEMV of ws (split_fusable) into ys (linear_outputs of x) on x split at xsplit (its n rows of `in`).
void gemv_on_split(const std::vector<Tensor>& ws, std::vector<Tensor>& ys, const Tensor& x, const void* xsplit, int n) {
  const int64_t in = x.cols();
  std::vector<detail::mma::Weight> mma;
  for (size_t i = 0; i < ws.size(); ++i)
    if (ws[i].dim(0) > 0)
      mma.push_back({{static_cast<const uint8_t*>(ws[i].data), ws[i].row_bytes(), ws[i].dim(0), ys[i].ptr<float>(),
                      kept_partials(ys[i], x)},
                     ws[i].dtype});
  if (!mma.empty())
    detail::mma::gemv_split(mma.data(), int(mma.size()), in,
                            detail::mma::x_view(static_cast<const uint8_t*>(xsplit), in, n), n);
}
#endif

// ws (split_fusable for n rows of `in`) against x split by a fused op's kernel: launch_split(parts, groups)
// queues that kernel, which writes the XSizes(in) layout at `parts` (groups 256-input groups per row), then
// the GEMV. x: a tensor of the split values' shape (x.rows() == n, x.cols() == in), which shapes the outputs.
// `partials`: the outputs as linear_outputs gives them.
template <class LaunchSplit>
std::vector<Tensor> split_matmul(const Tensor& x, const std::vector<Tensor>& ws, const char* op, bool partials,
                                 const LaunchSplit& launch_split) {
  std::vector<Tensor> ys = linear_outputs(x, ws, op, partials);
#if SPECD_MMA_GEMV
  namespace mma = detail::mma;
  const int64_t in = x.cols();
  const mma::XSizes sz(in);
  std::shared_ptr<void> xsplit = alloc(sz.total());  // freed stream-ordered
  launch_split(sz.at(static_cast<uint8_t*>(xsplit.get())), (in + mma::kGroup - 1) / mma::kGroup);
  gemv_on_split(ws, ys, x, xsplit.get(), int(x.rows()));
#else
  (void)launch_split;
#endif
  return ys;
}

// split_matmul of an elementwise op's output (its element at an offset of [n, in]: SwigluValue,
// MulSigmoidValue), split by elementwise_split_kernel: one launch fewer than the op, then the GEMV.
template <class Value>
std::vector<Tensor> elementwise_matmul(const Value& value, const Tensor& x, const std::vector<Tensor>& ws,
                                       const char* op, bool partials) {
  return split_matmul(x, ws, op, partials, [&](const auto& xp, int64_t groups) {
#if SPECD_MMA_GEMV
    const int64_t n = x.rows(), in = x.cols();
    detail::launch_kernel<elementwise_split_kernel<Value>>("elementwise_split_kernel", unsigned(n * groups),
                                                           detail::mma::kGroup, 0, detail::stream(), value, in, int(n),
                                                           groups, xp.xb, xp.xs, xp.xm);
#else
    (void)xp, (void)groups, (void)value;
#endif
  });
}

}  // namespace

std::vector<Tensor> matmul_group(const Tensor& x, const std::vector<Tensor>& ws, bool exact) {
  return linear(x, ws, exact, "matmul_group");
}

Tensor matmul(const Tensor& x, const Tensor& w, bool exact) { return std::move(linear(x, {w}, exact, "matmul")[0]); }

// Whether norm_split_partials_kernel serves rows of d on this build and device: a cluster shape for d
// (norm_cluster_blocks), sm_90 code, and a device that can run at least one such cluster (asked once per
// cluster size and process: a small MIG instance may not). Both instances are one binary, so asking of one
// answers for both.
bool norm_reads_partials(int64_t d) {
#if SPECD_MMA_GEMV
  constexpr auto kernel = detail::norm_split_partials_kernel<true>;
  const int blocks = detail::norm_cluster_blocks(d);
  if (blocks == 0 || !detail::sm90_binary<kernel>("norm_split_partials_kernel")) return false;
  static std::once_flag once[detail::kMaxClusterBlocks + 1];
  static bool runs[detail::kMaxClusterBlocks + 1];
  std::call_once(once[blocks], [blocks] {  // the most shared memory a launch asks
    runs[blocks] = detail::cluster_fits<kernel>(unsigned(blocks), unsigned(detail::kClusterThreads),
                                                detail::kMaxClusterStage + detail::kClusterSumsBytes);
  });
  return runs[blocks];
#else
  (void)d;
  return false;
#endif
}

Tensor sum_partials(const Tensor& p) {
  cpu::check_partials(p, Device::GPU, "sum_partials", "p");
  if (p.dim(0) == 1) return cpu::first_part(p);  // the value itself: a view
  Tensor y = Tensor::empty(cpu::first_part(p).shape, DType::F32, Device::GPU);
  const int64_t count = y.numel();
  if (count > 0)
    detail::launch_kernel<sum_partials_kernel>("sum_partials_kernel", unsigned((count + 255) / 256), 256, 0,
                                               detail::stream(), p.ptr<float>(), int(p.dim(0)), count, y.ptr<float>());
  return y;
}

namespace {

#if SPECD_MMA_GEMV
// The one-block norm fused with the GEMV's x split (norm_split_kernel) on x itself.
void launch_norm_split(const Tensor& x, const float* r, const float* w, float* hp, int64_t d, float eps, int n,
                       const detail::mma::XSizes::Parts& xp) {
  const bool staged = d <= detail::kMaxStagedFloats;
  const size_t smem = staged ? size_t(d) * sizeof(float) : 0;
  const unsigned threads = unsigned(detail::norm::threads_for(d / 4));
  auto launch = [&](auto resid, auto stage) {
    constexpr auto kernel = detail::norm_split_kernel<decltype(resid)::value, decltype(stage)::value>;
    detail::launch_kernel<kernel>("norm_split_kernel", unsigned(n), threads, smem, detail::stream(), x.ptr<float>(),
                                  r, w, hp, d, eps, n, xp.xb, xp.xs, xp.xm);
  };
  using yes = std::true_type;
  using no = std::false_type;
  if (r)
    staged ? launch(yes(), yes()) : launch(yes(), no());
  else
    staged ? launch(no(), yes()) : launch(no(), no());
}

// The cluster norm fused with the GEMV's x split (norm_split_partials_kernel, norm_reads_partials(d)) on x given
// as split-K partials p [S, n, d]; h [n, d] always written.
void launch_norm_split_partials(const Tensor& p, const float* r, const float* w, float* hp, int64_t d, float eps,
                                int n, const detail::mma::XSizes::Parts& xp) {
  const int blocks = detail::norm_cluster_blocks(d);
  const size_t smem = detail::cluster_smem_bytes(d, int64_t(blocks) * detail::kClusterThreads);
  auto launch = [&](auto resid) {
    constexpr auto kernel = detail::norm_split_partials_kernel<decltype(resid)::value>;
    detail::launch_kernel_clustered<kernel>("norm_split_partials_kernel", unsigned(n * blocks),
                                            unsigned(detail::kClusterThreads), unsigned(blocks), smem,
                                            detail::stream(), p.ptr<float>(), int(p.dim(0)), r, w, hp, d, eps, n,
                                            xp.xb, xp.xs, xp.xm);
  };
  r ? launch(std::true_type()) : launch(std::false_type());
}
#endif

}  // namespace

std::pair<std::vector<Tensor>, Tensor> rms_norm_matmul(const Tensor& x_in, const std::optional<Tensor>& weight,
                                                       float eps, const std::vector<Tensor>& ws,
                                                       const std::optional<Tensor>& residual, bool exact,
                                                       bool partials, bool in_partials) {
  const char* op = "rms_norm_matmul";
  // x: the norm's input (part 0 of it when given as several partials: its shape and alignment are theirs)
  if (in_partials) cpu::check_partials(x_in, Device::GPU, op, "x");
  const bool several = in_partials && x_in.dim(0) > 1;
  const Tensor x = in_partials ? cpu::first_part(x_in) : x_in;
  cpu::check_rms_args(x, weight, eps, Device::GPU, op);
  if (residual) cpu::check_like_x(*residual, x, Device::GPU, op, "residual");
  const int64_t n = x.rows(), d = x.cols();
  const bool aligned = detail::aligned16(x.data) && (!weight || detail::aligned16(weight->data)) &&
                       (!residual || detail::aligned16(residual->data));
  const bool fused = aligned && split_fusable(n, d, ws) && (!several || norm_reads_partials(d));
  if (!fused) {  // the composition: same results, one launch more (two with partials to sum)
    auto [y, h] = rms_norm(several ? sum_partials(x_in) : x, weight, eps, residual);
    return {linear(y, ws, exact, op, partials), h};
  }
  std::vector<Tensor> ys = linear_outputs(x, ws, op, partials);
  Tensor h = residual || several ? Tensor::empty(x.shape, DType::F32, Device::GPU) : x;
#if SPECD_MMA_GEMV
  namespace mma = detail::mma;
  const mma::XSizes sz(d);
  std::shared_ptr<void> xsplit = alloc(sz.total());  // freed stream-ordered
  auto* base = static_cast<uint8_t*>(xsplit.get());
  const float* w = weight ? weight->ptr<float>() : nullptr;
  const float* r = residual ? residual->ptr<float>() : nullptr;
  if (several)
    launch_norm_split_partials(x_in, r, w, h.ptr<float>(), d, eps, int(n), sz.at(base));
  else
    launch_norm_split(x, r, w, residual ? h.ptr<float>() : nullptr, d, eps, int(n), sz.at(base));
  gemv_on_split(ws, ys, x, base, int(n));
#endif
  return {ys, h};
}

std::vector<Tensor> swiglu_matmul(const Tensor& gate_in, const Tensor& up_in, const std::vector<Tensor>& ws,
                                  bool exact, bool partials, bool in_partials) {
  const char* op = "swiglu_matmul";
  detail::check_gpu_tensor(gate_in, DType::F32, -1, op, "gate");
  detail::check_gpu_tensor(up_in, DType::F32, -1, op, "up");
  SPECD_CHECK(gate_in.shape == up_in.shape, op, ": gate and up must have the same shape");
  SPECD_CHECK(gate_in.ndim() >= 1, op, ": gate must have at least 1 dimension");
  // gate, up: the activations (part 0 of them when several partials: their shape)
  if (in_partials) cpu::check_partials(gate_in, Device::GPU, op, "gate"), cpu::check_partials(up_in, Device::GPU, op, "up");
  const bool several = in_partials && gate_in.dim(0) > 1;  // (up's too: the same shape)
  const Tensor gate = in_partials ? cpu::first_part(gate_in) : gate_in;
  const Tensor up = in_partials ? cpu::first_part(up_in) : up_in;
  const int64_t n = gate.rows(), in = gate.cols();
  check_weights(in, ws, op, "gate");
  if (several && !split_fusable(n, in, ws))  // the composition reads the sums
    return swiglu_matmul(sum_partials(gate_in), sum_partials(up_in), ws, exact, partials, false);
  if (n > kNMax && !exact && in > 0) {  // prefill: as linear's BLAS path
    std::vector<Tensor> ys = linear_outputs(gate, ws, op, partials);
    detail::matmul_blas_swiglu(gate, up, ws, ys);  // swiglu (F32) fused into x's BF16 rounding
    return ys;
  }
  if (!split_fusable(n, in, ws))  // (gate / up are read a float at a time: any alignment)
    return linear(swiglu(gate, up), ws, exact, op, partials);  // the composition: same results, one launch more
  const int splits = int(in_partials ? gate_in.dim(0) : 1);  // (at most 65536: check_partials)
  return elementwise_matmul(SwigluValue{gate.ptr<float>(), up.ptr<float>(), splits, gate.numel()}, gate, ws, op,
                            partials);
}

std::vector<Tensor> mul_sigmoid_matmul(const Tensor& a, const Tensor& gate, const std::vector<Tensor>& ws, bool exact,
                                       bool partials) {
  const char* op = "mul_sigmoid_matmul";
  const int64_t pitch = detail::check_mul_sigmoid(a, gate, op);
  SPECD_CHECK(a.ndim() >= 2, op, ": a must be [n, ..., d], got ", a.ndim(), " dimension(s)");
  const int64_t n = a.dim(0);
  int64_t in = 1;  // a's elements per row of n
  for (size_t k = 1; k < a.shape.size(); ++k) in *= a.shape[k];
  const Tensor a2 = a.reshape({n, in});
  check_weights(in, ws, op, "a");
  if (!split_fusable(n, in, ws))  // the composition (prefill: mul_sigmoid, then the BF16 GEMM)
    return linear(mul_sigmoid(a, gate).reshape({n, in}), ws, exact, op, partials);
  return elementwise_matmul(MulSigmoidValue{a.ptr<float>(), gate.ptr<float>(), a.cols(), pitch}, a2, ws, op,
                            partials);
}

std::vector<Tensor> rms_norm_gated_matmul(const Tensor& x, const std::optional<Tensor>& weight, float eps,
                                          const Tensor& z, const std::vector<Tensor>& ws, bool exact, bool partials) {
  const char* op = "rms_norm_gated_matmul";
  cpu::check_rms_args(x, weight, eps, Device::GPU, op);
  cpu::check_like_x(z, x, Device::GPU, op, "z");
  SPECD_CHECK(x.ndim() == 3, op, ": x must be [n, groups, d], got ", x.ndim(), " dimensions");
  const int64_t n = x.dim(0), d = x.dim(2), in = x.dim(1) * d;
  check_weights(in, ws, op);
  // the fused kernel's warp_norm_row must replay rms_norm_gated's vector path: d % 4 == 0, 16-byte aligned
  const bool aligned = detail::aligned16(x.data) && detail::aligned16(z.data) &&
                       (!weight || detail::aligned16(weight->data));
  if (!aligned || d % 4 != 0 || d == 0 || 256 % d != 0 || !split_fusable(n, in, ws))  // the composition
    return linear(rms_norm_gated(x, weight, eps, z).reshape({n, in}), ws, exact, op, partials);
  return split_matmul(x.reshape({n, in}), ws, op, partials, [&](const auto& xp, int64_t groups) {
#if SPECD_MMA_GEMV
    const detail::GatedSplit S{z.ptr<float>(), weight ? weight->ptr<float>() : nullptr, eps, in, xp.xb, xp.xs, xp.xm};
    detail::launch_kernel<detail::gated_norm_split_kernel>("gated_norm_split_kernel", unsigned(n * groups),
                                                           unsigned(detail::gated_norm_split_warps(d) * SPECD_WARP), 0,
                                                           detail::stream(), x.ptr<float>(), d, int(n), groups, S);
#else
    (void)xp, (void)groups;
#endif
  });
}

#if SPECD_MMA_GEMV
namespace {

// Whether this build and device run gdn_step_split_kernel<E, L>: sm_90 code, and at least one cluster of
// kGdnSplitCluster blocks fits the device (asked once per instance and process: a small MIG instance may not).
template <int E, int L>
bool gdn_split_runs() {
  namespace gs = detail::gdn_step;
  constexpr auto kernel = gs::gdn_step_split_kernel<E, L>;
  if (!detail::sm90_binary<kernel>("gdn_step_split_kernel")) return false;
  static const bool runs = detail::cluster_fits<kernel>(unsigned(gs::kGdnSplitCluster), unsigned(gs::kGdnRows * L),
                                                        gs::gdn_split_smem<E * L>());
  return runs;
}

}  // namespace
#endif

std::tuple<std::vector<Tensor>, Tensor, Tensor, Tensor, Tensor, Tensor> gdn_step_gated_matmul(
    const Tensor& cv, const Tensor& a, const Tensor& b, const Tensor& dt, const Tensor& ssm_a, const Tensor& state,
    int64_t n_k_heads, int64_t head_k_dim, int64_t n_v_heads, int64_t head_v_dim, float eps, float scale,
    const std::optional<Tensor>& state_out, const std::optional<Tensor>& norm_weight, const Tensor& z,
    const std::vector<Tensor>& ws, bool exact, bool partials) {
  const char* op = "gdn_step_gated_matmul";
  const int64_t hk = n_k_heads, dk = head_k_dim, hv = n_v_heads, dv = head_v_dim;
  const Tensor& out_state = cpu::check_gdn_step_args(cv, a, b, dt, ssm_a, state, state_out, hk, dk, hv, dv, eps, scale,
                                                     Device::GPU);
  const int64_t T = cv.dim(0), in = hv * dv;
  // the output norm's and the projection's arguments, before anything runs
  cpu::check_gdn_output_norm_args(z, norm_weight, out_state, T, hv, dv, Device::GPU, op);
  check_weights(in, ws, op, "the step's output o");
  namespace gs = detail::gdn_step;
#if SPECD_MMA_GEMV
  // one cluster of 8 blocks of kGdnRows state rows per 256-input split group (hence 256 % dv == 0, whole groups)
  const bool fused = gs::gdn_register_kernel(dk, dv) && gs::gdn_block_rows(dv) == gs::kGdnRows &&
                     detail::mma::kGroup % dv == 0 && in % detail::mma::kGroup == 0 && detail::aligned16(z.data) &&
                     (!norm_weight || detail::aligned16(norm_weight->data)) && split_fusable(T, in, ws) &&
                     gs::with_gdn_instance(dk, [](auto e, auto l) {
                       return gdn_split_runs<decltype(e)::value, decltype(l)::value>();
                     });
#else
  const bool fused = false;
#endif
  if (!fused) {  // the composition
    auto [o2, q, k, v, g, beta] = gdn_step(cv, a, b, dt, ssm_a, state, hk, dk, hv, dv, eps, scale, state_out);
    return {rms_norm_gated_matmul(o2, norm_weight, eps, z, ws, exact, partials), q, k, v, g, beta};
  }
  const auto empty = [](std::vector<int64_t> shape) { return Tensor::empty(shape, DType::F32, Device::GPU); };
  Tensor o = empty({T, hv, dv}), q = empty({T, hk, dk}), k = empty({T, hk, dk}), v = empty({T, hv, dv}),
         g = empty({T, hv}), beta = empty({T, hv});
  SPECD_CHECK(in / gs::kGdnRows <= 0x7fffffff, op, ": at most 2^31 - 1 blocks");
  const gs::GdnStepParams P{cv.ptr<float>(), a.ptr<float>(), b.ptr<float>(), dt.ptr<float>(), ssm_a.ptr<float>(),
                            state.ptr<float>(), out_state.ptr<float>(), o.ptr<float>(), q.ptr<float>(), k.ptr<float>(),
                            v.ptr<float>(), g.ptr<float>(), beta.ptr<float>(), T, int(hk), int(hv), int(dv), eps,
                            scale};
  std::vector<Tensor> ys = split_matmul(o.reshape({T, in}), ws, op, partials, [&](const auto& xp, int64_t) {
#if SPECD_MMA_GEMV
    const detail::GatedSplit S{z.ptr<float>(), norm_weight ? norm_weight->ptr<float>() : nullptr, eps, in,
                               xp.xb, xp.xs, xp.xm};
    gs::with_gdn_instance(dk, [&](auto e, auto l) {
      constexpr int E = decltype(e)::value, L = decltype(l)::value;
      detail::launch_kernel_clustered<gs::gdn_step_split_kernel<E, L>>(
          "gdn_step_split_kernel", unsigned(in / gs::kGdnRows), unsigned(gs::kGdnRows * L),
          unsigned(gs::kGdnSplitCluster), gs::gdn_split_smem<E * L>(), detail::stream(), P, S);
    });
#else
    (void)xp;
#endif
  });
  return {ys, q, k, v, g, beta};
}

bool gemv_tiles_supported() { return SPECD_MMA_GEMV != 0; }

Tensor tile_for_gemv(const Tensor& w, const std::optional<Tensor>& out_t) {
  const char* op = "tile_for_gemv";
  detail::check_gpu(w, op, "w");
  SPECD_CHECK(tiled_of(w.dtype) != w.dtype, op, ": w must be IQ4_XS, Q4_K, Q5_K or Q6_K, got ",
              dtype_info(w.dtype).name);
  check_ndim(w, 2, op, "w");
  check_contiguous(w, op, "w");
  SPECD_CHECK(gemv_tiles_supported(), op, ": the tiled layout is read by the CUDA tensor-core GEMV only (this is a ",
              backend(), " build)");
  const int64_t out = w.dim(0), in = w.dim(1);
  SPECD_CHECK(out % kGemvTileRows == 0, op, ": w has ", out, " rows, not a multiple of ", kGemvTileRows);
  const bool q6 = w.dtype == DType::Q6_K;
  SPECD_CHECK(reinterpret_cast<uintptr_t>(w.data) % (q6 ? 2 : 4) == 0, op, ": w data must be ", q6 ? 2 : 4,
              "-byte aligned (the kernel's loads)");
  if (out_t) {  // a tiled dtype: never w's (row-major) buffer or a view of it
    detail::check_gpu(*out_t, op, "out");
    check_contiguous(*out_t, op, "out");
    check_writable(*out_t, op, "out");
    const auto dims = [](const std::vector<int64_t>& s) {
      std::string r = "[";
      for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
      return r + "]";
    };
    SPECD_CHECK(out_t->dtype == tiled_of(w.dtype) && out_t->shape == w.shape, op, ": out must be ",
                dtype_info(tiled_of(w.dtype)).name, " ", dims(w.shape), " (w's shape), got ",
                dtype_info(out_t->dtype).name, " ", dims(out_t->shape));
  }
  Tensor y = out_t ? *out_t : Tensor::empty(w.shape, tiled_of(w.dtype), Device::GPU);
#if SPECD_MMA_GEMV
  const auto* src = static_cast<const uint8_t*>(w.data);
  auto* dst = static_cast<uint8_t*>(y.data);
  if (q6)
    detail::mma::launch_tile_q6_k(src, out, in, dst, detail::stream());
  else if (w.dtype == DType::Q4_K)
    detail::mma::launch_tile_q4_k(src, out, in, dst, detail::stream());
  else if (w.dtype == DType::Q5_K)
    detail::mma::launch_tile_q5_k(src, out, in, dst, detail::stream());
  else
    detail::mma::launch_tile_iq4_xs(src, out, in, dst, detail::stream());
#else
  (void)in;
#endif
  return y;
}

}  // namespace specd::gpu
