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
// Uploads. copy_to_device_async copies small host buffers into one of 32 pinned staging slots and
// enqueues the device copy from there (no host wait; a slot is reused after the event of its last
// copy, 32 copies later); index uploads of the ops go through it.
//
// Graphs (graph_begin / graph_end, specd/gpu.h). While the library stream is being captured,
// allocations of the capturing thread come from the capture's arena (cudaMalloc chunks owned by the
// graph and by the tensors allocated in it), its pool frees are deferred to the graph's destruction
// (frees by other threads to the end of the capture), and every call of the capturing thread that
// would wait for the GPU throws instead. Blocks freed during the capture are reused by later
// allocations of the same capture: a single-stream capture is a chain, so the reuse is ordered after
// the last use, as for stream-ordered allocation.
//
// Capture lock. capture_mu() (recursive: deleters may run on a thread that already holds it) guards
// the capture state. Other threads' stream work (allocations, frees, uploads, replays, in-place
// copies and memsets) waits while a capture runs and is enqueued with capture_mu() held, so a
// graph_begin (which takes capture_mu() around cudaStreamBeginCapture) cannot slip in between the
// check and the enqueue; graph_end calls cudaStreamEndCapture before it marks the capture ended.
//
// Errors. Every runtime call is checked; a failure throws std::runtime_error naming the call,
// file:line and the runtime's error string. `available()` never throws: it is false when the
// build has a GPU backend but the machine has no device or no (new enough) driver.
#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

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
  int smem_optin = 0;
  int major = 0;  // compute capability major (CUDA)
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
      (void)cudaGetLastError();  // clear the sticky error so later calls are not poisoned
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
      (void)cudaGetLastError();
      r.reason = std::string("cudaGetDevice failed: ") + cudaGetErrorString(err);
      return r;
    }
    cudaDeviceProp prop;
    if ((err = cudaGetDeviceProperties(&prop, r.device)) != cudaSuccess) {
      (void)cudaGetLastError();
      r.reason = std::string("cudaGetDeviceProperties failed: ") + cudaGetErrorString(err);
      return r;
    }
    r.name = prop.name;
    r.sms = prop.multiProcessorCount;
    r.major = prop.major;
#if SPECD_HIP
    r.smem_optin = int(prop.sharedMemPerBlock);
#else
    r.smem_optin = int(prop.sharedMemPerBlockOptin);
