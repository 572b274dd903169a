#pragma once
#include <utility>

#include "specd/tensor.h"

namespace specd::cpu {

// Ranking used by argmax and topk: a total order on (value, index) pairs. Values compare
// numerically, except that NaN ranks above every number (including +inf), as in numpy.argmax and
// torch.argmax, so a NaN logit is surfaced instead of silently skipped; -0.0 and +0.0 are equal.
// Between equal values (or two NaNs) the lower index ranks higher.

// Index of the first maximum of each row. x: F32 [n, V] (last dim contiguous), V >= 1; more
// generally [..., V] -> I32 [...] (same contract as gpu::argmax). Returns I32 [n]. Exact (no rounding), so the result is independent of how the row is split
// across threads.
Tensor argmax(const Tensor& x);

// The k best entries of each row under the ranking above, best first: (F32 [n, k] values,
// I32 [n, k] indices); [..., V] inputs give [..., k]. Requires 1 <= k <= V. A bounded heap: O(V log k) per row.
std::pair<Tensor, Tensor> topk(const Tensor& x, int64_t k);

}  // namespace specd::cpu
