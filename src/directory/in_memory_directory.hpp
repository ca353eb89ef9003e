// A directory held in memory: engines in one process that share one object find each other
// by engine id with no listener round trip. Serves tests, and shows what a store-backed
// directory (etcd, Redis) has to do.
#pragma once

#include <condition_variable>
#include <mutex>
#include <string>
#include <unordered_map>

#include "directory/peer_directory.hpp"

namespace sluice::detail {

class InMemoryDirectory final : public PeerDirectory {
 public:
  void publish(const EngineInfo& self) override;
  void withdraw(const std::string& engine_id) override;
  // `ref` is an engine id. Waits until that engine has published (a peer still starting),
  // at most until `deadline`.
  EngineInfo lookup(const std::string& ref, Clock::time_point deadline) override;
  size_t size() const;

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<std::string, EngineInfo> engines_;
};

}  // namespace sluice::detail