#endif
    int pools = 0;
    if (cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, r.device) != cudaSuccess) {
      (void)cudaGetLastError();
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

int max_smem_optin() { return require().smem_optin; }

int compute_major() { return require().major; }

// ---- Graph capture state (see specd/gpu.h). One global capture at a time, guarded by capture_mu();
// allocation and free paths consult it, so they also work from buffer deleters on any thread.

std::recursive_mutex& capture_mu() {
  static std::recursive_mutex* const m = new std::recursive_mutex;  // never destroyed (deleters run at shutdown)
  return *m;
}

namespace {

using CaptureLock = std::unique_lock<std::recursive_mutex>;

// Device memory of one graph: chunks from cudaMalloc (never from the stream-ordered pool, whose
// allocations inside a capture would become graph nodes), handed out by bump allocation.
struct Arena {
  struct Chunk {
    uint8_t* base;
    size_t size, used;
  };
  std::vector<Chunk> chunks;
  std::multimap<size_t, void*> free_blocks;  // freed during the capture, reusable by it (by size)
  bool open = true;                          // still capturing into it (guarded by capture_mu)
  ~Arena();
};

struct Capture {
  std::thread::id owner = std::this_thread::get_id();  // the capturing thread
  std::shared_ptr<Arena> arena;
  // Frees and teardowns of the capturing thread that must wait until no graph can read the memory
  // any more: run when the graph is destroyed (or at once when the capture is aborted: that graph
  // never runs).
  std::vector<std::function<void()>> deferred;
  // Frees and teardowns by other threads during the capture: not memory the captured work uses
  // (see gpu.h), but they cannot be enqueued while the stream is being captured; run as soon as the
  // capture ends (graph_end / graph_abort).
  std::vector<std::function<void()>> after_end;
};

Capture*& active_capture() {  // guarded by capture_mu()
  static Capture* c = nullptr;
  return c;
}

std::condition_variable_any& capture_done() {  // notified when a capture ends
  static std::condition_variable_any* const cv = new std::condition_variable_any;
  return *cv;
}

// With `lock` held on capture_mu(): waits while another thread captures (its work would be recorded
// into that graph: it runs after the capture instead). Returns the capture of this thread, or null.
// While the lock stays held no capture can begin, so work enqueued before it is released is never
// recorded into another thread's graph. (A nested call, with capture_mu() already held further up
// this thread, finds the predicate true at once and never waits with the lock held twice.)
Capture* own_capture(CaptureLock& lock) {
  capture_done().wait(lock, [] {
    const Capture* c = active_capture();
    return !c || c->owner == std::this_thread::get_id();
  });
  return active_capture();
}

// Runs `f` now (with capture_mu() held, so no capture can begin and record it), or, during a
// capture: when that capture's graph is destroyed if this thread is the capturing one, else right
// after the capture ends. Never throws; `f` must not throw nor wait on capture_done().
void run_or_defer(std::function<void()> f) noexcept {
  std::lock_guard<std::recursive_mutex> lock(capture_mu());
  if (Capture* c = active_capture()) {
    try {
      if (c->owner == std::this_thread::get_id())
        c->deferred.push_back(std::move(f));
      else
        c->after_end.push_back(std::move(f));
    } catch (...) {
      // out of host memory: leak the buffer rather than free what a graph may read
    }
    return;
  }
  f();
}

void run_all(std::vector<std::function<void()>>& fs) noexcept {
  for (auto& f : fs) f();
  fs.clear();
}

// Each of `fs` through run_or_defer (after a failed capture: another may have begun since).
void run_all_or_defer(std::vector<std::function<void()>>& fs) noexcept {
  for (auto& f : fs) run_or_defer(std::move(f));
  fs.clear();
}

Arena::~Arena() {
  for (const Chunk& c : chunks) {
    void* p = c.base;
    run_or_defer([p] {
      (void)cudaFree(p);  // synchronises the device: the chunk is idle afterwards
      (void)cudaGetLastError();
    });
  }
}

constexpr size_t kArenaAlign = 256;
// Growth once the reserved arena is full: chunks as large as the arena so far (geometric growth,
// few cudaMalloc calls) of 2 to 64 MiB, or exactly the allocation's size when one allocation needs
// more than that.
constexpr size_t kArenaMinChunk = size_t(2) << 20, kArenaMaxChunk = size_t(64) << 20;

// Called with capture_mu() held, during a capture.
std::shared_ptr<void> arena_alloc(const std::shared_ptr<Arena>& arena, size_t bytes) {
  const size_t size = (bytes + kArenaAlign - 1) / kArenaAlign * kArenaAlign;
  void* ptr = nullptr;
  size_t got = size;
  auto it = arena->free_blocks.lower_bound(size);
  if (it != arena->free_blocks.end() && it->first <= 2 * size) {  // best fit, at most 2x wasted
    ptr = it->second;
    got = it->first;
    arena->free_blocks.erase(it);
  } else {
    Arena::Chunk* c = arena->chunks.empty() ? nullptr : &arena->chunks.back();
    if (!c || c->size - c->used < size) {
      // Relaxed capture mode allows cudaMalloc (not a stream operation, so not recorded).
      size_t total = 0;
      for (const auto& k : arena->chunks) total += k.size;
      const size_t chunk = std::max(size, std::clamp(total, kArenaMinChunk, kArenaMaxChunk));
      void* base = nullptr;
      cudaError_t err = cudaMalloc(&base, chunk);
      if (err != cudaSuccess) {
        (void)cudaGetLastError();
        std::string what = "cudaMalloc of a " + std::to_string(chunk) + "-byte graph arena chunk";
        throw_runtime_error(err, what.c_str(), __FILE__, __LINE__);
      }
      arena->chunks.push_back({static_cast<uint8_t*>(base), chunk, 0});
      c = &arena->chunks.back();
    }
    ptr = c->base + c->used;
    c->used += size;
  }
  std::shared_ptr<Arena> owner = arena;  // the memory lives as long as any tensor or the graph
  return std::shared_ptr<void>(ptr, [owner, got](void* p) noexcept {
    std::lock_guard<std::recursive_mutex> lock(capture_mu());
    if (!owner->open) return;  // after the capture the graph owns the block (fixed addresses)
    try {
      owner->free_blocks.emplace(got, p);
    } catch (...) {
      // not reused: harmless
    }
  });
}

void* allocate(size_t bytes) {
  const Probe& p = require();
  cudaStream_t s = stream();
  void* ptr = nullptr;
  cudaError_t err = p.pools ? cudaMallocAsync(&ptr, bytes, s) : cudaMalloc(&ptr, bytes);
  if (err == cudaErrorMemoryAllocation && p.pools) {
    // Hand the pool's cached blocks back to the device, then retry once.
    (void)cudaGetLastError();
    SPECD_GPU_CHECK(cudaStreamSynchronize(s));
    cudaMemPool_t pool;
    SPECD_GPU_CHECK(cudaDeviceGetDefaultMemPool(&pool, p.device));
    SPECD_GPU_CHECK(cudaMemPoolTrimTo(pool, 0));
    err = cudaMallocAsync(&ptr, bytes, s);
  }
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    std::string what = std::string(p.pools ? "cudaMallocAsync" : "cudaMalloc") + " of " + std::to_string(bytes) + " bytes";
    throw_runtime_error(err, what.c_str(), __FILE__, __LINE__);
  }
  return ptr;
}

// Deleter of pool buffers. Must not throw: it runs in destructors, possibly during interpreter
// shutdown after the runtime has been unloaded, when the error is ignored on purpose. Buffers only
// exist once stream() has been created, so stream() cannot throw here. During a capture a free by
// the capturing thread is deferred to the graph's destruction (the graph may read the buffer on
// every replay), a free by another thread to the end of the capture.
void release(void* ptr) noexcept {
  if (!ptr) return;
  run_or_defer([ptr] {
    if (probe().pools)
      (void)cudaFreeAsync(ptr, stream());
    else
      (void)cudaFree(ptr);
    (void)cudaGetLastError();
  });
}

// Throws when this thread is capturing: `what` would wait for the GPU, which a capture cannot do.
// Other threads wait for the capture to end first. `lock` (on capture_mu()) stays held: the caller
// enqueues its work before any capture can begin.
void require_not_capturing(CaptureLock& lock, const char* what) {
  if (own_capture(lock))
    throw std::runtime_error(std::string(what) +
                             " during GPU graph capture: it would synchronise the host with the GPU; read results "
                             "after gpu_graph_end() and a replay");
}

// Pinned staging slots of copy_to_device_async, reused round robin; each slot's event marks the
// end of the device copy that last read it.
constexpr int kStagingSlots = 32;

struct Staging {
  std::mutex mu;
  uint8_t* host = nullptr;
  cudaEvent_t done[kStagingSlots] = {};
  bool used[kStagingSlots] = {};
  int next = 0;
};

Staging& staging() {
  static Staging* const st = [] {
    auto* s = new Staging;  // never destroyed (pinned memory lives until the process exits)
    void* host = nullptr;
    SPECD_GPU_CHECK(cudaMallocHost(&host, kStagingSlotBytes * kStagingSlots));
    s->host = static_cast<uint8_t*>(host);
    for (auto& e : s->done) SPECD_GPU_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return s;
  }();
  return *st;
}

}  // namespace

