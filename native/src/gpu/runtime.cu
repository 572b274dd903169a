// The host interface of the GPU backend (specd/gpu.h) on the CUDA runtime (HIP via portability.h).
//
// Device and stream. The library uses the device that is current when it is first touched
// (device 0 unless the process selected another; a multi-GPU process must keep that device current
// in threads that call the library) and one non-blocking stream on it, created on first use and
// never destroyed (it lives until the process exits, so buffers freed during
// interpreter shutdown still have a stream to be freed on). All kernels and copies are enqueued
// on that stream; host-visible results are synchronised explicitly (copy_to_host, synchronize).
//
// Memory. Device buffers are stream-ordered allocations (cudaMallocAsync / cudaFreeAsync on the
// library stream) from the device's default memory pool, whose release threshold is raised so
// freed blocks stay cached in the process: an op's output allocation then costs about a
// microsecond instead of a cudaMalloc, freeing does not synchronise the device, and both can be
// captured in a CUDA graph later. A buffer is freed (stream-ordered, after all work already
// queued) when the last shared_ptr owner drops it. Devices without memory-pool support fall back
// to cudaMalloc / cudaFree. On an out-of-memory error the pool's cached blocks are returned to the
// device and the allocation is retried once before the error is raised.
//
// Errors. Every runtime call is checked; a failure throws std::runtime_error naming the call,
// file:line and the runtime's error string. `available()` never throws: it is false when the
// build has a GPU backend but the machine has no device or no (new enough) driver.
#include <cstdio>
#include <mutex>
#include <new>

#include "common.cuh"
#include "specd/gpu.h"

namespace specd::gpu {

namespace detail {

void throw_runtime_error(cudaError_t err, const char* call, const char* file, int line) {
  std::string msg = std::string(SPECD_BACKEND_NAME) + " call `" + call + "` failed at " + file + ":" + std::to_string(line) + ": " +
         cudaGetErrorString(err) + " (" + cudaGetErrorName(err) + ")";
  throw std::runtime_error(msg);
}

namespace {

// What the first probe found; computed once, never throws.
struct Probe {
  bool ok = false;
  std::string reason;  // why not ok
  int device = 0;
  std::string name;
  int sms = 0;
  bool pools = false;
};

// Heap-allocated and never destroyed: buffer deleters may run during interpreter shutdown, after
// static destructors would otherwise have run.
const Probe& probe() {
  static const Probe* const p = new Probe([] {
    Probe r;
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
      cudaGetLastError();  // clear the sticky error so later calls are not poisoned
      r.reason = std::string("no usable ") + SPECD_BACKEND_NAME + " device: cudaGetDeviceCount: " +
                 cudaGetErrorString(err);
      if (err == cudaErrorInsufficientDriver || err == cudaErrorNoDevice)
        r.reason += " (no GPU driver is loaded on this machine, or it is older than the runtime this "
                    "build uses)";
      return r;
    }
    if (count == 0) {
      r.reason = std::string("no ") + SPECD_BACKEND_NAME + " device found (device count is 0)";
      return r;
    }
    if ((err = cudaGetDevice(&r.device)) != cudaSuccess) {
      cudaGetLastError();
      r.reason = std::string("cudaGetDevice failed: ") + cudaGetErrorString(err);
      return r;
    }
    cudaDeviceProp prop;
    if ((err = cudaGetDeviceProperties(&prop, r.device)) != cudaSuccess) {
      cudaGetLastError();
      r.reason = std::string("cudaGetDeviceProperties failed: ") + cudaGetErrorString(err);
      return r;
    }
    r.name = prop.name;
    r.sms = prop.multiProcessorCount;
    int pools = 0;
    if (cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, r.device) != cudaSuccess) {
      cudaGetLastError();
      pools = 0;
    }
    r.pools = pools != 0;
    r.ok = true;
    return r;
  }());
  return *p;
}

[[noreturn]] void unavailable() {
  const Probe& p = probe();
  throw std::runtime_error("specd GPU backend (" SPECD_BACKEND_NAME "): " + p.reason);
}

const Probe& require() {
  const Probe& p = probe();
  if (!p.ok) unavailable();
  return p;
}

// Stream and pool set-up; runs once, on first use (a failure throws and is retried next call).
cudaStream_t make_stream() {
  const Probe& p = require();
  SPECD_GPU_CHECK(cudaSetDevice(p.device));
  cudaStream_t s = nullptr;
  SPECD_GPU_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  if (p.pools) {
    cudaMemPool_t pool;
    SPECD_GPU_CHECK(cudaDeviceGetDefaultMemPool(&pool, p.device));
    uint64_t keep = UINT64_MAX;  // keep freed blocks cached for reuse
    SPECD_GPU_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  }
  return s;
}

}  // namespace

