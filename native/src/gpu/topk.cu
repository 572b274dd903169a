// Row-wise top-k on the GPU, same contract as cpu::topk: the k best (value, index) pairs of each row
// under the argmax ranking (larger value first, NaN above every number, -0.0 == +0.0, ties by lower
// index), best first. Exact, hence bit-identical to the CPU op and batch invariant: the path and its
// chunking depend on (V, k) alone, and each row's result on that row alone. The kernels and the choice
// of path are in topk.cuh.
#include <climits>
#include <memory>

#include "op_util.cuh"
#include "ops.h"
#include "specd/gpu.h"
#include "topk.cuh"

namespace specd::gpu {

// x: F32 [..., V] on the GPU, contiguous, V in [1, INT32_MAX]; k in [1, V]. Returns (values F32 [..., k],
// indices I32 [..., k]). Throws std::invalid_argument for bad inputs, std::runtime_error when a launch or
// the scratch allocation (8 bytes per row and chunk, stream-ordered) fails.
std::pair<Tensor, Tensor> topk(const Tensor& x, int64_t k) {
  const char* op = "topk";
  detail::check_gpu_tensor(x, DType::F32, -1, op, "x");
  SPECD_CHECK(x.ndim() >= 1, op, ": x must have at least 1 dimension");
  SPECD_CHECK(x.cols() >= 1, op, ": x must have at least one column");
  SPECD_CHECK(x.cols() <= INT32_MAX, op, ": x has too many columns for I32 indices");
  int64_t V = x.cols(), n = x.rows();
  SPECD_CHECK(k >= 1 && k <= V, op, ": k must be in [1, V=", V, "], got ", k);
  detail::check_grid(n, op);
  std::vector<int64_t> shape(x.shape.begin(), x.shape.end() - 1);
  shape.push_back(k);
  Tensor vals = Tensor::empty(shape, DType::F32, Device::GPU), idx = Tensor::empty(shape, DType::I32, Device::GPU);
  if (n == 0) return {vals, idx};
  namespace tk = detail::topk;
  const tk::Plan p = tk::plan(V, k);
  if (!p.split) {
    detail::launch_kernel<tk::rounds_kernel>("topk rounds_kernel", unsigned(n), tk::kRoundThreads, 0,
                                             detail::stream(), x.ptr<float>(), V, k, vals.ptr<float>(),
                                             idx.ptr<int32_t>());
    return {vals, idx};
  }
  // n * chunks blocks of chunk_max_kernel (chunks <= kMaxChunks, so the product fits int64)
  detail::check_grid(n * p.chunks, op);
  std::shared_ptr<void> maxk = alloc(size_t(n * p.chunks) * sizeof(uint64_t));
  auto* mk = static_cast<uint64_t*>(maxk.get());
  detail::launch_kernel<tk::chunk_max_kernel>("topk chunk_max_kernel", unsigned(n * p.chunks), tk::kMaxThreads, 0,
                                              detail::stream(), x.ptr<float>(), V, p.chunks, p.lg, mk);
  detail::launch_kernel<tk::select_kernel>("topk select_kernel", unsigned(n), tk::kSelThreads, 0, detail::stream(),
                                           x.ptr<float>(), V, k, p.chunks, p.lg, static_cast<const uint64_t*>(mk),
                                           vals.ptr<float>(), idx.ptr<int32_t>());
  // maxk is freed stream-ordered, after the kernels queued above.
  return {vals, idx};
}

}  // namespace specd::gpu