EnqueueGuard::EnqueueGuard() : lock_(capture_mu()) { (void)own_capture(lock_); }
EnqueueGuard::~EnqueueGuard() = default;

}  // namespace detail

using detail::probe;
using detail::stream;

bool compiled() { return true; }

bool available() { return probe().ok; }

std::string backend() { return SPECD_BACKEND_NAME; }

std::string device_name() { return probe().ok ? probe().name : std::string(); }

std::string pci_bus_id() {
  const detail::Probe& p = detail::require();
  char id[64] = {0};
  cudaError_t err = cudaDeviceGetPCIBusId(id, int(sizeof(id)), p.device);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    detail::throw_runtime_error(err, "cudaDeviceGetPCIBusId", __FILE__, __LINE__);
  }
  return std::string(id);
}

std::shared_ptr<void> alloc(size_t bytes) {
  detail::require();
  if (bytes == 0) return std::shared_ptr<void>(nullptr, [](void*) {});
  detail::CaptureLock lock(detail::capture_mu());
  // Another thread waits here until the capture ends (every op allocates its output before it
  // enqueues anything, so its work is not recorded into the graph), then allocates with the lock
  // held: a concurrent graph_begin cannot record the stream-ordered allocation.
  if (detail::Capture* c = detail::own_capture(lock)) return detail::arena_alloc(c->arena, bytes);
  void* ptr = detail::allocate(bytes);
  lock.unlock();
  return std::shared_ptr<void>(ptr, detail::release);
}

