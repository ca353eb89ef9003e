// Page-locking for CUDA: our own engine-allocated host regions (memfd), and how many pages of a
// range are not in memory (the rule for locking anything).
//
// A copy between pageable host memory and a GPU goes through the driver's bounce buffers at a
// fraction of the copy engine's speed. A peer's memfd region mapped here is locked on its
// first such copy (HostMapping::pin); LocalPins does the same for our own memfd regions, the
// source of a write (or the target of a read) that we copy to or from a peer's GPU: a trainer
// pushing weights out of WeightPublisher.share()'s block. Both lock only fully resident
// ranges: locking faults every page in, and a sparse region must not make us commit memory.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "core/registry.hpp"

namespace sluice::detail::nvlink {

// Pages of [base, base + length) not in memory (mincore), counted in 1 GiB steps; -1 if
// mincore fails.
int64_t absent_pages(const uint8_t* base, uint64_t length);

class LocalPins {
 public:
  LocalPins() = default;
  LocalPins(const LocalPins&) = delete;
  LocalPins& operator=(const LocalPins&) = delete;
  ~LocalPins();

  // Locks `e` on its first call if it is engine-allocated (memfd) and fully resident; true if
  // it is locked (by us, or already by the application). Later calls only look it up.
  bool pin(const RegionEntry& e);
  // The region is gone (no op pins it): unlock it if we locked it.
  void forget(const RegionEntry& e);

 private:
  struct Pin {
    std::once_flag once;
    uint8_t* base = nullptr;
    bool locked = false;  // locked by us: unlock when the region goes
    bool usable = false;  // locked, by us or by someone else
  };
  std::mutex mu_;
  std::unordered_map<uint64_t, std::shared_ptr<Pin>> pins_;
};

}  // namespace sluice::detail::nvlink
