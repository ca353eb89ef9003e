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
};

// nullptr unless a device module registered itself.
const DeviceMemoryHooks*& device_memory_hooks();

}  // namespace sluice::detail
