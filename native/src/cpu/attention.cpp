#include "attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "float_view.h"
#include "quants.h"
#include "specd/error.h"
#include "specd/parallel.h"

namespace specd::cpu {

void check_kv_cache_format(const Tensor& c, const char* op, const char* arg) {
  check_ndim(c, 3, op, arg);
  check_contiguous(c, op, arg);
  SPECD_CHECK(c.dtype == DType::F32 || c.dtype == DType::F16 || c.dtype == DType::Q8_0, op, ": ", arg,
              " must be F32, F16 or Q8_0, got ", dtype_info(c.dtype).name);
  SPECD_CHECK(c.dim(2) % dtype_info(c.dtype).block_size == 0, op, ": ", arg, " head_dim (", c.dim(2),
              ") must be a multiple of ", dtype_info(c.dtype).block_size, " for ", dtype_info(c.dtype).name);
}

void check_kv_write_shapes(const Tensor& cache, const Tensor& x, const Tensor& rows, const char* op,
                           const char* cache_arg, const char* x_arg) {
  check_writable(cache, op, cache_arg);
  const int64_t n = x.dim(0), hkv = cache.dim(1), d = cache.dim(2);
  SPECD_CHECK(x.dim(1) == hkv && x.dim(2) == d, op, ": ", x_arg, " must be [n, ", hkv, ", ", d, "] to match the ",
              cache_arg, ", got [", n, ", ", x.dim(1), ", ", x.dim(2), "]");
  SPECD_CHECK(rows.dim(0) == n, op, ": rows has ", rows.dim(0), " entries, ", x_arg, " has ", n);
}

void check_kv_rows(std::vector<int32_t> rows, int64_t capacity, const char* op) {
  for (size_t i = 0; i < rows.size(); ++i)
    SPECD_CHECK(rows[i] >= 0 && rows[i] < capacity, op, ": rows[", i, "] = ", rows[i], " is outside the cache [0, ",
                capacity, ")");
  std::sort(rows.begin(), rows.end());
  SPECD_CHECK(std::adjacent_find(rows.begin(), rows.end()) == rows.end(), op, ": rows must be distinct");
}

void check_kv_rows(const Tensor& rows, int64_t capacity, const char* op) {
  std::vector<int32_t> rv(static_cast<size_t>(rows.dim(0)));
  for (size_t i = 0; i < rv.size(); ++i) rv[i] = elem_at<int32_t>(rows, int64_t(i));
  check_kv_rows(std::move(rv), capacity, op);
}

namespace {

constexpr int64_t kChunk = 64;  // cache rows decoded together (shared by a unit's queries)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

void check_cache(const Tensor& c, const char* op, const char* arg) {
  check_cpu(c, op, arg);
  check_kv_cache_format(c, op, arg);
}

// Read access to one cache: F32 rows are used in place, others are decoded into a buffer.
struct CacheReader {
  const Tensor& t;
  const float* row(int64_t j, int64_t g, float* buf) const {
    const uint8_t* p = static_cast<const uint8_t*>(t.data) + j * t.strides[0] + g * t.strides[1];
    if (t.dtype == DType::F32) return reinterpret_cast<const float*>(p);
    dequantize_row(t.dtype, p, buf, t.dim(2));
    return buf;
  }
};

// Per-thread working memory for one work unit (a tile of queries x a run of heads): each pair's
// scores over the unit's key range, its max, sum and output accumulator, and decoded cache rows.
struct Scratch {
  std::vector<float> acc, m, l, rows, s;
  std::vector<const float*> rp;
  Scratch(int64_t pairs, int64_t d) : acc(size_t(pairs * d)), m(size_t(pairs)), l(size_t(pairs)),
                                      rows(size_t(kChunk * d)), rp(size_t(kChunk)) {}
};

struct Problem {
  const Tensor& q;
  CacheReader k, v;
  const AttentionArgs& a;
  std::vector<int64_t> lo, hi;  // visible key range per query before the mask
  int64_t hq, hkv, r, d;
  float scale;
  Tensor out;
};

// A work item: queries [i0, i1) x query heads [h0, h0 + hs), all reading KV head g.
struct Unit {
  int64_t g, h0, hs, i0, i1;
};

// Decodes cache rows [c0, c1) of KV head g that some query of the unit can see.
void decode_rows(const Problem& P, const CacheReader& cache, Scratch& w, const Unit& u, int64_t c0, int64_t c1) {
  for (int64_t j = c0; j < c1; ++j) w.rp[j - c0] = cache.row(j, u.g, w.rows.data() + (j - c0) * P.d);
}

bool visible(const Problem& P, int64_t i, int64_t j) {
  if (j < P.lo[i] || j >= P.hi[i]) return false;
  return !P.a.mask || row_at<int32_t>(*P.a.mask, i)[j] != 0;
}

// Softmax attention of every (query, head) pair of a unit, in two passes over its key range:
// scores and their max, then p = exp(s - max) summed with p * v in increasing key order. The
// arithmetic depends only on the ordered sequence of visible keys, never on where those keys sit
// in the cache or how many rows share the call: a tree node (keys at rows c + ancestor index) gets
// bit for bit the result of the chain verify of its path (keys at rows c + depth), and any row the
// result of a one-row call. Masked keys are skipped, so a row with no visible key returns zeros.
void attend_unit(const Problem& P, Scratch& w, const Unit& u) {
  int64_t pairs = (u.i1 - u.i0) * u.hs, lo = P.a.kv_len, hi = 0;
  for (int64_t i = u.i0; i < u.i1; ++i) {
    if (P.lo[i] >= P.hi[i]) continue;
    lo = std::min(lo, P.lo[i]);
    hi = std::max(hi, P.hi[i]);
  }
  int64_t span = std::max<int64_t>(hi - lo, 0);
  w.s.assign(size_t(pairs * span), kNegInf);
  std::fill(w.m.begin(), w.m.begin() + pairs, kNegInf);
  std::fill(w.l.begin(), w.l.begin() + pairs, 0.0f);
  std::fill(w.acc.begin(), w.acc.begin() + pairs * P.d, 0.0f);
  for (int64_t c0 = lo; c0 < hi; c0 += kChunk) {  // pass 1: scores and max
    int64_t c1 = std::min(c0 + kChunk, hi);
    decode_rows(P, P.k, w, u, c0, c1);
    for (int64_t i = u.i0; i < u.i1; ++i)
      for (int64_t j = c0; j < c1; ++j) {
        if (!visible(P, i, j)) continue;
        for (int64_t hh = 0; hh < u.hs; ++hh) {
          int64_t pair = (i - u.i0) * u.hs + hh;
          float sc = dot_f32(row_at<float>(P.q, i * P.hq + u.h0 + hh), w.rp[j - c0], P.d) * P.scale;
          w.s[size_t(pair * span + j - lo)] = sc;
          w.m[pair] = std::max(w.m[pair], sc);
        }
      }
  }
  for (int64_t c0 = lo; c0 < hi; c0 += kChunk) {  // pass 2: weights and weighted values
    int64_t c1 = std::min(c0 + kChunk, hi);
    decode_rows(P, P.v, w, u, c0, c1);
    for (int64_t i = u.i0; i < u.i1; ++i)
      for (int64_t j = c0; j < c1; ++j) {
        if (!visible(P, i, j)) continue;
        for (int64_t hh = 0; hh < u.hs; ++hh) {
          int64_t pair = (i - u.i0) * u.hs + hh;
          float p = std::exp(w.s[size_t(pair * span + j - lo)] - w.m[pair]);
          w.l[pair] += p;
          float* acc = w.acc.data() + pair * P.d;
          const float* vr = w.rp[j - c0];
          for (int64_t c = 0; c < P.d; ++c) acc[c] += p * vr[c];
        }
      }
  }
  for (int64_t i = u.i0; i < u.i1; ++i)
    for (int64_t hh = 0; hh < u.hs; ++hh) {
      int64_t pair = (i - u.i0) * u.hs + hh;
      float* o = P.out.ptr<float>() + (i * P.hq + u.h0 + hh) * P.d;
      const float* acc = w.acc.data() + pair * P.d;
      float l = w.l[pair];
      for (int64_t c = 0; c < P.d; ++c) o[c] = l > 0.0f ? acc[c] / l : 0.0f;
    }
}

// Work split: query tiles share decoded K/V rows; when there are few (query tile, KV head) items
// the query heads of a group are split too. Neither choice changes any result.
struct Split {
  int64_t tile, hs, tiles, subs;
};
Split choose_split(int64_t n, int64_t hkv, int64_t r) {
  int64_t want = 2 * int64_t(num_threads());
  Split s{std::clamp<int64_t>(n * hkv / want, 1, 16), r, 0, 1};
  s.tiles = (n + s.tile - 1) / s.tile;
  for (int64_t hs = r; hs >= 1; --hs) {  // largest divisor of r giving enough items
    if (r % hs != 0) continue;
    s.hs = hs;
    if (hkv * s.tiles * (r / hs) >= want) break;
  }
  s.subs = r / s.hs;
  return s;
}

void check_attention(const Tensor& q, const Tensor& kc, const Tensor& vc, const Tensor& q_pos,
                     const AttentionArgs& a) {
  const char* op = "attention";
  check_rows(q, DType::F32, 3, op, "q");
  check_cache(kc, op, "k_cache");
  check_cache(vc, op, "v_cache");
  SPECD_CHECK(kc.shape == vc.shape, op, ": k_cache and v_cache shapes differ");
  int64_t n = q.dim(0), hq = q.dim(1), d = q.dim(2), hkv = kc.dim(1);
  SPECD_CHECK(kc.dim(2) == d, op, ": cache head_dim ", kc.dim(2), " differs from q head_dim ", d);
  SPECD_CHECK(hkv > 0 && hq % hkv == 0, op, ": q heads (", hq, ") must be a multiple of cache KV heads (", hkv,
              ")");
  SPECD_CHECK(a.kv_len >= 0 && a.kv_len <= kc.dim(0), op, ": kv_len must be in [0, capacity=", kc.dim(0),
              "], got ", a.kv_len);
  SPECD_CHECK(a.window >= 0, op, ": window must be >= 0, got ", a.window);
  check_rows(q_pos, DType::I32, 1, op, "q_pos");
  SPECD_CHECK(q_pos.dim(0) == n, op, ": q_pos has ", q_pos.dim(0), " entries, q has ", n, " rows");
  if (a.mask) {
    check_rows(*a.mask, DType::I32, 2, op, "mask");
    SPECD_CHECK(a.mask->dim(0) == n && a.mask->dim(1) == a.kv_len, op, ": mask must have shape [", n, ", ",
                a.kv_len, "] (n, kv_len), got [", a.mask->dim(0), ", ", a.mask->dim(1), "]");
  }
  if (a.scale) SPECD_CHECK(std::isfinite(*a.scale), op, ": scale must be finite, got ", *a.scale);
}

}  // namespace

void kv_write(const Tensor& cache, const Tensor& x, const Tensor& rows) {
  const char* op = "kv_write";
  check_cache(cache, op, "cache");
  check_rows(x, DType::F32, 3, op, "x");
  check_rows(rows, DType::I32, 1, op, "rows");
  check_kv_write_shapes(cache, x, rows, op, "cache", "x");
  check_kv_rows(rows, cache.dim(0), op);
  const int64_t n = x.dim(0), hkv = cache.dim(1), d = cache.dim(2);
  parallel_for(n, std::max<int64_t>(1, 8192 / std::max<int64_t>(hkv * d, 1)), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      uint8_t* dst = static_cast<uint8_t*>(cache.data) + elem_at<int32_t>(rows, i) * cache.strides[0];
      for (int64_t h = 0; h < hkv; ++h)
        quantize_row(cache.dtype, row_at<float>(x, i * hkv + h), dst + h * cache.strides[1], d);
    }
  });
}