void memset_zero(void* dst, size_t bytes) {
  detail::require();
  if (bytes == 0) return;
  detail::EnqueueGuard guard;  // in place: waits while another thread captures
  SPECD_GPU_CHECK(cudaMemsetAsync(dst, 0, bytes, stream()));
}

// Host -> device. Returns once the data has left `src` (the stream is synchronised), so the caller
// may free or overwrite the host buffer immediately, whether it is pageable or pinned.
void copy_to_device(void* dst, const void* src, size_t bytes) {
  detail::require();
  if (bytes == 0) return;
  detail::CaptureLock lock(detail::capture_mu());
  detail::require_not_capturing(lock, "a synchronous host to device copy");
  SPECD_GPU_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream()));
  SPECD_GPU_CHECK(cudaStreamSynchronize(stream()));
}

// Device -> host, after all work queued before it; returns with the data in `dst`.
void copy_to_host(void* dst, const void* src, size_t bytes) {
  detail::require();
  if (bytes == 0) return;
  detail::CaptureLock lock(detail::capture_mu());
  detail::require_not_capturing(lock, "a device to host copy (e.g. Tensor.numpy() or an index read-back)");
  SPECD_GPU_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream()));
  SPECD_GPU_CHECK(cudaStreamSynchronize(stream()));
}

// Waits for everything queued on the library stream and reports any error a kernel raised.
// A no-op when no device is available (nothing can have been queued).
void synchronize() {
  if (!probe().ok) return;
  detail::CaptureLock lock(detail::capture_mu());
  detail::require_not_capturing(lock, "gpu_synchronize");
  SPECD_GPU_CHECK(cudaStreamSynchronize(stream()));
}

void copy_to_device_async(void* dst, const void* src, size_t bytes) {
  detail::require();
  if (bytes == 0) return;
  // Held until the copy is enqueued (lock order: capture_mu(), then the staging lock).
  detail::CaptureLock lock(detail::capture_mu());
  detail::require_not_capturing(lock, "an asynchronous host to device copy");
  if (bytes > kStagingSlotBytes) {
    copy_to_device(dst, src, bytes);  // takes capture_mu() again (recursive)
    return;
  }
  cudaStream_t s = stream();
  detail::Staging& st = detail::staging();
  std::lock_guard<std::mutex> staging_lock(st.mu);
  const int k = st.next;
  st.next = (k + 1) % detail::kStagingSlots;
  if (st.used[k]) SPECD_GPU_CHECK(cudaEventSynchronize(st.done[k]));  // issued 32 copies ago: done
  uint8_t* slot = st.host + size_t(k) * kStagingSlotBytes;
  std::memcpy(slot, src, bytes);
  SPECD_GPU_CHECK(cudaMemcpyAsync(dst, slot, bytes, cudaMemcpyHostToDevice, s));
  SPECD_GPU_CHECK(cudaEventRecord(st.done[k], s));
  st.used[k] = true;
}

