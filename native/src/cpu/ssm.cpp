#include "ssm.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "activations.h"
#include "float_view.h"
#include "norm.h"
#include "specd/error.h"
#include "specd/parallel.h"

namespace specd::cpu {

namespace {

constexpr int64_t kChanBlock = 64;  // channels per work item; fixed so per-channel code never varies

// Bytes [lo, hi) a tensor's elements can touch (any stride signs); empty for no elements. A block
// format's innermost dimension is whole contiguous blocks (a KV cache's Q8_0 rows): its row's bytes.
std::pair<uintptr_t, uintptr_t> byte_span(const Tensor& t) {
  const uintptr_t base = reinterpret_cast<uintptr_t>(t.data);
  for (int64_t n : t.shape)
    if (n == 0) return {base, base};
  const bool blocks = is_block_type(t.dtype) && t.ndim() > 0;
  intptr_t lo = 0, hi = 0;
  for (size_t i = 0; i + (blocks ? 1 : 0) < t.shape.size(); ++i) {
    const intptr_t ext = intptr_t(t.shape[i] - 1) * intptr_t(t.strides[i]);
    (ext < 0 ? lo : hi) += ext;
  }
  return {base + lo, base + hi + uintptr_t(blocks ? t.row_bytes() : row_size(t.dtype, 1))};
}

// Row r of X = [state ; x]: state row r for r < K-1, else x row r - (K-1).
const float* conv_src_row(const Tensor& x, const float* state, int64_t r, int64_t km1, int64_t C) {
  return r < km1 ? state + r * C : row_at<float>(x, r - km1);
}

void conv_block(const Tensor& x, const float* w, const float* state, float* state_out, float* y, int64_t K,
                int64_t C, int64_t c0, int64_t c1, bool silu_out) {
  int64_t T = x.dim(0), km1 = K - 1, nc = c1 - c0;
  float acc[kChanBlock];
  for (int64_t t = 0; t < T; ++t) {
    std::fill(acc, acc + nc, 0.0f);
    for (int64_t j = 0; j < K; ++j) {
      const float* src = conv_src_row(x, state, t + j, km1, C) + c0;
      const float* wj = w + j * C + c0;
      for (int64_t c = 0; c < nc; ++c) acc[c] += wj[c] * src[c];
    }
    float* yr = y + t * C + c0;
    for (int64_t c = 0; c < nc; ++c) yr[c] = silu_out ? silu(acc[c]) : acc[c];
  }
  // New state: X rows T .. T+K-2, gathered before any state row is overwritten (in place).
  std::vector<float> next(size_t(km1 * nc));
  for (int64_t r = 0; r < km1; ++r)
    std::memcpy(next.data() + r * nc, conv_src_row(x, state, T + r, km1, C) + c0, size_t(nc) * sizeof(float));
  for (int64_t r = 0; r < km1; ++r)
    std::memcpy(state_out + r * C + c0, next.data() + r * nc, size_t(nc) * sizeof(float));
}

struct GdnArgs {
  const Tensor &q, &k, &v, &g, &beta;
  const float* state;
  float* state_out;  // == state when in place
  float* ckpt;  // nullptr when not requested
  float scale;
  int64_t T, hk, hv, dk, dv;
  float* out;
};

// One token for value head j: decay, delta-rule write against the decayed state, read with q.
void gdn_token(const GdnArgs& a, int64_t t, int64_t j, float* S, float* qs) {
  int64_t kh = j % a.hk;
  const float* qt = row_at<float>(a.q, t * a.hk + kh);
  const float* kt = row_at<float>(a.k, t * a.hk + kh);
  const float* vt = row_at<float>(a.v, t * a.hv + j);
  float decay = std::exp(row_at<float>(a.g, t)[j]);
  float bt = row_at<float>(a.beta, t)[j];
  for (int64_t i = 0; i < a.dk; ++i) qs[i] = qt[i] * a.scale;
  float* o = a.out + (t * a.hv + j) * a.dv;
  for (int64_t jv = 0; jv < a.dv; ++jv) {
    float* s = S + jv * a.dk;
    for (int64_t i = 0; i < a.dk; ++i) s[i] *= decay;
    float d = bt * (vt[jv] - dot_f32(s, kt, a.dk));
    for (int64_t i = 0; i < a.dk; ++i) s[i] += kt[i] * d;
    o[jv] = dot_f32(s, qs, a.dk);
  }
}

// Returns the state the call writes (cpu::written_state).
const Tensor& check_gdn(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                        const Tensor& state, float scale, const std::optional<Tensor>& checkpoints,
                        const std::optional<Tensor>& state_out) {
  const char* op = "gated_delta_net";
  check_rows(q, DType::F32, 3, op, "q");
  check_rows(k, DType::F32, 3, op, "k");
  check_rows(v, DType::F32, 3, op, "v");
  check_rows(g, DType::F32, 2, op, "g");
  check_rows(beta, DType::F32, 2, op, "beta");
  const GdnDims d = check_gated_delta_net_shapes(q, k, v, g, beta, scale, op);
  if (checkpoints) {
    check_state(*checkpoints, {d.T, d.hv, d.dv, d.dk}, Device::CPU, op, "checkpoints");
    SPECD_CHECK(!overlap(*checkpoints, state), op, ": checkpoints must not overlap state");
  }
  return written_state(state, state_out, {d.hv, d.dv, d.dk},
                       {&q, &k, &v, &g, &beta, checkpoints ? &*checkpoints : nullptr}, Device::CPU, op);
}

// "op: layer i", the op name in the errors of layer i of a several-layer op.
std::string layer_op(const char* op, size_t i) { return std::string(op) + ": layer " + std::to_string(i); }

void check_f32(const Tensor& t, int64_t ndim, Device dev, const std::string& op, const char* arg) {
  check_device(t, dev, op.c_str(), arg);
  check_dtype(t, DType::F32, op.c_str(), arg);
  check_ndim(t, ndim, op.c_str(), arg);
  check_contiguous(t, op.c_str(), arg);
}

// "[d0, d1, ...]", a tensor's shape in an error.
std::string dims(const Tensor& t) {
  std::string s = "[";
  for (size_t i = 0; i < t.shape.size(); ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + "]";
}

// No layer's state overlaps another's or any layer's input (the layers run side by side on the GPU).
void check_layer_states(const std::vector<Tensor>& states,
                        std::initializer_list<std::pair<const std::vector<Tensor>*, const char*>> inputs,
                        const char* op) {
  std::vector<const Tensor*> written;
  for (const Tensor& t : states) written.push_back(&t);
  const WrittenSpans spans(written);
  if (const auto c = spans.clash()) fail(op, ": the states of layers ", c->first, " and ", c->second, " overlap");
  for (const auto& [list, name] : inputs)
    for (size_t j = 0; j < list->size(); ++j)
      if (const auto i = spans.hit((*list)[j])) fail(op, ": layer ", *i, "'s state overlaps layer ", j, "'s ", name);
}

}  // namespace

bool overlap(const Tensor& a, const Tensor& b) {
  const auto [lo, hi] = byte_span(a);
  const auto [c, d] = byte_span(b);
  return lo < hi && c < d && c < hi && lo < d;
}

WrittenSpans::WrittenSpans(const std::vector<const Tensor*>& written) {
  for (size_t i = 0; i < written.size(); ++i) {
    const auto [lo, hi] = byte_span(*written[i]);
    if (lo < hi) spans_.push_back({lo, hi, i});
  }
  std::sort(spans_.begin(), spans_.end(), [](const Span& a, const Span& b) { return a.lo < b.lo; });
}

std::optional<std::pair<size_t, size_t>> WrittenSpans::clash() const {
  // sorted by start, the spans are disjoint when each starts at or past the end of the one before
  for (size_t k = 1; k < spans_.size(); ++k)
    if (spans_[k].lo < spans_[k - 1].hi)
      return std::pair{std::min(spans_[k - 1].index, spans_[k].index), std::max(spans_[k - 1].index, spans_[k].index)};
  return std::nullopt;
}

std::optional<size_t> WrittenSpans::hit(const Tensor& t) const {
  const auto [lo, hi] = byte_span(t);
  if (lo >= hi) return std::nullopt;
  // disjoint spans end in ascending order too: the first ending past lo is the only one that may hold t's start,
  // and if it starts at or past hi, every later one does
  const auto it =
      std::upper_bound(spans_.begin(), spans_.end(), lo, [](uintptr_t v, const Span& s) { return v < s.hi; });
  if (it == spans_.end() || it->lo >= hi) return std::nullopt;
  return it->index;
}

void check_gdn_output_norm_args(const Tensor& z, const std::optional<Tensor>& norm_weight, const Tensor& written,
                                int64_t T, int64_t n_v_heads, int64_t head_v_dim, Device dev, const char* op) {
  check_device(z, dev, op, "z");
  check_dtype(z, DType::F32, op, "z");
  check_contiguous(z, op, "z");
  SPECD_CHECK(z.ndim() == 3 && z.dim(0) == T && z.dim(1) == n_v_heads && z.dim(2) == head_v_dim, op,
              ": z must be [T, n_v_heads, head_v_dim] = [", T, ", ", n_v_heads, ", ", head_v_dim, "], got ", z.ndim(),
              " dimension(s) of ", z.numel(), " elements");
  SPECD_CHECK(!overlap(written, z), op, ": z must not overlap the state written");
  if (!norm_weight) return;
  check_device(*norm_weight, dev, op, "norm_weight");
  check_dtype(*norm_weight, DType::F32, op, "norm_weight");
  check_contiguous(*norm_weight, op, "norm_weight");
  SPECD_CHECK(norm_weight->ndim() == 1 && norm_weight->dim(0) == head_v_dim, op, ": norm_weight must be [head_v_dim = ",
              head_v_dim, "], got ", norm_weight->numel(), " elements");
  SPECD_CHECK(!overlap(written, *norm_weight), op, ": norm_weight must not overlap the state written");
}

void check_state(const Tensor& s, const std::vector<int64_t>& shape, Device dev, const char* op, const char* arg,
                 bool written) {
  check_device(s, dev, op, arg);
  check_dtype(s, DType::F32, op, arg);
  check_contiguous(s, op, arg);
  if (written) check_writable(s, op, arg);
  SPECD_CHECK(s.shape == shape, op, ": ", arg, " has the wrong shape (see the docstring for the expected one)");
}

const Tensor& written_state(const Tensor& state, const std::optional<Tensor>& state_out,
                            const std::vector<int64_t>& shape, std::initializer_list<const Tensor*> inputs, Device dev,
                            const char* op) {
  check_state(state, shape, dev, op, "state", !state_out);
  if (!state_out) return state;
  check_state(*state_out, shape, dev, op, "state_out");
  if (state_out->data == state.data) {  // in place
    check_writable(state, op, "state");
    return state;
  }
  SPECD_CHECK(!overlap(*state_out, state), op, ": state_out must be state itself or not overlap it");
  for (const Tensor* t : inputs)
    SPECD_CHECK(!t || !overlap(*state_out, *t), op, ": state_out must not overlap the inputs");
  return *state_out;
}

GdnDims check_gated_delta_net_shapes(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                     const Tensor& beta, float scale, const char* op) {
  const GdnDims d{q.dim(0), q.dim(1), q.dim(2), v.dim(1), v.dim(2)};
  SPECD_CHECK(k.shape == q.shape, op, ": k must have q's shape [T, Hk, dk]");
  SPECD_CHECK(v.dim(0) == d.T, op, ": v has ", v.dim(0), " tokens, q has ", d.T);
  SPECD_CHECK(d.hk > 0 && d.hv % d.hk == 0, op, ": value heads (", d.hv, ") must be a multiple of key heads (", d.hk,
              ")");
  SPECD_CHECK(g.dim(0) == d.T && g.dim(1) == d.hv, op, ": g must be [T, Hv] = [", d.T, ", ", d.hv, "]");
  SPECD_CHECK(beta.dim(0) == d.T && beta.dim(1) == d.hv, op, ": beta must be [T, Hv] = [", d.T, ", ", d.hv, "]");
  SPECD_CHECK(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  return d;
}

Tensor conv1d_causal(const Tensor& x, const Tensor& weight, const Tensor& state, bool apply_silu,
                     const std::optional<Tensor>& state_out) {
  const char* op = "conv1d_causal";
  check_rows(x, DType::F32, 2, op, "x");
  check_cpu(weight, op, "weight");
  check_dtype(weight, DType::F32, op, "weight");
  check_ndim(weight, 2, op, "weight");
  check_contiguous(weight, op, "weight");
  int64_t T = x.dim(0), C = x.dim(1), K = weight.dim(0);
  SPECD_CHECK(K >= 1 && weight.dim(1) == C, op, ": weight must be [K >= 1, C=", C, "], got [", K, ", ",
              weight.dim(1), "]");
  const Tensor& out_state = written_state(state, state_out, {K - 1, C}, {&x, &weight}, Device::CPU, op);
  Tensor y = Tensor::empty({T, C}, DType::F32);
  int64_t blocks = (C + kChanBlock - 1) / kChanBlock;
  parallel_for(blocks, std::max<int64_t>(1, 64 / std::max<int64_t>(T, 1)), [&](int64_t b, int64_t e) {
    for (int64_t blk = b; blk < e; ++blk)
      conv_block(x, weight.ptr<float>(), state.ptr<float>(), out_state.ptr<float>(), y.ptr<float>(), K, C,
                 blk * kChanBlock, std::min(C, (blk + 1) * kChanBlock), apply_silu);
  });
  return y;
}

Tensor gated_delta_net(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                       const Tensor& state, float scale, const std::optional<Tensor>& checkpoints,
                       const std::optional<Tensor>& state_out) {
  const Tensor& out_state = check_gdn(q, k, v, g, beta, state, scale, checkpoints, state_out);
  int64_t T = q.dim(0), hk = q.dim(1), dk = q.dim(2), hv = v.dim(1), dv = v.dim(2);
  Tensor out = Tensor::empty({T, hv, dv}, DType::F32);
  GdnArgs a{q, k, v, g, beta, state.ptr<float>(), out_state.ptr<float>(),
            checkpoints ? checkpoints->ptr<float>() : nullptr, scale, T, hk, hv, dk, dv, out.ptr<float>()};
  int64_t head = dv * dk;
  parallel_for(hv, 1, [&](int64_t b, int64_t e) {
    std::vector<float> qs(static_cast<size_t>(dk));
    for (int64_t j = b; j < e; ++j) {
      float* S = a.state_out + j * head;  // the recurrence runs in place on the written state
      if (a.state_out != a.state) std::memcpy(S, a.state + j * head, size_t(head) * sizeof(float));
      for (int64_t t = 0; t < T; ++t) {
        gdn_token(a, t, j, S, qs.data());
        if (a.ckpt) std::memcpy(a.ckpt + (t * hv + j) * head, S, size_t(head) * sizeof(float));
      }
    }
  });
  return out;
}

const Tensor& check_gdn_step_args(const Tensor& cv, const Tensor& a, const Tensor& b, const Tensor& dt,
                                  const Tensor& ssm_a, const Tensor& state, const std::optional<Tensor>& state_out,
                                  int64_t n_k_heads, int64_t head_k_dim, int64_t n_v_heads, int64_t head_v_dim,
                                  float eps, float scale, Device dev) {
  const char* op = "gdn_step";
  const int64_t hk = n_k_heads, dk = head_k_dim, hv = n_v_heads, dv = head_v_dim;
  check_gdn_qkv_args(cv, hk, dk, hv, dv, eps, dev);
  for (const auto& [t, name] : {std::pair{&a, "a"}, {&b, "b"}, {&dt, "dt"}, {&ssm_a, "ssm_a"}}) {
    check_device(*t, dev, op, name);
    check_dtype(*t, DType::F32, op, name);
    check_contiguous(*t, op, name);
  }
  const int64_t T = cv.dim(0);
  SPECD_CHECK(a.ndim() == 2 && a.dim(0) == T && check_gdn_gates_shapes(a, b, dt, ssm_a) == hv, op,
              ": a and b must be [T, Hv] = [", T, ", ", hv, "]");
  SPECD_CHECK(hv % hk == 0, op, ": value heads (", hv, ") must be a multiple of key heads (", hk, ")");
  SPECD_CHECK(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  const Tensor& out = written_state(state, state_out, {hv, dv, dk}, {&cv, &a, &b, &dt, &ssm_a}, dev, op);
  for (const Tensor* t : {&cv, &a, &b, &dt, &ssm_a})  // in place too: the inputs are read as the state is written
    SPECD_CHECK(!overlap(out, *t), op, ": the state written must not overlap the inputs");
  return out;
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> gdn_step(
    const Tensor& cv, const Tensor& a, const Tensor& b, const Tensor& dt, const Tensor& ssm_a, const Tensor& state,
    int64_t n_k_heads, int64_t head_k_dim, int64_t n_v_heads, int64_t head_v_dim, float eps, float scale,
    const std::optional<Tensor>& state_out) {
  check_gdn_step_args(cv, a, b, dt, ssm_a, state, state_out, n_k_heads, head_k_dim, n_v_heads, head_v_dim, eps, scale,
                      Device::CPU);
  auto [q, k, v] = gdn_qkv(cv, n_k_heads, head_k_dim, n_v_heads, head_v_dim, eps);
  auto [g, beta] = gdn_gates(a, b, dt, ssm_a);
  Tensor o = gated_delta_net(q, k, v, g, beta, state, scale, std::nullopt, state_out);
  return {o, q, k, v, g, beta};
}

ConvDims check_conv1d_causal_states(const std::vector<Tensor>& xs, const std::vector<Tensor>& states, Device dev) {
  const char* op = "conv1d_causal_states";
  SPECD_CHECK(xs.size() == states.size(), op, ": ", xs.size(), " inputs (xs) for ", states.size(), " states");
  ConvDims d{0, 0, 0};
  for (size_t i = 0; i < xs.size(); ++i) {
    const std::string lop = layer_op(op, i);
    check_f32(xs[i], 2, dev, lop, "x");
    if (i == 0) d = {xs[0].dim(0), xs[0].dim(1), states[0].ndim() == 2 ? states[0].dim(0) : -1};
    SPECD_CHECK(xs[i].dim(0) == d.T && xs[i].dim(1) == d.C, lop, ": x must be [T, C] = [", d.T, ", ", d.C,
                "] as layer 0's, got [", xs[i].dim(0), ", ", xs[i].dim(1), "]");
    const Tensor& st = states[i];
    if (i == 0) SPECD_CHECK(d.km1 >= 0, lop, ": state must be [K - 1, C = ", d.C, "], got ", dims(st));
    SPECD_CHECK(st.ndim() == 2 && st.dim(0) == d.km1 && st.dim(1) == d.C, lop, ": state must be [K - 1, C] = [", d.km1,
                ", ", d.C, "] (layer 0's K - 1), got ", dims(st));
    check_state(st, {d.km1, d.C}, dev, lop.c_str(), "state");
  }
  check_layer_states(states, {{&xs, "x"}}, op);
  return d;
}

GdnDims check_gated_delta_net_states(const std::vector<Tensor>& q, const std::vector<Tensor>& k,
                                     const std::vector<Tensor>& v, const std::vector<Tensor>& g,
                                     const std::vector<Tensor>& beta, const std::vector<Tensor>& states, float scale,
                                     Device dev) {
  const char* op = "gated_delta_net_states";
  for (const auto& [list, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&g, "g"}, {&beta, "beta"}})
    SPECD_CHECK(list->size() == states.size(), op, ": ", list->size(), " tensors in ", name, " for ", states.size(),
                " states");
  GdnDims d{0, 0, 0, 0, 0};
  for (size_t i = 0; i < states.size(); ++i) {
    const std::string lop = layer_op(op, i);
    for (const auto& [t, name, ndim] : {std::tuple{&q[i], "q", 3}, {&k[i], "k", 3}, {&v[i], "v", 3}, {&g[i], "g", 2},
                                        {&beta[i], "beta", 2}})
      check_f32(*t, ndim, dev, lop, name);
    const GdnDims di = check_gated_delta_net_shapes(q[i], k[i], v[i], g[i], beta[i], scale, lop.c_str());
    if (i == 0) d = di;
    SPECD_CHECK(di.T == d.T && di.hk == d.hk && di.dk == d.dk && di.hv == d.hv && di.dv == d.dv, lop,
                ": [T, Hk, dk, Hv, dv] = [", di.T, ", ", di.hk, ", ", di.dk, ", ", di.hv, ", ", di.dv,
                "] differ from layer 0's [", d.T, ", ", d.hk, ", ", d.dk, ", ", d.hv, ", ", d.dv, "]");
    const std::vector<int64_t> shape{d.hv, d.dv, d.dk};
    SPECD_CHECK(states[i].shape == shape, lop, ": state must be [Hv, dv, dk] = [", d.hv, ", ", d.dv, ", ", d.dk,
                "], got ", dims(states[i]));
    check_state(states[i], shape, dev, lop.c_str(), "state");
  }
  check_layer_states(states, {{&q, "q"}, {&k, "k"}, {&v, "v"}, {&g, "g"}, {&beta, "beta"}}, op);
  return d;
}

void conv1d_causal_states(const std::vector<Tensor>& xs, const std::vector<Tensor>& states) {
  const ConvDims d = check_conv1d_causal_states(xs, states, Device::CPU);
  if (d.T == 0) return;  // the state is unchanged (and row T + r would be row r itself)
  const size_t row = size_t(d.C) * sizeof(float);
  for (size_t i = 0; i < states.size(); ++i) {
    float* s = states[i].ptr<float>();
    for (int64_t r = 0; r < d.km1; ++r)  // ascending: row T + r > r is read before it is overwritten
      std::memcpy(s + r * d.C, conv_src_row(xs[i], s, d.T + r, d.km1, d.C), row);
  }
}

void gated_delta_net_states(const std::vector<Tensor>& q, const std::vector<Tensor>& k, const std::vector<Tensor>& v,
                            const std::vector<Tensor>& g, const std::vector<Tensor>& beta,
                            const std::vector<Tensor>& states, float scale) {
  check_gated_delta_net_states(q, k, v, g, beta, states, scale, Device::CPU);
  for (size_t i = 0; i < states.size(); ++i)
    gated_delta_net(q[i], k[i], v[i], g[i], beta[i], states[i], scale, std::nullopt);
}

}  // namespace specd::cpu
