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
// PCI bus id of the library's device (cudaDeviceGetPCIBusId, "dddd:bb:dd.f"): the same device has the
// same id in every process, whatever its device numbering. Throws without a GPU.
std::string pci_bus_id();

std::shared_ptr<void> alloc(size_t bytes);  // device memory, freed when the last owner drops it
void memset_zero(void* dst, size_t bytes);
void copy_to_device(void* dst, const void* src, size_t bytes);
void copy_to_host(void* dst, const void* src, size_t bytes);
// Device -> device copy of `height` rows of `width` bytes (source rows `spitch` bytes apart,
// destination rows `dpitch` apart), enqueued on the library stream (asynchronous; ordered with the
// ops). Source and destination must not overlap. Used by specd.native slice / concat / copy.
void copy_2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height);
// dst[i] <- bytes[i] bytes of src[i] for i < count, device to device on the library stream: the copies whose
// pointers and size are multiples of 16 bytes in one kernel launch per 128 (copy_many.cuh), any other in a copy_2d
// of its own. No dst may overlap any src or another dst. Used by specd.native copy_tensors (a commit's states,
// every layer at once).
void copy_many(void* const* dst, const void* const* src, const size_t* bytes, size_t count);
void synchronize();  // waits for the library's stream

// Host -> device copy enqueued on the library stream without waiting: `src` is first copied into a
// pinned staging slot (so the caller may reuse it at once) and the device copy reads that slot.
// Copies over kStagingSlotBytes fall back to copy_to_device (synchronous). Refused (runtime_error)
// during graph capture: a replay would re-read the staging slot, not the caller's new values.
constexpr size_t kStagingSlotBytes = size_t(64) << 10;
void copy_to_device_async(void* dst, const void* src, size_t bytes);

// CUDA / HIP graph capture of the library stream (relaxed capture mode).
//
// graph_begin() reserves an arena of `arena_bytes` device bytes (when the cudaMalloc fails, the
// stream-ordered pool's cached blocks are returned to the device and it is retried once) and starts
// capturing. When the arena runs out, more cudaMalloc chunks are added: each as large as the arena
// so far clamped to 2..64 MiB, or exactly the size of one allocation that needs more than that.
// Until graph_end() / graph_abort(), every kernel and copy the library enqueues is recorded instead
// of run, every device allocation of the capturing thread comes from the arena (addresses fixed for
// every replay; a buffer freed during the capture is reused by later allocations of the same
// capture only, which the single-stream graph orders after its last use), and the capturing
// thread's frees of buffers from outside the arena are deferred to the graph's destruction (the
// graph may read them). Host synchronisations (copy_to_host, copy_to_device, synchronize,
// copy_to_device_async, Graph::replay) throw std::runtime_error on the capturing thread instead of
// breaking the capture. One capture at a time; only the thread that called graph_begin() may call
// graph_end() / graph_abort() (another thread gets std::runtime_error).
//
// Other threads during a capture: alloc, the synchronising calls above, copy_to_device_async,
// Graph::replay, copy_2d, memset_zero (and ops built on them, e.g. kv_write) wait until the capture
// ends, then enqueue their work holding the capture lock, so it is neither recorded into the graph
// nor raced by a graph_begin. Their frees are enqueued right after the capture ends: a buffer whose
// last owner another thread drops during a capture must not be used by the captured work (keep a
// reference for the graph's lifetime). Not gated: an op's kernel launch after its output allocation
// (a capture begun by another thread in between records it), so callers must still serialise GPU
// work around a capture (the target worker holds one model lock for forwards and captures).
class Graph {
 public:
  virtual ~Graph() = default;
  virtual void replay() = 0;               // enqueues the recorded work on the library stream
  virtual size_t arena_bytes() const = 0;  // device bytes the graph's arena holds
};
void graph_begin(size_t arena_bytes);
std::shared_ptr<Graph> graph_end();  // stops this thread's capture and instantiates the graph
void graph_abort();  // stops this thread's capture and discards it (no-op when none is running)
bool capturing();

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

// Returns the pool's cached free blocks to the device (after the library stream drained), e.g. the
// temporaries of a model upload; live buffers are untouched. Only synchronises without pool support. Throws
// when no GPU is usable or when called by a thread that is capturing a graph.
void trim_pool();

// ---- Inter-process sharing on one GPU (CUDA IPC / HIP IPC): a device buffer and an event that a
// second process on the same device opens. Used by the "cuda-ipc" feature transport (the target
// worker exports a feature ring, the drafter worker opens it). Handles are kIpcHandleBytes opaque
// bytes (cudaIpcMemHandle_t / cudaIpcEventHandle_t) that travel through the caller's own channel.
constexpr size_t kIpcHandleBytes = 64;

// A zeroed device buffer of `bytes` (> 0) allocated with plain cudaMalloc (IPC handles need it; the
// stream-ordered pool's blocks cannot be exported) and its handle (cudaIpcGetMemHandle). The memory
// is freed (cudaFree, after the library stream drains) when the last owner drops it; importers must
// have closed their mappings by then (the transport orders it: release after the reader's close, or
// the importer's reads fail). Refused on a thread that is capturing a graph.
struct IpcBuffer {
  std::shared_ptr<void> ptr;
  std::string handle;  // kIpcHandleBytes
  size_t bytes = 0;
};
IpcBuffer ipc_export(size_t bytes);
// Maps another process's exported buffer (cudaIpcOpenMemHandle with cudaIpcMemLazyEnablePeerAccess).
// `handle` must be kIpcHandleBytes long; `bytes` is the size the exporter declared: the mapped
// allocation's size (cuMemGetAddressRange / hipMemGetAddressRange) must be at least `bytes`, and a
// runtime that cannot report it is refused too (std::invalid_argument either way: a peer's declared
// size is never trusted). The runtime maps another GPU's buffer as well (peer access): the caller
// checks the exporter's pci_bus_id(). The mapping is closed (cudaIpcCloseMemHandle, after the
// library stream drains) when the last owner drops the returned pointer.
std::shared_ptr<void> ipc_open(const std::string& handle, size_t bytes);

// An interprocess event (cudaEventInterprocess | cudaEventDisableTiming). The writer records it on
// the library stream after enqueueing its writes; a reader in another process opens the handle and
// makes the library stream wait for the last record (cudaStreamWaitEvent) before its reads. Neither
// blocks the host (synchronize() does). record/wait are refused on a thread capturing a graph.
class IpcEvent {
 public:
  virtual ~IpcEvent() = default;
  virtual std::string handle() const = 0;  // kIpcHandleBytes (cudaIpcGetEventHandle)
  virtual void record() = 0;               // cudaEventRecord on the library stream
  virtual void wait() = 0;                 // cudaStreamWaitEvent(library stream, event)
  virtual void synchronize() = 0;          // cudaEventSynchronize (host waits for the last record)
};
std::shared_ptr<IpcEvent> ipc_event_create();
std::shared_ptr<IpcEvent> ipc_event_open(const std::string& handle);  // cudaIpcOpenEventHandle

}  // namespace specd::gpu
