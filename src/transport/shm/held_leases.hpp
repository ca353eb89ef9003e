// Leases a copy holds on a same-host peer's regions (lease_table.hpp), for shm's copies in and
// out of a peer's memory.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "transport/common/lease_table.hpp"

namespace sluice::detail::shm {

// Leases held on the peer's regions for one copy; left when this goes out of scope.
class Held {
 public:
  explicit Held(PeerLeases& l) : leases_(l) {}
  ~Held() {
    for (auto& [slot, id] : held_) leases_.leave(slot);
  }
  Status enter(uint32_t slot, uint64_t id, const char* whose) {
    for (auto& h : held_)
      if (h.second == id) return Status::Ok();
    if (slot == kNoLease || !leases_.enter(slot, id))
      return {ErrorCode::kUnknownHandle, std::string(whose) + " region " + std::to_string(id) + " is no longer registered"};
    held_.emplace_back(slot, id);
    return Status::Ok();
  }
  // After the copy: the bytes count only if the owner withdrew none of the regions meanwhile.
  Status still(const char* whose) const {
    for (auto& [slot, id] : held_)
      if (!leases_.still(slot, id))
        return {ErrorCode::kUnknownHandle, std::string(whose) + " region " + std::to_string(id) +
                                               " was unregistered during the copy; the copy is discarded"};
    return Status::Ok();
  }

 private:
  PeerLeases& leases_;
  std::vector<std::pair<uint32_t, uint64_t>> held_;
};

}  // namespace sluice::detail::shm
