#include "transport/common/signal_target.hpp"

#include <mutex>
#include <string>

#include "cuda/staging.hpp"

namespace sluice::detail {

Status apply_signal(const Registry& registry, uint64_t region, uint64_t offset, uint64_t add) {
  if (offset % 8 != 0)
    return {ErrorCode::kInvalidArgument, "signal: offset " + std::to_string(offset) + " is not 8-byte aligned"};
  Status st;
  RegionPin pin = registry.pin(region, offset, 8, &st, "target");
  if (!pin) return st;
  uint8_t* p = pin.get()->base + offset;
  if (!staging::is_device(pin.get()->location)) {
    // The region's base comes from the registry; alignment of the address, not only of the
    // offset, is what an atomic needs.
    if (reinterpret_cast<uintptr_t>(p) % 8 != 0)
      return {ErrorCode::kInvalidArgument, "signal: the counter's address is not 8-byte aligned"};
    __atomic_fetch_add(reinterpret_cast<uint64_t*>(p), add, __ATOMIC_RELEASE);
    return Status::Ok();
  }
  static std::mutex device_mu;
  std::lock_guard<std::mutex> lk(device_mu);
  try {
    uint64_t v = 0;
    staging::download(&v, p, 8);
    v += add;
    staging::upload(p, &v, 8);
  } catch (const Error& e) {
    return e.status();
  }
  return Status::Ok();
}

}  // namespace sluice::detail
