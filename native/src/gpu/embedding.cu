// Embedding row gather on the GPU: y[i] = dequantize(w[ids[i]]), same contract as cpu::embedding
// for every table format the GPU decodes (F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS).
// Bit-identical to the CPU op: F16/BF16 widen exactly, Q8_0 is float(q) * d as in dequantize_row,
// and the K-quant / IQ4_XS rows use the matmul's chunk decoders (weight_formats.cuh), which perform
// the CPU decoder's float operations on the same operands.
// ids (I32 [n]) may be a CPU tensor / numpy array or a GPU tensor; they are range-checked on the
// host (a GPU ids tensor is read back: one small synchronising copy, skipped when `trusted`) and
// uploaded asynchronously when on the CPU. The kernels zero the row of an id outside [0, V).
#include <cmath>

#include <utility>

#include "op_util.cuh"
#include "ops.h"
#include "weight_formats.cuh"

namespace specd::gpu {

namespace {

constexpr int kThreads = 256;

template <DType T>
__global__ void __launch_bounds__(kThreads) embedding_kernel(const uint8_t* __restrict__ w, int64_t row_bytes,
                                                             const int32_t* __restrict__ ids, float* __restrict__ y,
                                                             int64_t h, int64_t vocab) {
  detail::pdl_enter();
  const int64_t i = blockIdx.x;
  const int64_t id = ids[i];
  float* yr = y + i * h;
  if (id < 0 || id >= vocab) {  // only reachable with trusted ids
    for (int64_t c = threadIdx.x; c < h; c += kThreads) yr[c] = 0.0f;
    return;
  }
  const uint8_t* row = w + id * row_bytes;
  for (int64_t c = threadIdx.x; c < h; c += kThreads) {
    if constexpr (T == DType::F32) yr[c] = reinterpret_cast<const float*>(row)[c];
    if constexpr (T == DType::F16) yr[c] = detail::f16_at(row, c);
    if constexpr (T == DType::BF16) yr[c] = detail::bf16_at(row, c);
    if constexpr (T == DType::Q8_0) yr[c] = detail::q8_0_at(row, c);
  }
}

// One 256-weight-block format row: thread t decodes chunks t, t + kThreads, ... into y.
template <class W>
__global__ void __launch_bounds__(kThreads) embedding_blocks_kernel(const uint8_t* __restrict__ w, int64_t row_bytes,
                                                                    int64_t nchunks, const int32_t* __restrict__ ids,
                                                                    float* __restrict__ y, int64_t h, int64_t vocab) {
  detail::pdl_enter();
  const int64_t id = ids[blockIdx.x];
  if (id < 0 || id >= vocab) {  // only reachable with trusted ids
    for (int64_t c = threadIdx.x; c < h; c += kThreads) y[int64_t(blockIdx.x) * h + c] = 0.0f;
    return;
  }
  const uint8_t* row = w + id * row_bytes;
  for (int64_t c = threadIdx.x; c < nchunks; c += kThreads)
    detail::decode_chunk<W>(row, c, detail::StoreF32{y + int64_t(blockIdx.x) * h});
}

template <class W>
void launch_blocks(const Tensor& w, const int32_t* ids, Tensor& y, int64_t n, cudaStream_t s) {
  const int64_t h = w.dim(1);
  detail::launch_kernel<embedding_blocks_kernel<W>>("embedding_blocks_kernel", unsigned(n), kThreads, 0, s,
                                                    static_cast<const uint8_t*>(w.data), w.row_bytes(), h / 32, ids,
                                                    y.ptr<float>(), h, w.dim(0));
}

}  // namespace

Tensor embedding(const Tensor& w, const Tensor& ids, bool trusted) {
  const char* op = "embedding";
  detail::check_gpu(w, op, "w");
  check_ndim(w, 2, op, "w");
  check_contiguous(w, op, "w");
  const bool blocks = w.dtype == DType::Q4_K || w.dtype == DType::Q5_K || w.dtype == DType::Q6_K ||
                      w.dtype == DType::IQ4_XS;
  SPECD_CHECK(blocks || w.dtype == DType::F32 || w.dtype == DType::F16 || w.dtype == DType::BF16 ||
                  w.dtype == DType::Q8_0,
              op, ": the GPU op reads w of dtype F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K or IQ4_XS, got ",
              dtype_info(w.dtype).name);
  SPECD_CHECK(!blocks || w.dim(1) % 256 == 0, op, ": w rows of ", dtype_info(w.dtype).name,
              " must hold a multiple of 256 values, got ", w.dim(1));
  if (blocks) {  // the chunk decoders' widest loads: 16 B (Q4_K / Q5_K), 8 B (IQ4_XS), 2 B (Q6_K)
    const int64_t need = w.dtype == DType::IQ4_XS ? 8 : w.dtype == DType::Q6_K ? 2 : 16;
    SPECD_CHECK(reinterpret_cast<uintptr_t>(w.data) % need == 0 && w.row_bytes() % need == 0, op, ": w of ",
                dtype_info(w.dtype).name, " must be ", need, "-byte aligned (data and rows)");
  }
  check_dtype(ids, DType::I32, op, "ids");
  check_ndim(ids, 1, op, "ids");
  check_contiguous(ids, op, "ids");
  int64_t n = ids.dim(0), vocab = w.dim(0), h = w.dim(1);
  detail::check_grid(n, op);
  if (detail::check_on_host(ids, trusted)) {
    std::vector<int32_t> id = detail::host_i32(ids);
    for (int64_t i = 0; i < n; ++i)
      SPECD_CHECK(id[size_t(i)] >= 0 && id[size_t(i)] < vocab, op, ": ids[", i, "] = ", id[size_t(i)],
                  " is out of range for ", vocab, " rows of w");
  }
  Tensor y = Tensor::empty({n, h}, DType::F32, Device::GPU);
  if (n == 0 || h == 0) return y;
  Tensor dev_ids = detail::i32_on_gpu(ids);
  const uint8_t* wp = static_cast<const uint8_t*>(w.data);
  cudaStream_t s = detail::stream();
  switch (w.dtype) {
    case DType::F32:
      detail::launch_kernel<embedding_kernel<DType::F32>>("embedding_kernel", unsigned(n), kThreads, 0, s, wp,
                                                          w.row_bytes(), dev_ids.ptr<int32_t>(), y.ptr<float>(), h,
                                                          vocab);
      break;
    case DType::F16:
      detail::launch_kernel<embedding_kernel<DType::F16>>("embedding_kernel", unsigned(n), kThreads, 0, s, wp,
                                                          w.row_bytes(), dev_ids.ptr<int32_t>(), y.ptr<float>(), h,
                                                          vocab);
      break;
    case DType::Q4_K: launch_blocks<detail::Q4KW>(w, dev_ids.ptr<int32_t>(), y, n, s); break;
    case DType::Q5_K: launch_blocks<detail::Q5KW>(w, dev_ids.ptr<int32_t>(), y, n, s); break;
    case DType::Q6_K: launch_blocks<detail::Q6KW>(w, dev_ids.ptr<int32_t>(), y, n, s); break;
    case DType::IQ4_XS: launch_blocks<detail::IQ4XSW>(w, dev_ids.ptr<int32_t>(), y, n, s); break;
    case DType::BF16:
      detail::launch_kernel<embedding_kernel<DType::BF16>>("embedding_kernel", unsigned(n), kThreads, 0, s, wp,
                                                           w.row_bytes(), dev_ids.ptr<int32_t>(), y.ptr<float>(), h,
                                                           vocab);
      break;
    default:
      detail::launch_kernel<embedding_kernel<DType::Q8_0>>("embedding_kernel", unsigned(n), kThreads, 0, s, wp,
                                                           w.row_bytes(), dev_ids.ptr<int32_t>(), y.ptr<float>(), h,
                                                           vocab);
      break;
  }
  return y;
}

}  // namespace specd::gpu
