#include "sampling.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <vector>

#include "float_view.h"
#include "specd/error.h"
#include "specd/parallel.h"

namespace specd::cpu {

namespace {

constexpr int64_t kSpan = 16384;  // columns per argmax work item when a row is split

// a ranks strictly above b by value (NaN above all numbers).
inline bool value_above(float a, float b) { return std::isnan(a) ? !std::isnan(b) : (!std::isnan(b) && a > b); }

struct Entry {
  float v;
  int32_t i;
};
// Strict ranking: higher value first, then lower index. Used as the heap "less", so the heap top
// is the worst kept entry.
inline bool above(const Entry& a, const Entry& b) {
  if (value_above(a.v, b.v)) return true;
  if (value_above(b.v, a.v)) return false;
  return a.i < b.i;
}

// First best entry of x[b, e) (b < e).
Entry best_in(const float* x, int64_t b, int64_t e) {
  Entry best{x[b], int32_t(b)};
  for (int64_t j = b + 1; j < e; ++j)
    if (value_above(x[j], best.v)) best = {x[j], int32_t(j)};
  return best;
}

void check_logits(const Tensor& x, const char* op) {
  check_rows(x, DType::F32, -1, op, "x");
  SPECD_CHECK(x.ndim() >= 1, op, ": x must have at least 1 dimension");
  SPECD_CHECK(x.cols() >= 1, op, ": x must have at least one column");
  SPECD_CHECK(x.cols() <= INT32_MAX, op, ": x has too many columns for I32 indices");
}

// x's shape without the last dimension, with `last` appended when last >= 0.
std::vector<int64_t> lead_shape(const Tensor& x, int64_t last) {
  std::vector<int64_t> s(x.shape.begin(), x.shape.end() - 1);
  if (last >= 0) s.push_back(last);
  return s;
}

}  // namespace

Tensor argmax(const Tensor& x) {
  check_logits(x, "argmax");
  int64_t n = x.rows(), V = x.cols();
  // Rows are split into column spans only when there are too few rows to fill the threads; the
  // spans are combined in index order, which gives exactly the unsplit answer.
  int64_t spans = n >= num_threads() ? 1 : (V + kSpan - 1) / kSpan;
  int64_t span = (V + spans - 1) / spans;
  std::vector<Entry> part(size_t(n * spans));
  parallel_for(n * spans, std::max<int64_t>(1, kSpan / span), [&](int64_t b, int64_t e) {
    for (int64_t u = b; u < e; ++u) {
      int64_t r = u / spans, c0 = (u % spans) * span;
      part[size_t(u)] = best_in(row_at<float>(x, r), c0, std::min(V, c0 + span));
    }
  });
  Tensor out = Tensor::empty(lead_shape(x, -1), DType::I32);
  for (int64_t r = 0; r < n; ++r) {
    Entry best = part[size_t(r * spans)];
    for (int64_t s = 1; s < spans; ++s)
      if (value_above(part[size_t(r * spans + s)].v, best.v)) best = part[size_t(r * spans + s)];
    out.ptr<int32_t>()[r] = best.i;
  }
  return out;
}

std::pair<Tensor, Tensor> topk(const Tensor& x, int64_t k) {
  check_logits(x, "topk");
  int64_t n = x.rows(), V = x.cols();
  SPECD_CHECK(k >= 1 && k <= V, "topk: k must be in [1, V=", V, "], got ", k);
  Tensor vals = Tensor::empty(lead_shape(x, k), DType::F32), idx = Tensor::empty(lead_shape(x, k), DType::I32);
  parallel_for(n, 1, [&](int64_t b, int64_t e) {
    std::vector<Entry> heap;
    heap.reserve(size_t(k));
    for (int64_t r = b; r < e; ++r) {
      const float* xr = row_at<float>(x, r);
      heap.clear();
      for (int64_t j = 0; j < V; ++j) {
        Entry cand{xr[j], int32_t(j)};
        if (int64_t(heap.size()) < k) {
          heap.push_back(cand);
          std::push_heap(heap.begin(), heap.end(), above);
        } else if (above(cand, heap.front())) {
          std::pop_heap(heap.begin(), heap.end(), above);
          heap.back() = cand;
          std::push_heap(heap.begin(), heap.end(), above);
        }
      }
      std::sort_heap(heap.begin(), heap.end(), above);  // best first
      for (int64_t i = 0; i < k; ++i) {
        vals.ptr<float>()[r * k + i] = heap[size_t(i)].v;
        idx.ptr<int32_t>()[r * k + i] = heap[size_t(i)].i;
      }
    }
  });
  return {vals, idx};
}

}  // namespace specd::cpu
