// DFlash 2's grouped dynamic causal convolution on the GPU, same contract as cpu::grouped_dynamic_conv
// (cpu/dynamic_conv.h): one launch of grouped_dynamic_conv_kernel (dynamic_conv.cuh), one thread per output
// element. Tolerance vs CPU: bit-identical (the same F32 operations in the same order, explicit
// round-to-nearest; NaN payloads aside: the GPU returns its canonical NaN).
#include "../cpu/dynamic_conv.h"
#include "dynamic_conv.cuh"
#include "op_util.cuh"
#include "ops.h"

namespace specd::gpu {

Tensor grouped_dynamic_conv(const Tensor& y, const Tensor& dyn, const Tensor& base, int64_t side) {
  const char* op = "grouped_dynamic_conv";
  detail::check_gpu_tensor(y, DType::F32, -1, op, "y");
  detail::check_gpu_tensor(dyn, DType::F32, -1, op, "dyn");
  detail::check_gpu_tensor(base, DType::F32, -1, op, "base");
  const cpu::DynamicConvDims k = cpu::check_grouped_dynamic_conv_shapes(y, dyn, base, side, op);
  Tensor out = Tensor::empty({k.L, k.H}, DType::F32, Device::GPU);
  const int64_t n = k.L * k.H;  // <= 2^31 - 1 (y's bound)
  if (n == 0) return out;
  using detail::dynamic_conv::kThreads;
  detail::launch_kernel<detail::dynamic_conv::grouped_dynamic_conv_kernel>(
      "grouped_dynamic_conv_kernel", unsigned((n + kThreads - 1) / kThreads), kThreads, 0, detail::stream(),
      y.ptr<float>(), dyn.ptr<float>() + k.offset, base.ptr<float>(), out.ptr<float>(), int(k.L), int(k.H),
      int(k.taps), int(k.G), int(k.gs), int(k.pitch));
  return out;
}

}  // namespace specd::gpu
