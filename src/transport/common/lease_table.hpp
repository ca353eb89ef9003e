// Leases on regions for transports that touch a peer's memory without the peer's help
// (shm: process_vm_* and mapped memfds). The owner keeps one slot per region in a small
// memfd-backed table that same-host peers map; a peer "enters" a slot around each access and
// the owner, before a region is unregistered, clears the slot and waits for the peer to
// leave. So a region can never be written or read after unregister_memory() returned, even
// by a peer holding a stale handle.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <vector>

namespace sluice::detail {

struct LeaseSlot {
  std::atomic<uint64_t> id;     // region id while registered, 0 otherwise
  std::atomic<uint64_t> users;  // peers inside the region right now
};
static_assert(sizeof(LeaseSlot) == 16);

constexpr uint32_t kNoLease = ~0u;

class LeaseTable {
 public:
  explicit LeaseTable(uint32_t slots = 16384);
  ~LeaseTable();
  LeaseTable(const LeaseTable&) = delete;
  LeaseTable& operator=(const LeaseTable&) = delete;

  int memfd() const { return fd_; }
  uint32_t slots() const { return nslots_; }
  bool ok() const { return table_ != nullptr; }
  // Publish region `id`; kNoLease if the table is full (peers then cannot access it directly).
  uint32_t open(uint64_t id);
  // Withdraw it and wait (up to `timeout`) until no peer is inside. False on timeout.
  bool close(uint32_t slot, uint64_t id, std::chrono::milliseconds timeout);

 private:
  int fd_ = -1;
  uint32_t nslots_ = 0;
  LeaseSlot* table_ = nullptr;
  std::mutex mu_;
  std::vector<uint32_t> free_;
};

// A peer's lease table, mapped into this process.
class PeerLeases {
 public:
  ~PeerLeases();
  // Maps the peer's table from a descriptor the peer passed us (SCM_RIGHTS over a
  // same-host socket, never /proc/<pid>/fd/<number from a message>); the slot count follows
  // from its size. Does not take ownership of fd. False if it is not a table.
  bool map_fd(int fd);
  // True if region `id` is still registered; the caller must leave() afterwards.
  bool enter(uint32_t slot, uint64_t id);
  // While inside: true if the owner has not withdrawn the region since enter(). A copy out of
  // the region is valid only if this still holds after it (the owner may have given up waiting
  // for a stalled peer and reused the memory).
  bool still(uint32_t slot, uint64_t id) const;
  void leave(uint32_t slot);
  uint32_t slots() const { return nslots_; }

 private:
  LeaseSlot* table_ = nullptr;
  uint32_t nslots_ = 0;
};

}  // namespace sluice::detail
