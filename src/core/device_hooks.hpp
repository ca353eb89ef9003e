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
};

// nullptr unless a device module registered itself.
const DeviceMemoryHooks*& device_memory_hooks();

}  // namespace sluice::detail
