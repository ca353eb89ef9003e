#include "core/device_hooks.hpp"

namespace sluice::detail {

const DeviceMemoryHooks*& device_memory_hooks() {
  static const DeviceMemoryHooks* hooks = nullptr;
  return hooks;
}

}  // namespace sluice::detail
