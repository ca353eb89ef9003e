#include "core/registry.hpp"

#include <sys/random.h>

#include <string>

namespace sluice::detail {

RegionInfo RegionEntry::info() const {
  RegionInfo r;
  r.id = id;
  r.addr = reinterpret_cast<uint64_t>(base);
  r.length = length;
  r.location = location;
  r.name = name;
  r.shareable = memfd >= 0;
  return r;
}

RegionPin::RegionPin(std::shared_ptr<RegionEntry> e) : entry_(std::move(e)) {
  if (entry_) entry_->inflight.fetch_add(1);
}

RegionPin& RegionPin::operator=(RegionPin&& o) noexcept {
  if (this != &o) {
    release();
    entry_ = std::move(o.entry_);
  }
  return *this;
}

void RegionPin::release() {
  if (!entry_) return;
  // seq_cst on both sides (here: the decrement, then `removing`; remove(): `removing`, then
  // the count): either remove() sees the count at 0 or this release sees it waiting.
  if (entry_->inflight.fetch_sub(1) == 1 && entry_->removing.load()) {
    std::lock_guard<std::mutex> lk(entry_->mu);
    entry_->drained.notify_all();
  }
  entry_.reset();
}

// Region ids start at a random point of [2^20, 2^51) (a multiple of 2^20): a peer that
// restarts is a new engine whose regions must not answer to the old one's handles. An
// endpoint that reconnects (ConnectOptions::reconnect), or a program that keeps a
// RemoteHandle across a peer's restart, would otherwise reach the new engine's region with
// the same small id, another buffer, and write into it. Below 2^53 so that JSON readers that
// hold numbers as doubles keep them exact.
Registry::Registry() {
  uint64_t r = 0;
  while (r == 0)
    if (::getrandom(&r, sizeof(r), 0) != static_cast<ssize_t>(sizeof(r))) r = 0;
  next_id_ = ((r % ((uint64_t{1} << 31) - 1)) + 1) << 20;
}

MemoryHandle Registry::add(void* ptr, uint64_t length, Location location, const std::string& name, int memfd,
                           bool owned) {
  if (!ptr) throw Error(ErrorCode::kInvalidArgument, "register_memory: null pointer");
  if (length == 0) throw Error(ErrorCode::kInvalidArgument, "register_memory: zero length");
  auto e = std::make_shared<RegionEntry>();
  e->base = static_cast<uint8_t*>(ptr);
  e->length = length;
  e->location = location;
  e->name = name;
  e->memfd = memfd;
  e->owned = owned;
  std::unique_lock<std::shared_mutex> lk(mu_);
  if (!name.empty() && names_.count(name))
    throw Error(ErrorCode::kInvalidArgument, "register_memory: name '" + name + "' is already registered");
  e->id = next_id_++;
  e->lease_slot = leases_.open(e->id);
  regions_[e->id] = e;
  if (!name.empty()) names_[name] = e->id;
  return MemoryHandle{e->id};
}

std::shared_ptr<RegionEntry> Registry::remove(uint64_t id) {
  std::shared_ptr<RegionEntry> e;
  {
    std::unique_lock<std::shared_mutex> lk(mu_);
    auto it = regions_.find(id);
    if (it == regions_.end())
      throw Error(ErrorCode::kUnknownHandle, "unregister_memory: handle " + std::to_string(id) + " is not registered");
    e = it->second;
    regions_.erase(it);
    if (!e->name.empty()) names_.erase(e->name);
  }
  e->removing.store(true);
  const std::chrono::milliseconds limit{pin_timeout_ms_.load(std::memory_order_relaxed)};
  bool drained;
  {
    std::unique_lock<std::mutex> lk(e->mu);
    drained = e->drained.wait_for(lk, limit, [&] { return e->inflight.load() == 0; });
  }
  leases_.close(e->lease_slot, e->id, lease_timeout_);
  if (!drained)
    throw Error(ErrorCode::kTimeout,
                "unregister_memory: region " + std::to_string(id) + (e->name.empty() ? "" : " ('" + e->name + "')") +
                    " is still in use by " + std::to_string(e->inflight.load()) + " operation(s) after " +
                    std::to_string(limit.count()) +
                    " ms; the handle is unregistered but its memory must not be freed while they run");
  return e;
}

RegionPin Registry::pin_whole(uint64_t id) const {
  // The pin is taken under the lock: remove() erases under the exclusive lock and then waits
  // for the pins, so a pin either exists before the erase (and is waited for) or is never made.
  std::shared_lock<std::shared_mutex> lk(mu_);
  auto it = regions_.find(id);
  return it == regions_.end() ? RegionPin() : RegionPin(it->second);
}

RegionPin Registry::pin(uint64_t id, uint64_t offset, uint64_t length, Status* status, const char* side) const {
  RegionPin pin = pin_whole(id);
  RegionEntry* e = pin.get();
  if (!e) {
    *status = {ErrorCode::kUnknownHandle, std::string(side) + " region handle " + std::to_string(id) + " is not registered"};
    return {};
  }
  if (!in_bounds(offset, length, e->length)) {
    *status = {ErrorCode::kOutOfRange, std::string(side) + " region " + std::to_string(id) + ": offset " +
                                           std::to_string(offset) + " + length " + std::to_string(length) +
                                           " exceeds its " + std::to_string(e->length) + " bytes"};
    return {};
  }
  return pin;
}

std::shared_ptr<RegionEntry> Registry::find(uint64_t id) const {
  std::shared_lock<std::shared_mutex> lk(mu_);
  auto it = regions_.find(id);
  return it == regions_.end() ? nullptr : it->second;
}

std::vector<RegionInfo> Registry::snapshot() const {
  std::shared_lock<std::shared_mutex> lk(mu_);
  std::vector<RegionInfo> out;
  out.reserve(regions_.size());
  for (auto& [id, e] : regions_) out.push_back(e->info());
  return out;
}

std::vector<std::shared_ptr<RegionEntry>> Registry::entries() const {
  std::shared_lock<std::shared_mutex> lk(mu_);
  std::vector<std::shared_ptr<RegionEntry>> out;
  for (auto& [id, e] : regions_) out.push_back(e);
  return out;
}

}  // namespace sluice::detail