cudaStream_t stream() {
  static const cudaStream_t s = make_stream();
  return s;
}

int sm_count() { return require().sms; }

namespace {

void* allocate(size_t bytes) {
  const Probe& p = require();
  cudaStream_t s = stream();
  void* ptr = nullptr;
  cudaError_t err = p.pools ? cudaMallocAsync(&ptr, bytes, s) : cudaMalloc(&ptr, bytes);
  if (err == cudaErrorMemoryAllocation && p.pools) {
    // Hand the pool's cached blocks back to the device, then retry once.
    cudaGetLastError();
    SPECD_GPU_CHECK(cudaStreamSynchronize(s));
    cudaMemPool_t pool;
    SPECD_GPU_CHECK(cudaDeviceGetDefaultMemPool(&pool, p.device));
    SPECD_GPU_CHECK(cudaMemPoolTrimTo(pool, 0));
    err = cudaMallocAsync(&ptr, bytes, s);
  }
  if (err != cudaSuccess) {
    cudaGetLastError();
    std::string what = std::string(p.pools ? "cudaMallocAsync" : "cudaMalloc") + " of " + std::to_string(bytes) + " bytes";
    throw_runtime_error(err, what.c_str(), __FILE__, __LINE__);
  }
  return ptr;
}

// Deleter of device buffers. Must not throw: it runs in destructors, possibly during interpreter
// shutdown after the runtime has been unloaded, when the error is ignored on purpose. Buffers only
// exist once stream() has been created, so stream() cannot throw here.
void release(void* ptr) noexcept {
  if (!ptr) return;
  if (probe().pools)
    (void)cudaFreeAsync(ptr, stream());
  else
    (void)cudaFree(ptr);
  cudaGetLastError();
}

}  // namespace
}  // namespace detail

using detail::probe;
using detail::stream;

bool compiled() { return true; }

bool available() { return probe().ok; }

std::string backend() { return SPECD_BACKEND_NAME; }

std::string device_name() { return probe().ok ? probe().name : std::string(); }

std::shared_ptr<void> alloc(size_t bytes) {
  detail::require();
  if (bytes == 0) return std::shared_ptr<void>(nullptr, [](void*) {});
  return std::shared_ptr<void>(detail::allocate(bytes), detail::release);
}

void memset_zero(void* dst, size_t bytes) {
  detail::require();
  if (bytes == 0) return;
  SPECD_GPU_CHECK(cudaMemsetAsync(dst, 0, bytes, stream()));
}

// Host -> device. Returns once the data has left `src` (the stream is synchronised), so the caller
// may free or overwrite the host buffer immediately, whether it is pageable or pinned.
void copy_to_device(void* dst, const void* src, size_t bytes) {
  detail::require();
  if (bytes == 0) return;
  SPECD_GPU_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream()));
  SPECD_GPU_CHECK(cudaStreamSynchronize(stream()));
}

// Device -> host, after all work queued before it; returns with the data in `dst`.
void copy_to_host(void* dst, const void* src, size_t bytes) {
  detail::require();
  if (bytes == 0) return;
  SPECD_GPU_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream()));
  SPECD_GPU_CHECK(cudaStreamSynchronize(stream()));
}

// Waits for everything queued on the library stream and reports any error a kernel raised.
// A no-op when no device is available (nothing can have been queued).
void synchronize() {
  if (!probe().ok) return;
  SPECD_GPU_CHECK(cudaStreamSynchronize(stream()));
}

MemoryInfo memory_info() {
  const auto& p = detail::require();
  (void)stream();  // sets the device and the pool up (a context exists before cudaMemGetInfo)
  MemoryInfo m;
  SPECD_GPU_CHECK(cudaMemGetInfo(&m.free_bytes, &m.total_bytes));
  if (p.pools) {
    cudaMemPool_t pool;
    SPECD_GPU_CHECK(cudaDeviceGetDefaultMemPool(&pool, p.device));
    uint64_t v = 0;
    SPECD_GPU_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &v));
    m.pool_reserved_bytes = static_cast<size_t>(v);
    SPECD_GPU_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &v));
    m.pool_used_bytes = static_cast<size_t>(v);
    SPECD_GPU_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &v));
    m.pool_used_high_bytes = static_cast<size_t>(v);
    m.pool = true;
  }
  return m;
}

}  // namespace specd::gpu
