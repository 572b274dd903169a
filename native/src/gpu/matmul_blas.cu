// Wide matmul (n > 16 rows of x): dequantize the weight to BF16 on the device, round x to BF16, and
// let the vendor GEMM (cuBLAS; hipBLAS through portability.h) multiply on tensor cores with F32
// accumulation and F32 output.
//
// Why BF16: it is the fastest tensor-core input type that keeps F32's exponent range (activations
// of large models exceed F16's 65504), and every GGUF format specd reads decodes to values whose
// BF16 rounding is within 2^-9 relative. Each product then carries at most ~2^-8 relative error,
// so |y - y_exact| <= ~2^-8 * (|x| @ |w|^T) elementwise (F32 accumulation adds far less).
//
// BF16 weights (16-byte aligned, rows a multiple of 8) go to the GEMM as they are, with no copy.
//
// Memory: the dequantized weight is produced panel by panel (whole 16-row tiles, at most kPanelBytes of
// BF16 per panel unless one tile of rows is more)
// into one scratch buffer from the device pool (stream-ordered, cached by the pool between calls),
// so the output head (248320 x 5120) needs 256 MiB, not 2.5 GB. Panels are multiplied as they are
// produced; all work is on the library stream.
#define SPECD_GPU_BLAS 1
#include <algorithm>
#include <climits>
#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>

#include "activations.cuh"
#include "common.cuh"
#include "matmul_blas.h"
#include "specd/gpu.h"
#include "weight_formats.cuh"