// ---- Graphs

namespace {

class CapturedGraph final : public Graph {
 public:
  CapturedGraph(cudaGraph_t g, cudaGraphExec_t exec, std::shared_ptr<detail::Arena> arena,
                std::vector<std::function<void()>> deferred)
      : g_(g), exec_(exec), arena_(std::move(arena)), deferred_(std::move(deferred)) {}

  ~CapturedGraph() override {
    cudaGraph_t g = g_;
    cudaGraphExec_t exec = exec_;
    auto deferred = std::make_shared<std::vector<std::function<void()>>>(std::move(deferred_));
    // After the last replay queued: wait for it, then free what only the graph could still read.
    detail::run_or_defer([g, exec, deferred] {
      (void)cudaStreamSynchronize(stream());
      (void)cudaGraphExecDestroy(exec);
      (void)cudaGraphDestroy(g);
      (void)cudaGetLastError();
      detail::run_all(*deferred);
    });
    // arena_ goes with this object; its chunks are freed (or deferred) once no tensor holds them
  }

  void replay() override {
    detail::CaptureLock lock(detail::capture_mu());  // held until the launch is enqueued
    detail::require_not_capturing(lock, "GpuGraph.replay");
    SPECD_GPU_CHECK(cudaGraphLaunch(exec_, stream()));
  }

  size_t arena_bytes() const override {
    size_t n = 0;
    for (const auto& c : arena_->chunks) n += c.size;
    return n;
  }

 private:
  cudaGraph_t g_;
  cudaGraphExec_t exec_;
  std::shared_ptr<detail::Arena> arena_;
  std::vector<std::function<void()>> deferred_;
};

}  // namespace

void graph_begin(size_t arena_bytes) {
  const auto& p = detail::require();
  cudaStream_t s = stream();
  {
    detail::CaptureLock lock(detail::capture_mu());
    if (detail::own_capture(lock)) throw std::runtime_error("gpu_graph_begin: a GPU graph capture is already running");
  }
  auto arena = std::make_shared<detail::Arena>();
  if (arena_bytes > 0) {  // reserved before the capture
    void* base = nullptr;
    cudaError_t err = cudaMalloc(&base, arena_bytes);
    if (err == cudaErrorMemoryAllocation && p.pools) {
      // Hand the pool's cached blocks back to the device, then retry once. Legal here: no capture
      // runs (another thread's is waited for, and none can begin while the lock is held).
      (void)cudaGetLastError();
      {
        detail::CaptureLock lock(detail::capture_mu());
        if (detail::own_capture(lock))
          throw std::runtime_error("gpu_graph_begin: a GPU graph capture is already running");
        SPECD_GPU_CHECK(cudaStreamSynchronize(s));
        cudaMemPool_t pool;
        SPECD_GPU_CHECK(cudaDeviceGetDefaultMemPool(&pool, p.device));
        SPECD_GPU_CHECK(cudaMemPoolTrimTo(pool, 0));
      }
      err = cudaMalloc(&base, arena_bytes);
    }
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      std::string what = "cudaMalloc of a " + std::to_string(arena_bytes) + "-byte graph arena";
      detail::throw_runtime_error(err, what.c_str(), __FILE__, __LINE__);
    }
    arena->chunks.push_back({static_cast<uint8_t*>(base), arena_bytes, 0});
  }
  auto cap = std::make_unique<detail::Capture>();
  cap->arena = std::move(arena);
  detail::CaptureLock lock(detail::capture_mu());
  if (detail::own_capture(lock)) throw std::runtime_error("gpu_graph_begin: a GPU graph capture is already running");
  SPECD_GPU_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
  detail::active_capture() = cap.release();
}

