#include "directory/in_memory_directory.hpp"

#include "sluice/error.hpp"

namespace sluice::detail {

void InMemoryDirectory::publish(const EngineInfo& self) {
  std::lock_guard<std::mutex> lk(mu_);
  engines_[self.engine_id] = self;
  cv_.notify_all();
}

void InMemoryDirectory::withdraw(const std::string& engine_id) {
  std::lock_guard<std::mutex> lk(mu_);
  engines_.erase(engine_id);
}

EngineInfo InMemoryDirectory::lookup(const std::string& ref, Clock::time_point deadline) {
  std::unique_lock<std::mutex> lk(mu_);
  if (!cv_.wait_until(lk, deadline, [&] { return engines_.count(ref) != 0; }))
    throw Error(ErrorCode::kTimeout, "directory: no engine '" + ref + "' published before the deadline");
  return engines_.at(ref);
}

size_t InMemoryDirectory::size() const {
  std::lock_guard<std::mutex> lk(mu_);
  return engines_.size();
}

}  // namespace sluice::detail