namespace specd::gpu::detail {

namespace {

constexpr int64_t kPanelBytes = int64_t(256) << 20;
constexpr int kThreads = 256;

// Checks a BLAS call; throws std::runtime_error naming the call and the library's status string.
#define SPECD_BLAS_CHECK(call)                                                                        \
  do {                                                                                                \
    cublasStatus_t specd_st_ = (call);                                                                \
    if (specd_st_ != CUBLAS_STATUS_SUCCESS)                                                           \
      throw std::runtime_error(std::string(SPECD_BLAS_NAME " call `" #call "` failed at ") + __FILE__ + \
                               ":" + std::to_string(__LINE__) + ": " + cublasGetStatusString(specd_st_)); \
  } while (0)

// One handle per library, bound to the library stream; created on first use and never destroyed
// (like the stream: it must outlive buffers freed during interpreter shutdown).
cublasHandle_t handle() {
  static std::mutex mu;
  static cublasHandle_t h = nullptr;
  std::lock_guard<std::mutex> lock(mu);
  if (!h) {
    cublasHandle_t made = nullptr;
    SPECD_BLAS_CHECK(cublasCreate(&made));
    SPECD_BLAS_CHECK(cublasSetStream(made, stream()));
    h = made;
  }
  return h;
}

// dst[r, :] = bf16(dequantize(w row r)) for `rows` rows; one thread per chunk (grid-stride), 32-bit
// indices (a 64-bit division per chunk costs ~70 instructions; dequant_launch checks they fit).
template <class W>
__global__ void __launch_bounds__(kThreads) dequant_bf16_kernel(const uint8_t* __restrict__ w, int64_t row_bytes,
                                                               uint32_t nchunks, uint32_t rows, int64_t in,
                                                               uint16_t* __restrict__ dst) {
  detail::pdl_enter();
  const uint32_t total = rows * nchunks, step = gridDim.x * kThreads;
  for (uint32_t t = blockIdx.x * kThreads + threadIdx.x; t < total; t += step) {
    const uint32_t r = t / nchunks, c = t % nchunks;
    decode_chunk<W>(w + int64_t(r) * row_bytes, c, StoreBF16{dst + int64_t(r) * in});
  }
}

#if !SPECD_HIP  // the tiled layouts are the CUDA tensor-core GEMV's (matmul.cu refuses them on HIP)
// The same for tiles [tile0, tile0 + tiles) of a tiled weight w (IQ4_XS_TILED: T = IQ4XSTiledW,
// Q4_K_TILED: Q4KTiledW, Q5_K_TILED: Q5KTiledW, Q6_K_TILED: Q6KTiledW; nunits 256-input units per row), one tile unit per
// warp and iteration (weight_formats.cuh: unit_decode_lane, unit_store_lane); dst holds the tiles' rows.
// Consecutive warps take consecutive units of a tile: contiguous weight bytes, adjacent output columns.
constexpr int kUnitWarps = 4;  // 4 x 8 KiB of shared memory per block
static_assert(kUnitRows == kGemvTileRows, "a tile unit spans one GEMV tile of rows");
template <class T>
__global__ void __launch_bounds__(SPECD_WARP * kUnitWarps)
    dequant_units_bf16_kernel(const uint8_t* __restrict__ w, uint32_t nunits, int64_t tile0, uint32_t tiles, int64_t in,
                              uint16_t* __restrict__ dst) {
  detail::pdl_enter();
  __shared__ uint4 smem[kUnitWarps][kUnitRows * kUnitPieces];
  const int warp = int(threadIdx.x) / SPECD_WARP, lane = int(threadIdx.x) & (SPECD_WARP - 1);
  uint4* tile = smem[warp];
  const uint32_t total = tiles * nunits, step = gridDim.x * kUnitWarps;
  for (uint32_t i = blockIdx.x * kUnitWarps + warp; i < total; i += step) {
    const uint32_t t = i / nunits, u = i % nunits;
    unit_decode_lane<T>(w, nunits, kUnitRows * (tile0 + t), u, lane, tile);
    __syncwarp();
    unit_store_lane(tile, dst + int64_t(kUnitRows) * t * in, in, u, lane);
    __syncwarp();  // the tile is read by every lane before the next unit overwrites it
  }
}
#endif

// The GEMM's x in BF16: x itself, or swiglu(gate, up) = silu(gate) * up. load8(v, f): the 8 values
// 8 v .. 8 v + 7 with 16-byte loads (the inputs 16-byte aligned: aligned()).
struct PlainX {
  const float* __restrict__ x;
  __device__ __forceinline__ float operator()(int64_t i) const { return x[i]; }
  __device__ __forceinline__ void load8(int64_t v, float (&f)[8]) const {
    const float4 a = reinterpret_cast<const float4*>(x)[2 * v], b = reinterpret_cast<const float4*>(x)[2 * v + 1];
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
  }
  bool aligned() const { return aligned16(x); }
};

// The F32 evaluation's domain: expf(-gate) overflows below -88.72 (silu would become -0), so gates below
// kSiluF32Floor keep a margin; gates under kSiluF32Tiny in magnitude (0 included) would leave a subnormal
// gate / 2.
constexpr float kSiluF32Floor = -80.0f, kSiluF32Tiny = 0x1p-100f;

// The swiglu op's double evaluation (apply), kept out of line: the F32 path's registers stay few.
__device__ __noinline__ float swiglu_f64(float g, float u) { return apply<Op::Swiglu>(g, u); }

// swiglu for the GEMM's BF16 input, in F32: gate / (1 + e^-gate) * up with expf (<= 2 ulp) and IEEE division
// and products, within 6e-7 relative of the exact value, against the 2^-9 of the BF16 rounding after it. The
// swiglu op evaluates in double (bit-exact with the CPU), which made this conversion compute-bound. Outside
// the F32 domain above (and for NaN, whose result is NaN either way) the double path.
__device__ __forceinline__ float swiglu_for_bf16(float g, float u) {
  if (!(g >= kSiluF32Floor) || fabsf(g) < kSiluF32Tiny) return swiglu_f64(g, u);
  return g / (1.0f + expf(-g)) * u;
}

struct SwigluX {
  const float* __restrict__ gate;
  const float* __restrict__ up;
  __device__ __forceinline__ float operator()(int64_t i) const { return swiglu_for_bf16(gate[i], up[i]); }
  __device__ __forceinline__ void load8(int64_t v, float (&f)[8]) const {
    float g[8], u[8];
    PlainX{gate}.load8(v, g);
    PlainX{up}.load8(v, u);
#pragma unroll
    for (int k = 0; k < 8; ++k) f[k] = swiglu_for_bf16(g[k], u[k]);
  }
  bool aligned() const { return aligned16(gate) && aligned16(up); }
};
// dst[i] = bf16(x(i)) for i < count: with `vec`, 8 values per thread and iteration (two or four 16-byte
// loads, one 16-byte store: a thread of the scalar loop kept 4-8 bytes in flight), then the scalar tail.
template <class X>
__global__ void __launch_bounds__(kThreads) x_bf16_kernel(const X x, int64_t count, bool vec,
                                                          uint16_t* __restrict__ dst) {
  detail::pdl_enter();
  const int64_t step = int64_t(gridDim.x) * kThreads, first = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t n8 = vec ? count / 8 : 0;
  for (int64_t v = first; v < n8; v += step) {
    float f[8];
    x.load8(v, f);
    reinterpret_cast<uint4*>(dst)[v] = uint4{StoreBF16::pair(f[0], f[1]), StoreBF16::pair(f[2], f[3]),
                                             StoreBF16::pair(f[4], f[5]), StoreBF16::pair(f[6], f[7])};
  }
  for (int64_t i = 8 * n8 + first; i < count; i += step) dst[i] = to_bf16(x(i));
}

unsigned grid_for(int64_t items) {
  const int64_t blocks = (items + kThreads - 1) / kThreads, cap = int64_t(sm_count()) * 32;
  return unsigned(std::max<int64_t>(1, std::min(blocks, cap)));
}

#if !SPECD_HIP
template <class T>
void dequant_tiled_launch(const Tensor& w, int64_t r0, int64_t rows, uint16_t* dst) {
  const int64_t in = w.dim(1), nunits = in / 256, tiles = rows / kUnitRows;
  SPECD_CHECK(r0 % kUnitRows == 0 && rows % kUnitRows == 0, "matmul: a tiled weight's panel must start and end at a",
              " 16-row tile edge, got rows [", r0, ", ", r0 + rows, ")");
  const int64_t units = tiles * nunits;
  SPECD_CHECK(units + int64_t(sm_count()) * 8 * kUnitWarps <= int64_t(UINT32_MAX), "matmul: dequantize panel too large");
  // Up to 8 blocks per SM, each warp looping over units. (On sm_90 six fit at a time, 33 KiB of shared
  // memory each with the reserved 1 KiB: 1.33 waves when every block is needed. Measured so.)
  const int64_t blocks = std::clamp<int64_t>((units + kUnitWarps - 1) / kUnitWarps, 1, int64_t(sm_count()) * 8);
  detail::launch_kernel<dequant_units_bf16_kernel<T>>(
      "dequant_units_bf16_kernel", unsigned(blocks), SPECD_WARP * kUnitWarps, 0, stream(),
      static_cast<const uint8_t*>(w.data), uint32_t(nunits), r0 / kUnitRows, uint32_t(tiles), in, dst);
}
#endif

// (in: a multiple of W::kElems, as check_weight and the F32 / F16 / BF16 cases' choice of W ensure)
template <class W>
void dequant_launch(const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t in, uint16_t* dst) {
  SPECD_CHECK(in % W::kElems == 0, "matmul: a row of ", in, " weights is not whole chunks of ", W::kElems);
  const int64_t nchunks = in / W::kElems;
  const unsigned grid = grid_for(rows * nchunks);
  // A panel holds at most kPanelBytes of BF16 (<= 2^27 chunks) or 16 rows: checked, not assumed.
  SPECD_CHECK(rows * nchunks + int64_t(grid) * kThreads <= int64_t(UINT32_MAX), "matmul: dequantize panel too large");
  detail::launch_kernel<dequant_bf16_kernel<W>>("dequant_bf16_kernel", grid, kThreads, 0, stream(), w, row_bytes,
                                                uint32_t(nchunks), uint32_t(rows), in, dst);
}

// Rows [r0, r0 + rows) of w as BF16 into dst [rows, in]; the same chunk decoders as the GEMV.
void dequant_panel(const Tensor& w, int64_t r0, int64_t rows, uint16_t* dst) {
  const int64_t in = w.dim(1), rb = w.row_bytes();
  const uint8_t* src = static_cast<const uint8_t*>(w.data) + r0 * rb;
  const bool w16 = aligned16(w.data);
  switch (w.dtype) {
    case DType::Q8_0: return dequant_launch<Q8_0Quarter>(src, rb, rows, in, dst);
    case DType::Q4_K: return dequant_launch<Q4KW>(src, rb, rows, in, dst);
    case DType::Q5_K: return dequant_launch<Q5KW>(src, rb, rows, in, dst);
    case DType::Q6_K: return dequant_launch<Q6KW>(src, rb, rows, in, dst);
    case DType::IQ4_XS: return dequant_launch<IQ4XSW>(src, rb, rows, in, dst);
#if !SPECD_HIP
    case DType::IQ4_XS_TILED: return dequant_tiled_launch<IQ4XSTiledW>(w, r0, rows, dst);
    case DType::Q6_K_TILED: return dequant_tiled_launch<Q6KTiledW>(w, r0, rows, dst);
    case DType::Q4_K_TILED: return dequant_tiled_launch<Q4KTiledW>(w, r0, rows, dst);
    case DType::Q5_K_TILED: return dequant_tiled_launch<Q5KTiledW>(w, r0, rows, dst);
#endif
    case DType::F32:
      if (in % 4 == 0 && w16) return dequant_launch<F32W<4>>(src, rb, rows, in, dst);
      return dequant_launch<F32W<1>>(src, rb, rows, in, dst);
    case DType::F16:
      if (in % 8 == 0 && w16) return dequant_launch<Half16W<8, false>>(src, rb, rows, in, dst);
      return dequant_launch<Half16W<1, false>>(src, rb, rows, in, dst);
    case DType::BF16:
      if (in % 8 == 0 && w16) return dequant_launch<Half16W<8, true>>(src, rb, rows, in, dst);
      return dequant_launch<Half16W<1, true>>(src, rb, rows, in, dst);
    default: fail("matmul: no GPU dequantizer for ", dtype_info(w.dtype).name);
  }
}

// y[:, o0 : o0 + rows] = xb @ wb^T in column-major terms: C (rows x n, ldc = out) = op(A) B with
// A = wb stored as in x rows (column-major in x rows, transposed) and B = xb (in x n).
void gemm_panel(const uint16_t* wb, const uint16_t* xb, int64_t rows, int64_t n, int64_t in, float* y_o0,
                int64_t out) {
  const float alpha = 1.0f, beta = 0.0f;
  SPECD_BLAS_CHECK(cublasGemmEx(handle(), CUBLAS_OP_T, CUBLAS_OP_N, int(rows), int(n), int(in), &alpha, wb,
                                CUDA_R_16BF, int(in), xb, CUDA_R_16BF, int(in), &beta, y_o0, CUDA_R_32F, int(out),
                                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace

namespace {

// y = xb @ w^T for one weight (x already BF16 in xb).
void gemm_weight(const uint16_t* xb, int64_t n, const Tensor& w, Tensor& y) {
  const int64_t in = w.dim(1), out = w.dim(0);
  if (out == 0) return;
  if (w.dtype == DType::BF16 && aligned16(w.data) && in % 8 == 0) {  // already BF16: the GEMM reads it as is
    gemm_panel(static_cast<const uint16_t*>(w.data), xb, out, n, in, y.ptr<float>(), out);
    return;
  }
  // Panels of whole 16-row tiles (the tiled layouts' dequantizer works a tile at a time), for every
  // format alike, so a tiled weight's GEMMs are the row-major weight's, call for call.
  const int64_t tiles_per_panel = std::max<int64_t>(kPanelBytes / (2 * in) / kUnitRows, 1);
  const int64_t panel = std::min<int64_t>(tiles_per_panel * kUnitRows, out);
  std::shared_ptr<void> wbuf = alloc(size_t(panel * in) * 2);
  auto* wb = static_cast<uint16_t*>(wbuf.get());
  for (int64_t o0 = 0; o0 < out; o0 += panel) {
    const int64_t rows = std::min(panel, out - o0);
    dequant_panel(w, o0, rows, wb);
    gemm_panel(wb, xb, rows, n, in, y.ptr<float>() + o0, out);
  }
  // wbuf is freed stream-ordered, after the GEMMs queued above.
}

// x's n x in values in BF16 once for every weight, then the GEMMs.
template <class X>
void blas_all(const X& x, int64_t n, int64_t in, const std::vector<Tensor>& ws, std::vector<Tensor>& ys) {
  SPECD_CHECK(n <= INT_MAX && in <= INT_MAX, "matmul: dimensions exceed the BLAS int range");
  for (const Tensor& w : ws) SPECD_CHECK(w.dim(0) <= INT_MAX, "matmul: dimensions exceed the BLAS int range");
  std::shared_ptr<void> xbuf = alloc(size_t(n * in) * 2);
  auto* xb = static_cast<uint16_t*>(xbuf.get());
  const bool vec = x.aligned() && aligned16(xb);  // (xb: a pool allocation, 256-byte aligned)
  detail::launch_kernel<x_bf16_kernel<X>>("x_bf16_kernel", grid_for(vec ? (n * in + 7) / 8 : n * in), kThreads, 0,
                                          stream(), x, n * in, vec, xb);
  for (size_t i = 0; i < ws.size(); ++i) gemm_weight(xb, n, ws[i], ys[i]);
  // xbuf is freed stream-ordered, after the GEMMs queued above.
}

}  // namespace

void matmul_blas(const Tensor& x, const std::vector<Tensor>& ws, std::vector<Tensor>& ys) {
  blas_all(PlainX{x.ptr<float>()}, x.rows(), x.cols(), ws, ys);
}

void matmul_blas_swiglu(const Tensor& gate, const Tensor& up, const std::vector<Tensor>& ws, std::vector<Tensor>& ys) {
  blas_all(SwigluX{gate.ptr<float>(), up.ptr<float>()}, gate.rows(), gate.cols(), ws, ys);
}

}  // namespace specd::gpu::detail