namespace {

// Ends this thread's capture: the Capture (null when no capture is running) and, in `g` / `err`,
// what cudaStreamEndCapture returned. Throws std::runtime_error when another thread's capture is
// running. The capture stays marked active (capture_mu() held) until cudaStreamEndCapture has
// returned, so no other thread can enqueue into the capturing stream; then the frees other threads
// made meanwhile are enqueued (still under the lock: no capture can begin first) and waiters wake.
std::unique_ptr<detail::Capture> end_capture(const char* who, cudaGraph_t& g, cudaError_t& err) {
  g = nullptr;
  err = cudaSuccess;
  std::unique_ptr<detail::Capture> cap;
  {
    std::lock_guard<std::recursive_mutex> lock(detail::capture_mu());
    detail::Capture* c = detail::active_capture();
    if (!c) return nullptr;
    if (c->owner != std::this_thread::get_id())
      throw std::runtime_error(std::string(who) +
                               ": the running GPU graph capture belongs to another thread (only the thread that "
                               "called gpu_graph_begin may end or abort it)");
    err = cudaStreamEndCapture(stream(), &g);
    cap.reset(c);
    detail::active_capture() = nullptr;
    cap->arena->open = false;
    detail::run_all(cap->after_end);
  }
  detail::capture_done().notify_all();
  return cap;
}

}  // namespace

std::shared_ptr<Graph> graph_end() {
  cudaGraph_t g = nullptr;
  cudaError_t err = cudaSuccess;
  auto cap = end_capture("gpu_graph_end", g, err);
  if (!cap) throw std::runtime_error("gpu_graph_end: no GPU graph capture is running");
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    if (g) (void)cudaGraphDestroy(g);
    detail::run_all_or_defer(cap->deferred);  // nothing was recorded that could run
    detail::throw_runtime_error(err, "cudaStreamEndCapture", __FILE__, __LINE__);
  }
  cudaGraphExec_t exec = nullptr;
  err = cudaGraphInstantiateWithFlags(&exec, g, 0);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    (void)cudaGraphDestroy(g);
    detail::run_all_or_defer(cap->deferred);
    detail::throw_runtime_error(err, "cudaGraphInstantiateWithFlags", __FILE__, __LINE__);
  }
  return std::make_shared<CapturedGraph>(g, exec, cap->arena, std::move(cap->deferred));
}

void graph_abort() {
  cudaGraph_t g = nullptr;
  cudaError_t err = cudaSuccess;
  auto cap = end_capture("gpu_graph_abort", g, err);
  if (!cap) return;
  if (g) (void)cudaGraphDestroy(g);
  (void)cudaGetLastError();                       // an invalidated capture reports its error here: dropped on purpose
  detail::run_all_or_defer(cap->deferred);  // the discarded graph never runs: deferred frees are safe now
}

