// Device (GPU) memory support that an optional module (src/cuda) plugs into the core at load
// time. Without it, allocate() of device memory reports kUnsupported.
#pragma once

#include <cstdint>

namespace sluice::detail {

struct DeviceMemoryHooks {
  // Allocates >= length bytes on `device`, zero filled; sets *size. Throws Error.
  void* (*allocate)(uint64_t length, int device, uint64_t* size) = nullptr;
  void (*free)(void* ptr) = nullptr;
  // Throws Error unless [ptr, ptr+length) is memory of `device`.
  void (*check)(const void* ptr, uint64_t length, int device) = nullptr;
  // Copies n bytes of host memory into device memory, synchronously. Throws Error. (A message
  // that arrived before its recv waits in host memory; the recv may be in device memory.)
  void (*upload)(void* device, const void* host, uint64_t n) = nullptr;
  // True when [ptr, ptr+length) is pinned host memory that GPU threads read at the same
  // address (cudaHostAlloc'd or cudaHostRegister'ed, mapped): a port channel's semaphore there
  // can be waited on by a kernel. False for anything else, never throws.
  bool (*host_mapped)(const void* ptr, uint64_t length) = nullptr;
};

// nullptr unless a device module registered itself.
const DeviceMemoryHooks*& device_memory_hooks();

}  // namespace sluice::detail
