// The local memory registry: handles, bounds checks and in-flight pins.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "transport/common/lease_table.hpp"
#include "sluice/error.hpp"
#include "sluice/types.hpp"

namespace sluice::detail {

struct RegionEntry {
  uint64_t id = 0;
  uint8_t* base = nullptr;
  uint64_t length = 0;
  Location location;
  std::string name;
  int memfd = -1;         // engine-allocated shareable memory, else -1
  uint32_t lease_slot = kNoLease;  // slot in the engine's lease table (same-host peers)
  bool owned = false;     // allocated by the engine (freed on removal)
  std::atomic<int64_t> inflight{0};
  // Set by remove() before it waits: only then does the last pin's release lock mu and notify
  // (a completion per op otherwise pays a lock and a notify nobody waits for).
  std::atomic<bool> removing{false};
  std::mutex mu;
  std::condition_variable drained;

  RegionInfo info() const;
};

// Keeps a region from being unregistered while an operation uses it.
class RegionPin {
 public:
  RegionPin() = default;
  explicit RegionPin(std::shared_ptr<RegionEntry> e);
  RegionPin(RegionPin&& o) noexcept = default;
  RegionPin& operator=(RegionPin&& o) noexcept;
  RegionPin(const RegionPin&) = delete;
  RegionPin& operator=(const RegionPin&) = delete;
  ~RegionPin() { release(); }
  void release();
  RegionEntry* get() const { return entry_.get(); }
  explicit operator bool() const { return static_cast<bool>(entry_); }

 private:
  std::shared_ptr<RegionEntry> entry_;
};

class Registry {
 public:
  Registry();
  MemoryHandle add(void* ptr, uint64_t length, Location location, const std::string& name, int memfd = -1,
                   bool owned = false);
  // Removes the handle (new lookups fail) and waits until every pin is released, local ones
  // (at most pin_timeout) and same-host peers' leases (at most lease_timeout).
  // Returns the entry so the caller can free engine-owned memory. Pins still held after
  // pin_timeout throw kTimeout: the handle is gone, but the memory is still in use by
  // operations and must not be freed. (The watchdog fails a stuck op or a stalled peer after
  // op_timeout, and the transports drop what they hold, so this is not expected to happen.)
  std::shared_ptr<RegionEntry> remove(uint64_t id);

  // Bounds-checked lookup that pins the region. On failure returns an empty pin and sets
  // *status to kUnknownHandle or kOutOfRange with a message naming the handle and range.
  RegionPin pin(uint64_t id, uint64_t offset, uint64_t length, Status* status, const char* side = "local") const;
  // The whole region, pinned; empty if the handle is not registered.
  RegionPin pin_whole(uint64_t id) const;
  std::shared_ptr<RegionEntry> find(uint64_t id) const;
  std::vector<RegionInfo> snapshot() const;
  std::vector<std::shared_ptr<RegionEntry>> entries() const;
  const LeaseTable& leases() const { return leases_; }
  void set_lease_timeout(std::chrono::milliseconds t) { lease_timeout_ = t; }
  // How long remove() waits for local pins (endpoints set op_timeout plus a margin).
  void set_pin_timeout(std::chrono::milliseconds t) { pin_timeout_ms_.store(t.count(), std::memory_order_relaxed); }

 private:
  mutable std::shared_mutex mu_;
  std::unordered_map<uint64_t, std::shared_ptr<RegionEntry>> regions_;
  std::unordered_map<std::string, uint64_t> names_;
  uint64_t next_id_;  // random start (Registry()): handles are not reused across incarnations
  LeaseTable leases_;
  std::chrono::milliseconds lease_timeout_{30000};
  std::atomic<int64_t> pin_timeout_ms_{35000};  // EngineConfig's default op_timeout + 5 s
};

// offset + length inside [0, size) without overflow.
inline bool in_bounds(uint64_t offset, uint64_t length, uint64_t size) {
  return offset <= size && length <= size - offset;
}

}  // namespace sluice::detail