bool capturing() {
  std::lock_guard<std::recursive_mutex> lock(detail::capture_mu());
  return detail::active_capture() != nullptr;
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

void trim_pool() {
  const auto& p = detail::require();
  detail::CaptureLock lock(detail::capture_mu());
  detail::require_not_capturing(lock, "trimming the memory pool");
  SPECD_GPU_CHECK(cudaStreamSynchronize(stream()));  // frees queued on the stream have happened
  if (!p.pools) return;
  cudaMemPool_t pool;
  SPECD_GPU_CHECK(cudaDeviceGetDefaultMemPool(&pool, p.device));
  SPECD_GPU_CHECK(cudaMemPoolTrimTo(pool, 0));
}

// ---- IPC (specd/gpu.h). Exported buffers are plain cudaMalloc allocations (pool blocks cannot be
// exported); frees and closes go through run_or_defer like pool frees (a capture running on another
// thread defers them to its end) and first drain the library stream (queued copies may still use
// the memory; cudaFree / cudaIpcCloseMemHandle do not order themselves after the stream).

namespace {

// SPECD_GPU_CHECK that also clears the runtime's last error before throwing: an IPC call refused for
// a peer's bad handle (a non-sticky error) must not be reported again by the next kernel launch check.
#define SPECD_IPC_CHECK(call)                                                             \
  do {                                                                                    \
    cudaError_t specd_err_ = (call);                                                      \
    if (specd_err_ != cudaSuccess) {                                                      \
      (void)cudaGetLastError();                                                                 \
      ::specd::gpu::detail::throw_runtime_error(specd_err_, #call, __FILE__, __LINE__);   \
    }                                                                                     \
  } while (0)

// Size in bytes of the device allocation containing `p`, or 0 when this runtime cannot tell.
size_t mapped_allocation_bytes(void* p) {
#if SPECD_HIP
  hipDeviceptr_t base = nullptr;
  size_t size = 0;
  if (hipMemGetAddressRange(&base, &size, p) != hipSuccess) {
    (void)hipGetLastError();
    return 0;
  }
  return size;
#elif defined(CUDART_VERSION) && CUDART_VERSION >= 12050
  using GetRange = int (*)(unsigned long long*, size_t*, unsigned long long);  // cuMemGetAddressRange_v2
  static GetRange fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      f = nullptr;
    }
    return reinterpret_cast<GetRange>(f);
  }();
  if (!fn) return 0;
  unsigned long long base = 0;
  size_t size = 0;
  if (fn(&base, &size, reinterpret_cast<unsigned long long>(p)) != 0) return 0;
  return size;
#else
  (void)p;
  return 0;
#endif
}

std::string check_handle(const std::string& handle, const char* what) {
  if (handle.size() != kIpcHandleBytes)
    throw std::invalid_argument(std::string(what) + ": an IPC handle is " + std::to_string(kIpcHandleBytes) +
                                " bytes, got " + std::to_string(handle.size()));
  return handle;
}

class IpcEventImpl final : public IpcEvent {
 public:
  IpcEventImpl(cudaEvent_t e, std::string h) : e_(e), h_(std::move(h)) {}
  ~IpcEventImpl() override {
    cudaEvent_t e = e_;
    detail::run_or_defer([e] {
      (void)cudaEventDestroy(e);
      (void)cudaGetLastError();
    });
  }
  std::string handle() const override { return h_; }
  void record() override {
    detail::CaptureLock lock(detail::capture_mu());
    detail::require_not_capturing(lock, "recording an IPC event");
    SPECD_IPC_CHECK(cudaEventRecord(e_, stream()));
  }
  void wait() override {
    detail::CaptureLock lock(detail::capture_mu());
    detail::require_not_capturing(lock, "waiting for an IPC event");
    SPECD_IPC_CHECK(cudaStreamWaitEvent(stream(), e_, 0));
  }
  void synchronize() override {
    detail::CaptureLock lock(detail::capture_mu());
    detail::require_not_capturing(lock, "synchronising an IPC event");
    SPECD_IPC_CHECK(cudaEventSynchronize(e_));
  }

 private:
  cudaEvent_t e_;
  std::string h_;
};

}  // namespace

