#include "transport/common/lease_table.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>
#include <thread>

#include "core/log.hpp"
#include "core/memfd.hpp"

namespace sluice::detail {

LeaseTable::LeaseTable(uint32_t slots) : nslots_(slots) {
  size_t bytes = size_t(slots) * sizeof(LeaseSlot);
  fd_ = sealed_memfd("sluice-leases", bytes);  // sealed: peers map it (core/memfd.hpp)
  if (fd_ < 0) {
    SLUICE_LOG(kInfo, "lease table unavailable (memfd); same-host peers will not access memory directly");
    return;
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, 0);
  if (p == MAP_FAILED) return;
  table_ = static_cast<LeaseSlot*>(p);  // zero-filled: every slot free
  free_.reserve(slots);
  for (uint32_t i = slots; i > 0; --i) free_.push_back(i - 1);
}

LeaseTable::~LeaseTable() {
  if (table_) ::munmap(table_, size_t(nslots_) * sizeof(LeaseSlot));
  if (fd_ >= 0) ::close(fd_);
}

uint32_t LeaseTable::open(uint64_t id) {
  if (!table_) return kNoLease;
  std::lock_guard<std::mutex> lk(mu_);
  if (free_.empty()) return kNoLease;
  uint32_t s = free_.back();
  free_.pop_back();
  table_[s].id.store(id, std::memory_order_seq_cst);
  return s;
}

bool LeaseTable::close(uint32_t slot, uint64_t id, std::chrono::milliseconds timeout) {
  if (!table_ || slot >= nslots_) return true;
  LeaseSlot& s = table_[slot];
  // Dekker-style with PeerLeases::enter: either the peer sees id 0 and backs off, or we see
  // its users count and wait for it.
  s.id.store(0, std::memory_order_seq_cst);
  auto until = std::chrono::steady_clock::now() + timeout;
  bool ok = true;
  while (s.users.load(std::memory_order_seq_cst) != 0) {
    if (std::chrono::steady_clock::now() > until) {
      // Safe to go on: peers only ever write this region through a mapping of its memfd (whose
      // pages outlive our unmapping) or ask us to write it; a peer reading it finds the slot
      // withdrawn after its copy and discards what it read (PeerLeases::still).
      SLUICE_LOG(kWarn, "region " << id << ": a same-host peer stayed inside it past the op timeout (stopped or dead?); "
                        "withdrawn without it (its late copy is discarded)");
      ok = false;
      break;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  if (ok) {
    std::lock_guard<std::mutex> lk(mu_);
    free_.push_back(slot);
  }  // a slot a peer may still hold is never reused
  return ok;
}

PeerLeases::~PeerLeases() {
  if (table_) ::munmap(table_, size_t(nslots_) * sizeof(LeaseSlot));
}

bool PeerLeases::map_fd(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size <= 0 || st.st_size % sizeof(LeaseSlot) != 0) return false;
  size_t slots = static_cast<size_t>(st.st_size) / sizeof(LeaseSlot);
  if (slots > (1u << 20)) return false;
  void* p = ::mmap(nullptr, slots * sizeof(LeaseSlot), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return false;
  if (table_) ::munmap(table_, size_t(nslots_) * sizeof(LeaseSlot));
  table_ = static_cast<LeaseSlot*>(p);
  nslots_ = static_cast<uint32_t>(slots);
  return true;
}

bool PeerLeases::enter(uint32_t slot, uint64_t id) {
  if (!table_ || slot >= nslots_) return false;
  LeaseSlot& s = table_[slot];
  s.users.fetch_add(1, std::memory_order_seq_cst);
  if (s.id.load(std::memory_order_seq_cst) == id) return true;
  s.users.fetch_sub(1, std::memory_order_seq_cst);
  return false;
}

bool PeerLeases::still(uint32_t slot, uint64_t id) const {
  return table_ && slot < nslots_ && table_[slot].id.load(std::memory_order_seq_cst) == id;
}

void PeerLeases::leave(uint32_t slot) { table_[slot].users.fetch_sub(1, std::memory_order_seq_cst); }

}  // namespace sluice::detail
