#pragma once
#include <cstdint>

#include "specd/tensor.h"

namespace specd::cpu {

// DFlash 2's grouped dynamic causal convolution, one side of one module (drafters.md §6.2; the z-lab
// dflash package's `_grouped_dynamic_convolve`, ZL-0.1.0 model.py). For one block of L rows, H channels
// in G groups of group_size = H / G contiguous channels, taps kernel taps:
//   out[t, c] = sum_{o = 0 .. min(taps - 1, t)} (base[o, c] + D[t, o, c / group_size]) * y[t - o, c]
// (the coefficient is taken at the output row t; y is zero before the block start, so those terms are
// left out). The F32 operations and their order are those of the numpy reference
// (draft_worker/model.py grouped_dynamic_conv): coef = base + D, out = coef_0 * y_t, then for o = 1, 2, ...
// out = out + coef_o * y_{t-o}, each product and each sum rounded to F32 (no fused multiply-add), so the
// result equals numpy's bit for bit (NaN payloads aside) and the GPU op's.
// y: F32 [L, H]; base: F32 [taps, H]; dyn: F32 [L, taps, G] (D itself, side 0), or the projection's whole
// output F32 [L, S, taps, G] with D = dyn[:, side], 0 <= side < S (read in place, no copy). All contiguous,
// on the CPU; taps >= 1, G >= 1, H % G == 0; L may be 0. Returns F32 [L, H]. Throws std::invalid_argument
// naming the op and argument on a bad device, dtype, layout, shape, side, or a tensor of 2^31 elements or
// more (the GPU kernel indexes in 32 bits).
Tensor grouped_dynamic_conv(const Tensor& y, const Tensor& dyn, const Tensor& base, int64_t side = 0);

// The dimensions of a grouped_dynamic_conv call: L rows, H channels, taps, G groups of gs channels; D's row
// t starts at element t * pitch + offset of dyn (pitch = S * taps * G, offset = side * taps * G).
struct DynamicConvDims {
  int64_t L, H, taps, G, gs, pitch, offset;
};

// The shape contract of grouped_dynamic_conv above, shared by the CPU and GPU backends (each checks its
// own devices, dtypes and layouts first). Throws std::invalid_argument naming `op` and the argument.
DynamicConvDims check_grouped_dynamic_conv_shapes(const Tensor& y, const Tensor& dyn, const Tensor& base,
                                                  int64_t side, const char* op);

}  // namespace specd::cpu