IpcBuffer ipc_export(size_t bytes) {
  detail::require();
  if (bytes == 0) throw std::invalid_argument("gpu ipc_export: the buffer must have at least 1 byte");
  detail::CaptureLock lock(detail::capture_mu());
  detail::require_not_capturing(lock, "allocating an IPC buffer");
  (void)stream();  // created (and the device selected) before the allocation
  void* ptr = nullptr;
  cudaError_t err = cudaMalloc(&ptr, bytes);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    std::string what = "cudaMalloc of " + std::to_string(bytes) + " bytes (IPC buffer)";
    detail::throw_runtime_error(err, what.c_str(), __FILE__, __LINE__);
  }
  std::shared_ptr<void> owned(ptr, [](void* p) {
    detail::run_or_defer([p] {
      (void)cudaStreamSynchronize(stream());
      (void)cudaFree(p);
      (void)cudaGetLastError();
    });
  });
  SPECD_IPC_CHECK(cudaMemsetAsync(ptr, 0, bytes, stream()));
  cudaIpcMemHandle_t h;
  SPECD_IPC_CHECK(cudaIpcGetMemHandle(&h, ptr));
  SPECD_IPC_CHECK(cudaStreamSynchronize(stream()));  // zeroed before another process can read it
  IpcBuffer out;
  out.ptr = std::move(owned);
  out.handle.assign(reinterpret_cast<const char*>(&h), sizeof(h));
  out.bytes = bytes;
  return out;
}

std::shared_ptr<void> ipc_open(const std::string& handle, size_t bytes) {
  check_handle(handle, "gpu ipc_open");
  static_assert(sizeof(cudaIpcMemHandle_t) == kIpcHandleBytes, "IPC memory handle size");
  detail::require();
  if (bytes == 0) throw std::invalid_argument("gpu ipc_open: the declared size must be > 0");
  detail::CaptureLock lock(detail::capture_mu());
  detail::require_not_capturing(lock, "opening an IPC buffer");
  (void)stream();
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  void* ptr = nullptr;
  SPECD_IPC_CHECK(cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess));
  std::shared_ptr<void> owned(ptr, [](void* p) {
    detail::run_or_defer([p] {
      (void)cudaStreamSynchronize(stream());
      (void)cudaIpcCloseMemHandle(p);
      (void)cudaGetLastError();
    });
  });
  size_t have = mapped_allocation_bytes(ptr);
  if (have == 0)
    throw std::invalid_argument("gpu ipc_open: the size of the mapped allocation cannot be determined (" SPECD_BACKEND_NAME
                                " runtime without cuMemGetAddressRange / hipMemGetAddressRange; CUDA builds need "
                                "runtime 12.5 or newer): refusing to trust the declared " + std::to_string(bytes) +
                                " bytes");
  if (have < bytes)
    throw std::invalid_argument("gpu ipc_open: the exported allocation has " + std::to_string(have) +
                                " bytes, the handle declares " + std::to_string(bytes));
  return owned;
}

std::shared_ptr<IpcEvent> ipc_event_create() {
  detail::require();
  detail::CaptureLock lock(detail::capture_mu());
  detail::require_not_capturing(lock, "creating an IPC event");
  (void)stream();
  static_assert(sizeof(cudaIpcEventHandle_t) == kIpcHandleBytes, "IPC event handle size");
  cudaEvent_t e = nullptr;
  SPECD_IPC_CHECK(cudaEventCreateWithFlags(&e, cudaEventInterprocess | cudaEventDisableTiming));
  cudaIpcEventHandle_t h;
  cudaError_t err = cudaIpcGetEventHandle(&h, e);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    (void)cudaEventDestroy(e);
    detail::throw_runtime_error(err, "cudaIpcGetEventHandle", __FILE__, __LINE__);
  }
  return std::make_shared<IpcEventImpl>(e, std::string(reinterpret_cast<const char*>(&h), sizeof(h)));
}

std::shared_ptr<IpcEvent> ipc_event_open(const std::string& handle) {
  check_handle(handle, "gpu ipc_event_open");
  detail::require();
  detail::CaptureLock lock(detail::capture_mu());
  detail::require_not_capturing(lock, "opening an IPC event");
  (void)stream();
  cudaIpcEventHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  cudaEvent_t e = nullptr;
  SPECD_IPC_CHECK(cudaIpcOpenEventHandle(&e, h));
  return std::make_shared<IpcEventImpl>(e, handle);
}

}  // namespace specd::gpu
