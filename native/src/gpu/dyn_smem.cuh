// The block's dynamic shared memory as floats, for kernel headers that the emulation harnesses also compile
// for the host (tests/gpu/host_emu: there it is the harness's buffer, specd_emu_block_smem()).
#pragma once

namespace specd::gpu::detail {

__device__ __forceinline__ float* dyn_smem() {
#if defined(SPECD_HOST_EMU)
  return reinterpret_cast<float*>(specd_emu_block_smem());
#else
  extern __shared__ __align__(16) float specd_dyn_smem[];
  return specd_dyn_smem;
#endif
}

}  // namespace specd::gpu::detail
