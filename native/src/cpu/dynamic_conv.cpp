#include "dynamic_conv.h"

#include <algorithm>
#include <limits>
#include <string>

#include "specd/error.h"
#include "specd/parallel.h"

namespace specd::cpu {

namespace {

// Channels per work item, rounded to whole groups; fixed, and every output element is computed alone,
// so the result never depends on the split or the thread count.
constexpr int64_t kChanBlock = 1024;

std::string dims(const Tensor& t) {
  std::string s = "[";
  for (size_t i = 0; i < t.shape.size(); ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + "]";
}

// Output row t, channels of groups [g0, g1). The order of operations is the numpy reference's (see the
// header): all of row t's tap-0 products first, then one accumulation pass per further tap, so no sum
// can be reassociated; -ffp-contract=off (CMakeLists.txt) keeps the compiler from fusing the product
// into the add.
void conv_row(const float* y, const float* d, const float* base, float* out, const DynamicConvDims& k, int64_t t,
              int64_t g0, int64_t g1) {
  const int64_t H = k.H, gs = k.gs;
  const float* yt = y + t * H;
  float* ot = out + t * H;
  for (int64_t g = g0; g < g1; ++g) {
    const float dg = d[g];
    for (int64_t c = g * gs; c < (g + 1) * gs; ++c) ot[c] = (base[c] + dg) * yt[c];
  }
  const int64_t last = std::min(k.taps - 1, t);  // y[t - o] is zero padding for o > t: no term
  for (int64_t o = 1; o <= last; ++o) {
    const float *yo = y + (t - o) * H, *bo = base + o * H, *dox = d + o * k.G;
    for (int64_t g = g0; g < g1; ++g) {
      const float dg = dox[g];
      for (int64_t c = g * gs; c < (g + 1) * gs; ++c) {
        const float prod = (bo[c] + dg) * yo[c];
        ot[c] = ot[c] + prod;
      }
    }
  }
}

}  // namespace

DynamicConvDims check_grouped_dynamic_conv_shapes(const Tensor& y, const Tensor& dyn, const Tensor& base,
                                                  int64_t side, const char* op) {
  constexpr int64_t kMaxElems = std::numeric_limits<int32_t>::max();
  SPECD_CHECK(y.ndim() == 2, op, ": y must be [L, H], got ", dims(y));
  SPECD_CHECK(dyn.ndim() == 3 || dyn.ndim() == 4, op, ": dyn must be [L, taps, G] or [L, S, taps, G], got ",
              dims(dyn));
  const int64_t L = y.dim(0), H = y.dim(1), S = dyn.ndim() == 4 ? dyn.dim(1) : 1;
  const int64_t taps = dyn.dim(dyn.ndim() - 2), G = dyn.dim(dyn.ndim() - 1);
  SPECD_CHECK(H >= 1, op, ": y must have at least one channel, got ", dims(y));
  SPECD_CHECK(dyn.dim(0) == L, op, ": dyn must have y's L = ", L, " rows, got ", dims(dyn));
  SPECD_CHECK(S >= 1 && taps >= 1 && G >= 1, op, ": dyn ", dims(dyn), " must have S, taps, G >= 1");
  SPECD_CHECK(H % G == 0, op, ": y's H = ", H, " must be a multiple of dyn's G = ", G, " (groups of H / G channels)");
  SPECD_CHECK(0 <= side && side < S, op, ": side ", side, " out of range for dyn ", dims(dyn),
              dyn.ndim() == 3 ? " (a 3-D dyn has side 0 only)" : "");
  SPECD_CHECK(base.ndim() == 2 && base.dim(0) == taps && base.dim(1) == H, op, ": base must be [taps, H] = [", taps,
              ", ", H, "], got ", dims(base));
  for (const auto& [t, arg] : {std::pair<const Tensor*, const char*>{&y, "y"}, {&dyn, "dyn"}, {&base, "base"}})
    SPECD_CHECK(t->numel() <= kMaxElems, op, ": ", arg, " ", dims(*t), " has ", t->numel(),
                " elements; at most 2^31 - 1 are supported");
  return {L, H, taps, G, H / G, S * taps * G, side * taps * G};
}

Tensor grouped_dynamic_conv(const Tensor& y, const Tensor& dyn, const Tensor& base, int64_t side) {
  const char* op = "grouped_dynamic_conv";
  for (const auto& [t, arg] : {std::pair<const Tensor*, const char*>{&y, "y"}, {&dyn, "dyn"}, {&base, "base"}}) {
    check_cpu(*t, op, arg);
    check_dtype(*t, DType::F32, op, arg);
    check_contiguous(*t, op, arg);
  }
  const DynamicConvDims k = check_grouped_dynamic_conv_shapes(y, dyn, base, side, op);
  Tensor out = Tensor::empty({k.L, k.H}, DType::F32);
  const int64_t groups_per_item = std::max<int64_t>(1, kChanBlock / k.gs);
  const int64_t items_per_row = (k.G + groups_per_item - 1) / groups_per_item;
  const float *yp = y.ptr<float>(), *dp = dyn.ptr<float>(), *bp = base.ptr<float>();
  float* op_ = out.ptr<float>();
  // grain: at least 32K channel-taps (~10 us) per chunk, so a thread is worth its fork / join: the 27B head's
  // block (L = 8, H = 5120, 2 taps: 80K) takes 2-3 threads, a tiny drafter's one
  const int64_t grain = std::max<int64_t>(1, 32768 / (std::min(groups_per_item * k.gs, k.H) * k.taps));
  parallel_for(k.L * items_per_row, grain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t t = i / items_per_row, g0 = (i % items_per_row) * groups_per_item;
      conv_row(yp, dp + t * k.pitch + k.offset, bp, op_, k, t, g0, std::min(k.G, g0 + groups_per_item));
    }
  });
  return out;
}

}  // namespace specd::cpu
