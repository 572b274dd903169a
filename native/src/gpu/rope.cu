// Partial NeoX RoPE (+ YaRN) on the GPU, same contract as cpu::rope_neox.
//
// The inverse frequencies and the YaRN multiplier come from cpu::rope_freqs (host, double) and are
// passed to the kernel by value. One block per (row, group of kHeads heads): the block computes
// a = pos * inv_freq[i] and cos/sin in double times the multiplier once per pair i (shared by all
// its heads: the double trig dominates the cost), then each (head, pair) thread rotates in double
// with explicit round-to-nearest operations (no FMA contraction, as the CPU build), rounded to F32
// once. The head groups give a one-row decode several blocks. Tolerance vs the CPU op:
// bit-identical except when the device and host double cos/sin (each within ~1 ulp of double)
// straddle an F32 rounding boundary: <= 1 F32 ulp, practically never. Dims >= n_rot are copied.
// positions (I32 [n], CPU or GPU) are checked (>= 0) on the host, which reads GPU ones back (one
// small synchronising copy) unless `trusted`; CPU ones are uploaded asynchronously. Any position
// value is safe for the kernel (a negative one is rotated as given).
#include <cmath>

#include "../cpu/rope.h"
#include "op_util.cuh"
#include "ops.h"

namespace specd::gpu {

namespace {

constexpr int kMaxHalf = 256;  // n_rot <= 512
constexpr int kThreads = 128;
constexpr int kHeads = 4;  // heads per block

struct Freqs {
  double inv[kMaxHalf];
  double mscale;
};

// Block (row t, head group blockIdx.y): heads [h0, h0 + nh). hd <= INT_MAX / kHeads (host check).
__global__ void __launch_bounds__(kThreads) rope_kernel(const float* __restrict__ x, const int32_t* __restrict__ pos,
                                                        float* __restrict__ y, int heads, int hd, int half,
                                                        const Freqs f) {
  __shared__ double cs[2 * kMaxHalf];  // cos, sin of pair i at cs[2i], cs[2i + 1]
  const int64_t t = blockIdx.x;
  const int h0 = int(blockIdx.y) * kHeads;
  const int nh = heads - h0 < kHeads ? heads - h0 : kHeads;
  const double p = double(pos[t]);
  for (int i = threadIdx.x; i < half; i += kThreads) {
    const double a = __dmul_rn(p, f.inv[i]);
    cs[2 * i] = __dmul_rn(cos(a), f.mscale);
    cs[2 * i + 1] = __dmul_rn(sin(a), f.mscale);
  }
  __syncthreads();
  const float* xr = x + (t * heads + h0) * hd;
  float* yr = y + (t * heads + h0) * hd;
  for (int e = threadIdx.x; e < nh * half; e += kThreads) {
    const int h = e / half, i = e % half;
    const double c = cs[2 * i], s = cs[2 * i + 1];
    const double x0 = xr[h * hd + i], x1 = xr[h * hd + i + half];
    yr[h * hd + i] = float(__dsub_rn(__dmul_rn(x0, c), __dmul_rn(x1, s)));
    yr[h * hd + i + half] = float(__dadd_rn(__dmul_rn(x1, c), __dmul_rn(x0, s)));
  }
  const int rest = hd - 2 * half;
  for (int e = threadIdx.x; e < nh * rest; e += kThreads) {
    const int h = e / rest, i = 2 * half + e % rest;
    yr[h * hd + i] = xr[h * hd + i];
  }
}

}  // namespace

Tensor rope_neox(const Tensor& x, const Tensor& positions, int64_t n_rot, double theta, const cpu::Yarn& yarn,
                 bool trusted) {
  const char* op = "rope_neox";
  detail::check_gpu_tensor(x, DType::F32, 3, op, "x");
  check_dtype(positions, DType::I32, op, "positions");  // CPU or GPU
  check_ndim(positions, 1, op, "positions");
  check_contiguous(positions, op, "positions");
  int64_t n = x.dim(0), heads = x.dim(1), hd = x.dim(2);
  SPECD_CHECK(positions.dim(0) == n, op, ": positions has ", positions.dim(0), " entries, x has ", n, " rows");
  SPECD_CHECK(n_rot <= hd, op, ": n_rot must be <= head_dim (", hd, "), got ", n_rot);
  cpu::RopeFreqs rf = cpu::rope_freqs(n_rot, theta, yarn);
  SPECD_CHECK(n_rot / 2 <= kMaxHalf, op, ": the GPU op supports n_rot <= ", 2 * kMaxHalf, ", got ", n_rot);
  detail::check_grid(n, op);
  SPECD_CHECK(heads <= 65535 * int64_t(kHeads) && hd <= 0x7fffffff / kHeads, op, ": x dimensions too large");
  if (detail::check_on_host(positions, trusted)) {
    std::vector<int32_t> pv = detail::host_i32(positions);
    for (int64_t i = 0; i < n; ++i)
      SPECD_CHECK(pv[size_t(i)] >= 0, op, ": positions must be >= 0, got ", pv[size_t(i)], " at index ", i);
  }
  Tensor y = Tensor::empty(x.shape, DType::F32, Device::GPU);
  if (n == 0 || heads == 0 || hd == 0) return y;
  Freqs f{};
  for (size_t i = 0; i < rf.inv_freq.size(); ++i) f.inv[i] = rf.inv_freq[i];
  f.mscale = rf.mscale;
  Tensor dpos = detail::i32_on_gpu(positions);
  const dim3 grid(unsigned(n), unsigned((heads + kHeads - 1) / kHeads));
  rope_kernel<<<grid, kThreads, 0, detail::stream()>>>(x.ptr<float>(), dpos.ptr<int32_t>(), y.ptr<float>(), int(heads),
                                                       int(hd), int(n_rot / 2), f);
  SPECD_GPU_CHECK_LAUNCH("rope_kernel");
  return y;
}

}  // namespace specd::gpu