Tensor attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& q_pos,
                 const AttentionArgs& a) {
  check_attention(q, k_cache, v_cache, q_pos, a);
  int64_t n = q.dim(0), hq = q.dim(1), d = q.dim(2), hkv = k_cache.dim(1);
  Problem P{q, {k_cache}, {v_cache}, a, std::vector<int64_t>(size_t(n)), std::vector<int64_t>(size_t(n)),
            hq, hkv, hq / hkv, d, a.scale ? *a.scale : float(1.0 / std::sqrt(double(d))),
            Tensor::zeros(q.shape, DType::F32)};
  for (int64_t i = 0; i < n; ++i) {
    int64_t p = elem_at<int32_t>(q_pos, i);
    SPECD_CHECK(p >= 0, "attention: q_pos must be >= 0, got ", p, " at index ", i);
    P.lo[size_t(i)] = a.window > 0 ? std::max<int64_t>(0, p - a.window + 1) : 0;
    P.hi[size_t(i)] = a.causal ? std::min(a.kv_len, p + 1) : a.kv_len;
  }
  if (n == 0 || hq == 0 || d == 0) return P.out;
  Split sp = choose_split(n, hkv, P.r);
  parallel_for(hkv * sp.subs * sp.tiles, 1, [&](int64_t b, int64_t e) {
    Scratch w(sp.tile * sp.hs, d);
    for (int64_t x = b; x < e; ++x) {
      int64_t head_item = x % (hkv * sp.subs), i0 = (x / (hkv * sp.subs)) * sp.tile;
      int64_t g = head_item / sp.subs, h0 = g * P.r + (head_item % sp.subs) * sp.hs;
      attend_unit(P, w, Unit{g, h0, sp.hs, i0, std::min(n, i0 + sp.tile)});
    }
  });
  return P.out;
}

}  // namespace specd::cpu
