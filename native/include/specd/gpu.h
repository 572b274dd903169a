// Host-side interface of the GPU backend (CUDA, or HIP through src/gpu/portability.h).
//
// These functions exist in every build. Without a GPU backend (SPECD_GPU unset at build time)
// `available()` is false and every other call throws std::runtime_error saying so; with one, they
// talk to the current device and throw std::runtime_error naming the failing runtime call.
#pragma once
#include <cstddef>
#include <memory>
#include <string>

namespace specd::gpu {

bool compiled();        // built with a GPU backend
bool available();       // compiled and a device is present
std::string backend();  // "cuda", "hip" or "none"
std::string device_name();

std::shared_ptr<void> alloc(size_t bytes);  // device memory, freed when the last owner drops it
void memset_zero(void* dst, size_t bytes);
void copy_to_device(void* dst, const void* src, size_t bytes);
void copy_to_host(void* dst, const void* src, size_t bytes);
// Device -> device copy of `height` rows of `width` bytes (source rows `spitch` bytes apart,
// destination rows `dpitch` apart), enqueued on the library stream (asynchronous; ordered with the
// ops). Source and destination must not overlap. Used by specd.native slice / concat / copy.
void copy_2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height);
void synchronize();  // waits for the library's stream

// Device memory, in bytes: the device's free and total memory (cudaMemGetInfo, every process) and
// this library's stream-ordered pool (the device's default pool): bytes it holds from the device
// (reserved), bytes in live buffers (used) and the peak of used since start. `pool` is false (and
// the pool fields 0) on devices without memory-pool support. Throws when no GPU is usable.
struct MemoryInfo {
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  bool pool = false;
  size_t pool_reserved_bytes = 0;
  size_t pool_used_bytes = 0;
  size_t pool_used_high_bytes = 0;
};
MemoryInfo memory_info();

}  // namespace specd::gpu
