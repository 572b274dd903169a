// The GPU interface in a build without a GPU backend: nothing is available, and any attempt to
// place data on a GPU says how to get a GPU build.
#include <stdexcept>

#include "specd/gpu.h"

namespace specd::gpu {

namespace {
[[noreturn]] void unavailable() {
  throw std::runtime_error(
      "specd was built without a GPU backend; reinstall with SPECD_GPU=cuda (or hip) in the environment");
}
}  // namespace

bool compiled() { return false; }
bool available() { return false; }
std::string backend() { return "none"; }
std::string device_name() { return ""; }
std::string pci_bus_id() { unavailable(); }
std::shared_ptr<void> alloc(size_t) { unavailable(); }
void memset_zero(void*, size_t) { unavailable(); }
void copy_to_device(void*, const void*, size_t) { unavailable(); }
void copy_to_host(void*, const void*, size_t) { unavailable(); }
void copy_2d(void*, size_t, const void*, size_t, size_t, size_t) { unavailable(); }
void copy_many(void* const*, const void* const*, const size_t*, size_t) { unavailable(); }
void synchronize() {}
void copy_to_device_async(void*, const void*, size_t) { unavailable(); }
void graph_begin(size_t) { unavailable(); }
std::shared_ptr<Graph> graph_end() { unavailable(); }
void graph_abort() {}
bool capturing() { return false; }
MemoryInfo memory_info() { unavailable(); }
void trim_pool() { unavailable(); }
IpcBuffer ipc_export(size_t) { unavailable(); }
std::shared_ptr<void> ipc_open(const std::string&, size_t) { unavailable(); }
std::shared_ptr<IpcEvent> ipc_event_create() { unavailable(); }
std::shared_ptr<IpcEvent> ipc_event_open(const std::string&) { unavailable(); }

}  // namespace specd::gpu
