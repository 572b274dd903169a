#include "../cpu/sampling.h"
#if SPECD_WITH_GPU
#include "../gpu/ops.h"
#endif
#include "bindings.h"

namespace specd::py_bind {

void register_sampling(py::module_& m) {
  m.def(
      "argmax",
      [](const Tensor& x) {
        return without_gil([&] {
#if SPECD_WITH_GPU
          if (x.device == Device::GPU) return gpu::argmax(x);
#endif
          return cpu::argmax(x);
        });
      },
      py::arg("x"),
      R"doc(Index of the maximum of each row (greedy decoding).

x: F32 [n, V], V >= 1 (CPU: last dim contiguous; GPU tensors run on the GPU). Returns I32 [n].
Leading dimensions may be any: [..., V] -> I32 [...].
Ties: the first (lowest) index wins. NaN ranks above every number, as in numpy/torch argmax: a row
containing NaN returns the index of its first NaN. Exact, so independent of threads and batch.
Raises ValueError on dtype/shape mismatch.)doc");
  m.def(
      "topk",
      [](const Tensor& x, int64_t k) {
        auto [values, indices] = without_gil([&] {
#if SPECD_WITH_GPU
          if (x.device == Device::GPU) return gpu::topk(x, k);
#endif
          return cpu::topk(x, k);
        });
        return py::make_tuple(values, indices);
      },
      py::arg("x"), py::arg("k"),
      R"doc(The k largest entries of each row, largest first.

x: F32 [n, V] (last dim contiguous; [..., V] gives [..., k]); 1 <= k <= V. Returns
(values F32 [n, k] descending, indices I32 [n, k]). Equal values are ordered by lower index first; NaN ranks above every number
(as in argmax). Bounded heap, O(V log k) per row; rows in parallel.
Raises ValueError on dtype/shape mismatch or k outside [1, V].)doc");
}

}  // namespace specd::py_bind
